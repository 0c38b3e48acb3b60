"""The stage optimizer's download of a stage's state, on real hivemind DHT nodes and averagers in this process."""

from __future__ import annotations

import torch

from lightning_swarm.node import SwarmNode
from lightning_swarm.optimizer import swarm_optimizer


def _optimizer(node: SwarmNode, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    wrapped = swarm_optimizer(node.dht, "download_test", torch.optim.AdamW(model.parameters(), lr=1e-2), 8, 1.0, 5.0)
    return model, wrapped


def test_download_says_whether_a_state_came_from_a_peer():
    """A joiner's freshly initialised weights must not pass for downloaded ones: ``downloaded`` is false when no
    peer answered (the epoch, 0 on both sides, cannot tell), and true, with the peer's parameters, when one did."""
    first = SwarmNode().start()
    nodes, optimizers = [first], []
    try:
        owner_model, owner = _optimizer(first, seed=0)
        optimizers.append(owner)
        assert owner.load_state_from_peers()  # alone: "at the swarm's epoch" (0), yet nothing came
        assert not owner.downloaded

        nodes.append(SwarmNode(first.visible_maddrs()).start())
        joiner_model, joiner = _optimizer(nodes[1], seed=1)
        optimizers.append(joiner)
        assert not torch.equal(joiner_model.weight, owner_model.weight)
        joiner.load_state_from_peers()
        assert joiner.downloaded
        assert torch.equal(joiner_model.weight, owner_model.weight)
    finally:
        for optimizer in optimizers:
            optimizer.shutdown()
        for node in reversed(nodes):
            node.shutdown()
