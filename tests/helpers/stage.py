"""Stage servers in-process: small blocks to serve, a request answered without a network, an optimizer stub."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm import compression, protocol, transport
from lightning_swarm.client.routing import PeerLoad, RouterStats, StageRouter
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.protocol import stage_uid
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

    def call_peer(self, stage, peer, method, messages, metadata, batch, check=None, count=True, timeout=None):
        server = self.servers[stage]
        request = DirectRequest(server.uid, list(messages), protocol.encode_metadata(metadata))
        reply = asyncio.run(server.answer_tensors(method, request))
        if check is not None:  # the pipeline's check of the reply, as StageRouter applies it
            check(reply)
        return reply


class InProcessNode:
    """Stands in for a SwarmNode: runs the router's coroutines to completion in the calling thread, and those it
    sends without waiting (a collect that waits for its parcel) on an event loop of its own."""

    policy = None
    peer_id = "trainer"
    _loop = None
    _lock = threading.Lock()

    @staticmethod
    def run(coroutine, timeout=None):
        return asyncio.run(asyncio.wait_for(coroutine, timeout))

    @classmethod
    def submit(cls, coroutine):
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="in-process-node", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, cls._loop)


class PeersRouter(StageRouter):
    """A real router over stages whose peers are in-process stage servers (or fakes of them): ``stages[s]`` maps
    each peer of stage ``s`` to its server, called through ``answer_tensors`` as the direct path calls them; their
    errors travel as the direct path's reply headers carry them (its own conversion, both ways; both paths over a
    real network: test_reliability's test_errors_cross_both_paths_by_name). The peers named in ``first`` are all but
    sure to be chosen first in their stage."""

    def __init__(self, stages: list[dict], first: tuple = (), **kwargs) -> None:
        super().__init__(InProcessNode(), "run", len(stages), refresh_period=float("inf"), **kwargs)
        self.servers = {peer: server for peers in stages for peer, server in peers.items()}
        for stage, peers in enumerate(stages):
            speed = {p: 1e9 if p in first else 1.0 for p in peers}
            self._peers[stage] = {p: PeerLoad(PeerRecord(p, stage, PeerState.SERVING, speed[p], 0)) for p in peers}

    async def _request(self, stage, peer, method, tensors, metadata, timeout, whole=False):
        request = DirectRequest(stage_uid("run", stage), list(tensors), protocol.encode_metadata(metadata))
        try:  # waited for as the direct path waits
            return await asyncio.wait_for(self.servers[peer].answer_tensors(method, request, "trainer"), timeout)
        except TimeoutError:
            raise
        except Exception as e:
            raise transport.header_error(transport.error_header(e)) from None

    def banned(self, peer: str) -> bool:
        return any(peer in peers and peers[peer].banned_until > time.monotonic() for peers in self._peers)


class HeldLock:
    """Stands in for a stage backend's lock: held by the test until it releases it; ``wanted`` is set once the
    worker came for it (it then holds the request it took)."""

    def __init__(self) -> None:
        self._lock, self.wanted = threading.Lock(), threading.Event()

    def acquire(self, *args) -> bool:
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> HeldLock:
        self.wanted.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
