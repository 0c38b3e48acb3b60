"""A raw client of one stage server for tests: calls its handlers directly (no router, no retries), each call
bounded by a timeout, so that replies and refusals are seen exactly as the server sent them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import torch
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter
from hivemind.utils.streaming import split_for_streaming

from lightning_swarm import compression, protocol
from lightning_swarm.node import SwarmNode
from lightning_swarm.protocol import stage_uid
from lightning_swarm.server.stage_server import StageServer
from lightning_swarm.stage_api import StageService

TIMEOUT = 20.0
NONE_META = {"codec": "none", "train": True}


def wire(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    return compression.serialize(tensor, "none")


class RawClient:
    """Calls one stage server's handlers directly, each call bounded by a timeout."""

    def __init__(self, node: SwarmNode, address: str, run_id: str, stage: int = 0) -> None:
        self.node, self.peer_id, self.run_id = node, PeerID.from_base58(address.rsplit("/", 1)[-1]), run_id
        self.uid = stage_uid(run_id, stage)
        self.stub = StageServer.get_stub(node.p2p, self.peer_id, namespace=run_id)

    def call(
        self, method: str, tensors: list, metadata=NONE_META, uid: str | None = None, timeout: float = TIMEOUT
    ) -> list[torch.Tensor]:
        raw_metadata = metadata if isinstance(metadata, bytes) else protocol.encode_metadata(metadata)
        request = runtime_pb2.ExpertRequest(
            uid=self.uid if uid is None else uid, tensors=tensors, metadata=raw_metadata
        )
        response = self.node.run(getattr(self.stub, f"rpc_{method}")(request, timeout=timeout), timeout + 5)
        return [compression.deserialize(t) for t in response.tensors]

    def call_like_a_router(self, method: str, tensors: list) -> list[torch.Tensor]:
        """Call through ``protocol.call``, as routers do: unary, or streamed above the unary payload limit."""
        coro = protocol.call(self.stub, method, self.uid, tensors, NONE_META, TIMEOUT)
        reply, _ = self.node.run(coro, TIMEOUT + 5)
        return [compression.deserialize(t) for t in reply]

    def call_stream(self, method: str, tensor: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
        """Send one tensor in chunks of ``chunk_bytes`` to ``rpc_<method>_stream``."""
        raw_metadata = protocol.encode_metadata(NONE_META)
        requests = [
            runtime_pb2.ExpertRequest(uid=self.uid, tensors=[part], metadata=raw_metadata)
            for part in split_for_streaming(wire(tensor), chunk_bytes)
        ]
        assert len(requests) > 1

        async def go() -> list[runtime_pb2.Tensor]:
            stream = await getattr(self.stub, f"rpc_{method}_stream")(iter_as_aiter(requests))
            return (await protocol.receive_stream(stream, TIMEOUT, method))[0]

        return [compression.deserialize(t) for t in self.node.run(go(), TIMEOUT + 5)]

    def raw_unary(self, method: str, data: bytes) -> bytes:
        """Send bytes that are not a protobuf message to a unary handler."""
        name = StageService._get_handle_name(self.run_id, f"rpc_{method}")
        return self.node.run(
            asyncio.wait_for(self.node.p2p._client.call_unary_handler(self.peer_id, name, data), TIMEOUT), TIMEOUT + 5
        )

    def raw_stream(self, method: str, data: bytes) -> bytes:
        """Open a stream handler, send ``data`` framed as one message, and read until the server closes it."""
        name = StageService._get_handle_name(self.run_id, f"rpc_{method}")

        async def go() -> bytes:
            _, reader, writer = await self.node.p2p.call_binary_stream_handler(self.peer_id, name)
            try:
                writer.write(P2P.MESSAGE_MARKER)
                await P2P.send_raw_data(data, writer)
                return await asyncio.wait_for(reader.read(), TIMEOUT)
            finally:
                writer.close()

        return self.node.run(go(), TIMEOUT + 5)

    def info(self, uid: str | None = None) -> dict:
        request = runtime_pb2.ExpertUID(uid=self.uid if uid is None else uid)
        response = self.node.run(self.stub.rpc_info(request, timeout=TIMEOUT), TIMEOUT + 5)
        return protocol.decode_metadata(response.serialized_info)

    def state(self) -> dict[str, torch.Tensor]:
        """The stage's state dict, streamed by rpc_state (as StageRouter.fetch_state reads it)."""
        return self.state_and_step()[0]

    def state_and_step(self) -> tuple[dict[str, torch.Tensor], int | None]:
        """:meth:`state`, and the optimizer step (epoch) it is at (None: the peer does not train)."""
        request = runtime_pb2.ExpertRequest(uid=self.uid)

        async def go():
            return await protocol.receive_stream(await self.stub.rpc_state(request), TIMEOUT, "rpc_state")

        tensors, metadata = self.node.run(go(), TIMEOUT + 5)
        state = {k: compression.deserialize(t) for k, t in zip(metadata["keys"], tensors, strict=True)}
        return state, metadata["step"]


def wait_until_serving(client: RawClient, peer, timeout: float = 90.0) -> dict:
    """The address file appears before the stage handlers are registered: poll rpc_info until it answers."""
    deadline = time.monotonic() + timeout
    while True:
        assert peer.alive(), peer.log()[-3000:]
        try:
            return client.info()
        except Exception as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"stage server never answered rpc_info: {e!r}\n{peer.log()[-3000:]}") from e
            time.sleep(0.5)


