"""Checkpoints in-process: one peer claims a path and only it gathers the stages; a checkpoint seeds meta
blocks and a cut pipeline, and records each stage's step."""

from __future__ import annotations

import logging

import torch

from lightning_swarm.checkpointing import CONSISTENT_KEY, STAGE_STEPS_KEY, claim, record_stage_steps
from lightning_swarm.node import SwarmNode


def test_one_peer_writes_a_checkpoint_path(tmp_path):
    """Peers saving the same path at once: exactly one (the smallest peer id) writes it; other paths are free."""
    from concurrent.futures import ThreadPoolExecutor

    first = SwarmNode().start()
    nodes = [first, *(SwarmNode(first.visible_maddrs()).start() for _ in range(2))]

    def claims(node: SwarmNode, path: str) -> bool:
        return claim(node, "claims", path, settle=0.5)

    try:
        path = str(tmp_path / "last.ckpt")
        with ThreadPoolExecutor(3) as pool:
            claimed = list(pool.map(lambda node: claims(node, path), nodes))
        smallest = min(range(3), key=lambda i: str(nodes[i].peer_id))
        assert claimed == [i == smallest for i in range(3)]
        assert all(claims(node, str(tmp_path / f"own{i}.ckpt")) for i, node in enumerate(nodes))
        loser = next(node for i, node in enumerate(nodes) if i != smallest)
        assert not claims(loser, path)  # the writer's claim is still fresh
    finally:
        for node in nodes:
            node.shutdown()


def small_gpt(seed: int, meta: bool = False):
    from gpt import GPT

    torch.manual_seed(seed)
    with torch.device("meta") if meta else torch.device("cpu"):
        return GPT(vocab_size=20, block_size=8, d_model=16, n_layer=3, n_head=2)


def test_checkpoint_seeds_meta_blocks_and_a_cut_pipeline():
    """Without processes: ``load_model_state_dict`` fills a model built on the meta device, and, once the pipeline
    is cut, loads the local modules and the served stage from the checkpoint's keys."""
    from lightning_swarm import SwarmStrategy

    saved = small_gpt(seed=1).state_dict()
    strategy = SwarmStrategy(run_id="ckpt", num_stages=3, stage=1)
    strategy.connect(small_gpt(seed=2, meta=True))
    strategy.load_model_state_dict({"state_dict": saved})
    loaded = strategy.lightning_module.state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)

    strategy = SwarmStrategy(run_id="ckpt", num_stages=3, stage=1)
    model = small_gpt(seed=2)
    strategy.connect(model)
    strategy._partition(model)  # what setup does: keep stage 1, put a placeholder in the pipeline's place
    strategy.load_model_state_dict({"state_dict": saved})
    assert torch.equal(model.head.weight, saved["head.weight"])
    stage = strategy._stage.module.state_dict()
    assert stage.keys() and all(torch.equal(stage[k], saved["blocks.1." + k.split(".", 1)[1]]) for k in stage)


def test_a_checkpoint_records_each_stages_step_and_says_when_they_differ(caplog):
    """Stages step on their own: a checkpoint gathered while the swarm trains may hold stage 0 after its step 4 and
    stage 1 before it. Each stage's step is recorded, and a cut between steps is marked and warned about."""
    same, cut = {"global_step": 8}, {"global_step": 9}
    with caplog.at_level(logging.WARNING, logger="lightning_swarm"):
        record_stage_steps(same, {0: 4, 1: 4})
        assert not caplog.records
        record_stage_steps(cut, {0: 4, 1: 3})
    assert same[STAGE_STEPS_KEY] == {0: 4, 1: 4} and same[CONSISTENT_KEY]
    assert cut[STAGE_STEPS_KEY] == {0: 4, 1: 3} and not cut[CONSISTENT_KEY]
    assert "step 9: the stages were gathered at different steps (stage 0: 4, stage 1: 3)" in caplog.text


def test_only_the_peer_that_writes_a_path_gathers_the_stages(tmp_path):
    """Peers saving the same path at once through SwarmCheckpointIO: one writes it, and only that one completes the
    checkpoint (gathers every stage from the swarm); the others neither gather nor write."""
    from concurrent.futures import ThreadPoolExecutor

    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_swarm.checkpointing import SwarmCheckpointIO

    gathered = []
    ios = [SwarmCheckpointIO(TorchCheckpointIO(), lambda checkpoint, i=i: gathered.append(i)) for i in range(3)]
    first = SwarmNode().start()
    nodes = [first, *(SwarmNode(first.visible_maddrs()).start() for _ in range(2))]
    try:
        for io_, node in zip(ios, nodes):
            io_.join(node, "gather", settle=0.5)
        path = tmp_path / "last.ckpt"
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda io_: io_.save_checkpoint({"state_dict": {}}, path), ios))
        writer = min(range(3), key=lambda i: str(nodes[i].peer_id))
        assert gathered == [writer] and path.exists()
        for i, io_ in enumerate(ios):
            if i != writer:
                io_.remove_checkpoint(path)  # only the writer removes what it wrote
        assert path.exists()
        ios[writer].remove_checkpoint(path)
        assert not path.exists()
    finally:
        for node in nodes:
            node.shutdown()
