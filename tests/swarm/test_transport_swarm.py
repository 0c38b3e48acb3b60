"""The direct tensor path with a real peer: a router's calls travel on it and get the same answers as over
libp2p, and a peer whose direct address cannot be reached is called over libp2p."""

from __future__ import annotations

import dataclasses

import torch
from helpers import SERVE_ENV, SMALL_GPT, activation
from helpers.raw_client import RawClient, bytes_of, wait_until_serving, wire

from lightning_swarm import compression, protocol
from lightning_swarm.client.routing import StageRouter
from lightning_swarm.node import SwarmNode

META = {"codec": "none", "train": True}


def decoded(reply: list) -> list[torch.Tensor]:
    return [compression.deserialize(t) for t in reply]


def test_router_calls_the_direct_path_with_the_results_of_libp2p_and_falls_back(swarm):
    peer = swarm.start("server", SMALL_GPT, env={**SERVE_ENV, "SWARM_MAX_REQUEST_BYTES": str(2**26)})
    node = SwarmNode(initial_peers=peer.addresses()).start()
    try:
        client = RawClient(node, peer.addresses()[0], swarm.run_id)
        wait_until_serving(client, peer)
        state_before = bytes_of(client.state())
        direct = StageRouter(node, swarm.run_id, 1, request_timeout=20)
        p2p = StageRouter(node, swarm.run_id, 1, request_timeout=20, direct=False)
        direct.refresh(0, force=True)
        record = direct._peers[0][str(client.peer_id)].record
        assert record.address.startswith("127.0.0.1:"), record

        x, grad = activation(), activation()
        for name, router in [("direct", direct), ("libp2p", p2p)]:
            # forward kept for the caller, its backward from the kept graph, and a backward that recomputes
            forward, _ = router.call(0, "forward", [wire(x)], {**META, "keep": "k1"}, 4)
            kept_grad, _ = router.call(0, "backward", [wire(grad)], {**META, "kept": "k1"}, 4)
            recomputed, _ = router.call(0, "backward", [wire(x), wire(grad)], META, 4)
            results = [decoded(reply)[0] for reply in (forward, kept_grad, recomputed)]
            if name == "direct":
                expected, direct_reply = results, forward[0]
                assert router.stats.direct_calls == 3 and router.stats.p2p_calls == 0, router.stats
            else:
                assert router.stats.p2p_calls == 3 and router.stats.direct_calls == 0, router.stats
                for got, want in zip(results, expected):
                    assert torch.equal(got, want)
        assert expected[0].shape == x.shape and torch.equal(expected[1], expected[2])
        # a reply of the direct path relayed as it came (as a trainer relays it to the next stage), over libp2p
        relayed, _ = p2p.call(0, "forward", [direct_reply], {**META, "train": False}, 4)
        assert torch.equal(decoded(relayed)[0], decoded(p2p.call(0, "forward", [wire(expected[0])], META, 4)[0])[0])
        assert bytes_of(client.state()) == state_before  # no optimizer step (target batch size not reached)

        # a large request: one message each way (no chunks), the same answer as libp2p's streams
        big = activation(640, 32, 32)
        assert protocol.needs_stream([wire(big)])
        over_direct, _ = direct.call(0, "forward", [wire(big)], {**META, "train": False}, 640)
        over_p2p, _ = p2p.call(0, "forward", [wire(big)], {**META, "train": False}, 640)
        assert torch.equal(decoded(over_direct)[0], decoded(over_p2p)[0])
        assert direct.stats.direct_calls == 4 and p2p.stats.p2p_calls == 6, (direct.stats, p2p.stats)

        # a peer named by another (a backward hand-on's next hop) to a router that never chose in its stage: the
        # router reads the stage's records first, and the call goes direct
        named = StageRouter(node, swarm.run_id, 1, request_timeout=20)
        reply = named.call_peer(0, str(client.peer_id), "forward", [wire(x)], {**META, "train": False}, 4)
        assert torch.equal(decoded(reply)[0], expected[0])
        assert (named.stats.direct_calls, named.stats.p2p_calls) == (1, 0), named.stats
        named.close()

        # fallback: a record whose direct address refuses connections; calls go over libp2p and succeed
        direct.refresh_period = 1e9  # keep the doctored record
        load = direct._peers[0][str(client.peer_id)]
        load.record = dataclasses.replace(load.record, address="127.0.0.1:1")
        for _ in range(2):
            reply, _ = direct.call(0, "forward", [wire(x)], {**META, "train": False}, 4)
            assert torch.equal(decoded(reply)[0], expected[0])
        assert direct.stats.p2p_calls == 2 and direct.stats.direct_calls == 4, direct.stats
        assert str(client.peer_id) in direct._unreachable
        assert not direct.stats.failed, direct.stats  # falling back is not a failure of the peer
        direct.close()
    finally:
        node.shutdown()