def bytes_of(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: (v.dtype, tuple(v.shape), v.contiguous().numpy().tobytes()) for k, v in state.items()}


class Flooder:
    """A trainer that floods one stage server: ``threads`` training forwards of ``tensor`` at once, each kept by the
    server (their backward never comes), each sent again as soon as it is answered, served or busy, until the
    ``with`` block ends. ``outcomes`` counts the answers: served, busy, or another error."""

    def __init__(self, client: RawClient, tensor: torch.Tensor, threads: int = 16) -> None:
        self.client, self.message = client, wire(tensor)
        self.outcomes = {"served": 0, "busy": 0, "error": 0}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._flood, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Flooder:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=TIMEOUT + 10)

    def _flood(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.call("forward", [self.message], {**NONE_META, "keep": uuid.uuid4().hex})
                outcome = "served"
            except P2PHandlerError as e:
                outcome = "busy" if "StageBusyError" in str(e) else "error"
            except Exception:  # a timeout, or the node stopping
                outcome = "error"
            self.outcomes[outcome] += 1


class FloodingPeer:
    """A :class:`Flooder` of the stage server at ``address`` in a process (and node) of its own, at the lowest CPU
    priority: on a swarm it would compute on its own machine, while here it shares the cores with the peers it
    floods. Floods while the ``with`` block runs; ``outcomes`` holds its counts afterwards."""

    def __init__(self, address: str, run_id: str, shape: tuple[int, ...], threads: int = 16) -> None:
        self.command = [sys.executable, __file__, address, run_id, str(threads), *map(str, shape)]
        self.outcomes: dict = {}

    def __enter__(self) -> FloodingPeer:
        self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True, start_new_session=True)
        if self._process.stdout.readline().strip() != "flooding":  # it prints that once it floods, or dies
            self.__exit__()
            raise RuntimeError("the flooding peer did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._process.send_signal(signal.SIGTERM)
        try:
            out, _ = self._process.communicate(timeout=TIMEOUT + 30)
            self.outcomes = json.loads(out.splitlines()[-1]) if out.strip() else {}
        finally:
            if self._process.poll() is None:
                os.killpg(self._process.pid, signal.SIGKILL)  # with its node's daemons
                self._process.wait()


def _flood_until_terminated(address: str, run_id: str, threads: str, *shape: str) -> None:
    """A flooding peer's process (see :class:`FloodingPeer`): its counts, as JSON, are its last line."""
    os.nice(19)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = SwarmNode(initial_peers=[address]).start()
    try:
        with Flooder(RawClient(node, address, run_id), torch.randn(*map(int, shape)), int(threads)) as flooder:
            print("flooding", flush=True)
            stop.wait()
        print(json.dumps(flooder.outcomes), flush=True)
    finally:
        node.shutdown()


if __name__ == "__main__":
    _flood_until_terminated(*sys.argv[1:])
