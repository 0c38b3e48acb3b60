"""Replies relayed unread: the trainer checks an intermediate reply by its header only and sends it on; the next
stage finds NaN or Inf in it, and the peer that sent it is blamed (banned), not the trainer, and its hop runs again
on another peer. Real stage servers, called in process through the direct path's error conversion."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.stage import PeersRouter

from lightning_swarm import compression
from lightning_swarm.block_calls import MetaBlocks
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.errors import NonFiniteInputError
from lightning_swarm.server.stage_server import StageServer

CPU = torch.device("cpu")


class Poisoned:
    """A real stage server whose ``kind`` replies carry NaN (a broken device, or a peer that lies)."""

    def __init__(self, server: StageServer, kind: str) -> None:
        self.server, self.kind, self.poisoned = server, kind, 0

    async def answer_tensors(self, kind, request, caller):
        reply = await self.server.answer_tensors(kind, request, caller)
        if kind != self.kind:
            return reply
        self.poisoned += 1
        return [compression.encode(torch.full_like(compression.deserialize(reply[0]), math.nan), "none")]


def stage(index: int) -> StageServer:
    torch.manual_seed(index)
    return StageServer("run", index, torch.nn.Linear(8, 8), CPU)


def test_nan_relayed_from_a_stage_bans_its_peer_and_its_hop_runs_again():
    """Stage 0's first peer answers forwards with NaN, stage 1's first peer answers backwards with NaN: each is
    found by the stage the trainer relayed its reply to, banned, and its hop redone on the honest peer; output and
    input gradient equal the honest stages'."""
    first, second = stage(0), stage(1)
    liar0, liar1 = Poisoned(stage(0), "forward"), Poisoned(stage(1), "backward")
    router = PeersRouter([{"liar0": liar0, "honest0": first}, {"liar1": liar1, "honest1": second}], ("liar0", "liar1"))
    meta = MetaBlocks([first.module, second.module])
    pipeline = RemotePipeline(router, "none", 1, spans=[(0, 1), (1, 2)], meta=meta)
    x = torch.randn(4, 8, requires_grad=True)
    reference = x.detach().clone().requires_grad_()
    try:
        y = pipeline(x)
        expected = second.module(first.module(reference))
        torch.testing.assert_close(y, expected.detach())
        assert liar0.poisoned == 1 and router.banned("liar0") and router.stats.failed == {"liar0": 1}

        y.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(x.grad, reference.grad)
        assert liar1.poisoned == 1 and router.banned("liar1")
        assert router.stats.failed == {"liar0": 1, "liar1": 1}
    finally:
        for server in (first, second, liar0.server, liar1.server):
            server.shutdown()


def test_nan_in_the_trainers_own_input_is_its_own_fault():
    """NaN in the input the trainer sends to stage 0 is refused as the caller's fault: it raises, no peer banned."""
    router = PeersRouter([{"only": stage(0)}, {"next": stage(1)}])
    pipeline = RemotePipeline(router, "none", 1, spans=[(0, 1), (1, 2)])
    try:
        with pytest.raises(NonFiniteInputError), torch.no_grad():
            pipeline(torch.full((4, 8), math.nan))
        assert router.stats.failed == {}
    finally:
        for server in router.servers.values():
            server.shutdown()
