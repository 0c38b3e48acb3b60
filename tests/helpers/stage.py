"""Stage servers in-process: small blocks to serve, a request answered without a network, an optimizer stub."""

from __future__ import annotations

import asyncio

import torch
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm import compression, protocol
from lightning_swarm.client.routing import RouterStats
from lightning_swarm.server.stage_server import StageServer
from lightning_swarm.transport import DirectRequest


def blocks() -> nn.Sequential:
    """Three small MLP blocks (16 features), the same weights on every call."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)))


def ask(server: StageServer, kind: str, tensors: list[torch.Tensor], **metadata: str) -> torch.Tensor:
    """``server``'s answer to a ``kind`` request (forward, backward) of ``tensors``, uncompressed, without a network."""
    request = runtime_pb2.ExpertRequest(
        uid=server.uid,
        tensors=[compression.serialize(t, "none") for t in tensors],
        metadata=protocol.encode_metadata({"codec": "none", **metadata}),
    )
    response = asyncio.run(server.answer(kind, request))
    return compression.deserialize(response.tensors[0])


class StageOptimizerStub:
    """What a stage server asks of its optimizer, doing nothing: tests override the parts they watch."""

    local_epoch = 0

    def step(self, batch_size: int) -> None:
        pass

    def zero_grad(self) -> None:
        pass

    def follow_swarm(self) -> None:
        pass

    def apply_finished_update(self, wait: bool = False) -> None:
        pass

    def progress(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}


class InProcessRouter:
    """Routes every call straight to stage servers in this process, as StageRouter does for a peer's own stage."""

    def __init__(self, servers: list[StageServer]) -> None:
        self.servers, self.num_stages, self.stats = servers, len(servers), RouterStats()

    def call(self, stage, method, messages, metadata, batch, prefer=None, check=None):
        return self.call_peer(stage, "peer", method, messages, metadata, batch, check), "peer"

    def call_peer(self, stage, peer, method, messages, metadata, batch, check=None):
        server = self.servers[stage]
        request = DirectRequest(server.uid, list(messages), protocol.encode_metadata(metadata))
        reply = asyncio.run(server.answer_tensors(method, request))
        if check is not None:  # the pipeline's check of the reply, as StageRouter applies it
            check(reply)
        return reply
