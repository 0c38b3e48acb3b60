"""Bad input to a real stage server: the caller gets a clear error, the server keeps serving, and its parameters
and accumulated gradients are untouched.

One serve-only peer (a real ``examples/gpt.py`` process) serves the only stage of a run; this process talks to it
through raw hivemind RPC (no router, no retries) so that every refusal is seen exactly as the server sent it.
Every refusal must be a ``SwarmRequestError`` naming the problem, so that a router neither bans the peer nor
retries the request elsewhere.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch
from conftest import SMALL_GPT
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, iter_as_aiter
from hivemind.utils.streaming import split_for_streaming

from lightning_swarm import compression, protocol
from lightning_swarm.client.routing import _remote_error
from lightning_swarm.errors import SwarmRequestError
from lightning_swarm.node import SwarmNode
from lightning_swarm.server.stage_server import StageServer, stage_uid

D_MODEL, BLOCK = 32, 32  # from SMALL_GPT
MAX_REQUEST_BYTES = 1_000_000  # small cap, so that a streamed request above it costs ~1 MB, not 256 MiB
SERVE_ENV = {
    "SWARM_NUM_STAGES": "1",
    "SWARM_ROLE": "serve",
    "SWARM_STAGE": "0",
    "SWARM_COMPRESSION": "none",
    "SWARM_TARGET_BATCH_SIZE": "100000",  # no optimizer step can happen during the test
    "SWARM_UPDATE_PERIOD": "1.0",
    "SWARM_MATCHMAKING_TIME": "1.0",
    "SWARM_AVERAGING_TIMEOUT": "4.0",
    "SWARM_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
}
TIMEOUT = 20.0
NONE_META = {"codec": "none", "train": True}


def activation(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*(shape or (4, BLOCK, D_MODEL)), dtype=dtype)


def wire(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    return compression.serialize(tensor, "none")


class RawClient:
    """Calls one stage server's handlers directly, each call bounded by a timeout."""

    def __init__(self, node: SwarmNode, peer_id: PeerID, run_id: str) -> None:
        self.node, self.peer_id, self.run_id = node, peer_id, run_id
        self.uid = stage_uid(run_id, 0)
        self.stub = StageServer.get_stub(node.p2p, peer_id, namespace=run_id)

    def call(self, method: str, tensors: list, metadata=NONE_META, uid: str | None = None) -> list[torch.Tensor]:
        raw_metadata = metadata if isinstance(metadata, bytes) else protocol.encode_metadata(metadata)
        request = runtime_pb2.ExpertRequest(
            uid=self.uid if uid is None else uid, tensors=tensors, metadata=raw_metadata
        )
        response = self.node.run(getattr(self.stub, f"rpc_{method}")(request, timeout=TIMEOUT), TIMEOUT + 5)
        return [compression.deserialize(t) for t in response.tensors]

    def call_stream(self, method: str, tensor: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
        """Send one tensor in chunks of ``chunk_bytes`` to ``rpc_<method>_stream``."""
        raw_metadata = protocol.encode_metadata(NONE_META)
        requests = [
            runtime_pb2.ExpertRequest(uid=self.uid, tensors=[part], metadata=raw_metadata)
            for part in split_for_streaming(wire(tensor), chunk_bytes)
        ]
        assert len(requests) > 1

        async def go() -> list[runtime_pb2.Tensor]:
            parts = []
            stream = await getattr(self.stub, f"rpc_{method}_stream")(iter_as_aiter(requests))
            async for response in aiter_with_timeout(stream, TIMEOUT):
                parts.extend(response.tensors)
            return protocol.combine(parts)

        return [compression.deserialize(t) for t in self.node.run(go(), TIMEOUT + 5)]

    def raw_unary(self, method: str, data: bytes) -> bytes:
        """Send bytes that are not a protobuf message to a unary handler."""
        name = f"{self.run_id}::StageServer.rpc_{method}"
        return self.node.run(
            asyncio.wait_for(self.node.p2p._client.call_unary_handler(self.peer_id, name, data), TIMEOUT), TIMEOUT + 5
        )

    def raw_stream(self, method: str, data: bytes) -> bytes:
        """Open a stream handler, send ``data`` framed as one message, and read until the server closes it."""
        name = f"{self.run_id}::StageServer.rpc_{method}"

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
        request = runtime_pb2.ExpertRequest(uid=self.uid)

        async def go():
            parts, metadata = [], b""
            async for response in aiter_with_timeout(await self.stub.rpc_state(request), TIMEOUT):
                parts.extend(response.tensors)
                metadata = metadata or response.metadata
            return protocol.combine(parts), protocol.decode_metadata(metadata)

        tensors, metadata = self.node.run(go(), TIMEOUT + 5)
        return {k: compression.deserialize(t) for k, t in zip(metadata["keys"], tensors)}


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


def refused(call, *fragments: str, remote: str = "SwarmRequestError") -> str:
    """``call()`` must fail with the server's ``remote`` exception whose message contains every fragment."""
    pattern = re.escape(remote) + "".join(".*" + re.escape(f) for f in fragments)
    with pytest.raises(P2PHandlerError, match=pattern) as error:
        call()
    message = str(error.value)
    if remote == "SwarmRequestError":  # the router must see it as the caller's fault: no ban, no retry elsewhere
        assert isinstance(_remote_error(error.value), SwarmRequestError), message
    print(f"  refused: {message[message.find(remote) :][:160]}")
    return message


def bytes_of(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: (v.dtype, tuple(v.shape), v.contiguous().numpy().tobytes()) for k, v in state.items()}


def test_bad_requests_are_refused_and_leave_the_stage_untouched(swarm):
    start = time.monotonic()
    peer = swarm.start("server", SMALL_GPT, env=SERVE_ENV)
    address = peer.addresses()[0]
    node = SwarmNode(initial_peers=peer.addresses()).start()
    try:
        client = RawClient(node, PeerID.from_base58(address.rsplit("/", 1)[-1]), swarm.run_id)
        info = wait_until_serving(client, peer)
        assert info["stage"] == 0 and info["backward_samples"] == 0, info
        state_before = bytes_of(client.state())
        assert state_before, "rpc_state returned no tensors"
        x = activation()
        assert client.call("forward", [wire(x)])[0].shape == x.shape  # a valid request works before the bad ones
        print(f"server up after {time.monotonic() - start:.1f}s; sending bad requests")

        # not a protobuf at all: hivemind fails to parse it before the stage sees it, and says so
        with pytest.raises(P2PHandlerError, match="DecodeError.*ExpertRequest"):
            client.raw_unary("forward", b"\xff\xff\xff\xff garbage \x00\x01")
        with pytest.raises(P2PHandlerError, match="DecodeError.*ExpertRequest"):
            client.raw_unary("backward", bytes(range(256)) * 4)
        # garbage framed as a message on a stream handler: the server drops the stream (no hang)
        client.raw_stream("forward_stream", b"\xff\xff\xff\xff garbage")
        client.raw_stream("backward_stream", bytes(range(256)))

        # unknown stage, on every handler that takes a uid
        other = stage_uid(swarm.run_id, 7)
        refused(lambda: client.call("forward", [wire(x)], uid=other), "unknown stage", other)
        refused(lambda: client.call("backward", [wire(x), wire(x)], uid=other), "unknown stage", other)
        refused(lambda: client.info(uid=other), "unknown stage", other)
        refused(lambda: client.call("forward", [wire(x)], uid="no-such-run.stage0"), "unknown stage")

        # metadata
        refused(
            lambda: client.call("forward", [wire(x)], {"codec": "zstd", "train": True}), "unknown compression 'zstd'"
        )
        refused(lambda: client.call("forward", [wire(x)], protocol.encode_metadata([1, 2])), "must be a msgpack dict")
        refused(lambda: client.call("forward", [wire(x)], b"\xc1"), "not valid msgpack")

        # wrong tensor count
        refused(lambda: client.call("forward", []), "forward expects 1 tensor(s), got 0")
        refused(lambda: client.call("forward", [wire(x), wire(x)]), "forward expects 1 tensor(s), got 2")
        refused(lambda: client.call("backward", [wire(x)]), "backward expects 2 tensor(s), got 1")
        refused(lambda: client.call("backward", [wire(x)] * 3), "backward expects 2 tensor(s), got 3")

        # wrong dtype
        x64 = activation(dtype=torch.float64)
        refused(lambda: client.call("forward", [wire(x64)]), "expected a torch.float32 tensor, got torch.float64")
        refused(lambda: client.call("backward", [wire(x64), wire(x)]), "expected a torch.float32 tensor")
        refused(lambda: client.call("backward", [wire(x), wire(x64)]), "expected a torch.float32 tensor")
        refused(
            lambda: client.call("forward", [wire(torch.ones(4, BLOCK, D_MODEL, dtype=torch.int64))]),
            "expected a torch.float32 tensor, got torch.int64",
        )

        # wrong shape: the stage's own forward fails, reported as the request's fault
        wide = activation(4, BLOCK, D_MODEL + 1)
        refused(lambda: client.call("forward", [wire(wide)]), "stage 0 forward failed", "normalized_shape")
        refused(lambda: client.call("backward", [wire(wide), wire(wide)]), "stage 0 backward failed")
        refused(lambda: client.call("forward", [wire(torch.randn(BLOCK * D_MODEL))]), "stage 0 forward failed")
        # backward whose gradient does not match the output (input valid)
        refused(
            lambda: client.call("backward", [wire(x), wire(activation(4, 16, D_MODEL))]),
            "gradient of shape [4, 16, 32] does not match the output [4, 32, 32]",
        )
        refused(
            lambda: client.call("backward", [wire(x), wire(activation(2, BLOCK, D_MODEL))]),
            "gradient of shape [2, 32, 32] does not match the output [4, 32, 32]",
        )

        # NaN / Inf
        nan, inf = x.clone(), x.clone()
        nan[1, 2, 3], inf[0, 0, 0] = float("nan"), float("inf")
        refused(lambda: client.call("forward", [wire(nan)]), "NaN or Inf")
        refused(lambda: client.call("backward", [wire(nan), wire(x)]), "NaN or Inf")
        refused(lambda: client.call("backward", [wire(x), wire(nan)]), "NaN or Inf")
        refused(lambda: client.call("backward", [wire(x), wire(inf)]), "NaN or Inf")

        # a tensor whose buffer does not match its declared shape
        short = wire(x)
        short.buffer = short.buffer[:100]
        refused(lambda: client.call("forward", [short]), "undecodable tensor")
        odd = wire(x)
        odd.dtype = "object"
        refused(lambda: client.call("forward", [odd]), "undecodable tensor")

        # oversized: a claimed shape of 10^11 elements with a 16-byte buffer is refused from its header alone
        huge = runtime_pb2.Tensor(
            buffer=b"\0" * 16, size=[1_000_000, 100_000], dtype="float32", compression=runtime_pb2.CompressionType.NONE
        )
        cap = f"exceeds the cap of {MAX_REQUEST_BYTES} bytes"
        refused(lambda: client.call("forward", [huge]), "tensor of shape [1000000, 100000]", cap)
        refused(lambda: client.call("backward", [wire(x), huge]), "tensor of shape [1000000, 100000]", cap)
        # a real 1.2 MB tensor (above the cap, below hivemind's unary limit)
        big = activation(300, BLOCK, D_MODEL)
        assert big.numel() * 4 > MAX_REQUEST_BYTES and len(wire(big).buffer) < protocol.MAX_UNARY_PAYLOAD_SIZE
        refused(lambda: client.call("forward", [wire(big)]), "tensor of shape [300, 32, 32]", cap)
        # streamed in 256 KiB chunks: refused by the stream's running byte count
        stream_cap = f"request exceeds the size cap of {MAX_REQUEST_BYTES} bytes"
        just_over = torch.randn(MAX_REQUEST_BYTES // 4 + 1)  # only the last chunk crosses the cap
        refused(lambda: client.call_stream("forward", just_over, 2**18), stream_cap)
        refused(lambda: client.call_stream("backward", just_over, 2**18), stream_cap)
        # crossing the cap mid-stream, while the caller still sends: the refusal still reaches it
        refused(lambda: client.call_stream("forward", big, 2**18), stream_cap)
        # while a streamed request below the cap is served (so the refusal above is the cap, not the stream)
        assert client.call_stream("forward", x, 2**12)[0].shape == x.shape

        # (a) the server keeps serving
        assert peer.alive()
        y = client.call("forward", [wire(x)])[0]
        assert y.shape == (4, BLOCK, D_MODEL) and y.dtype == torch.float32 and torch.isfinite(y).all()
        # (b) no bad request reached the stage optimizer's accumulation hook
        info = client.info()
        assert info["backward_samples"] == 0, info
        # (c) the stage's parameters are bit-identical
        assert bytes_of(client.state()) == state_before

        # (d) one valid backward moves the counter: (b) is a real check
        grad = client.call("backward", [wire(x), wire(torch.randn_like(x))])[0]
        assert grad.shape == x.shape and torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert client.info()["backward_samples"] == 4
        assert peer.alive()
        print(f"done in {time.monotonic() - start:.1f}s")
    finally:
        node.shutdown()


def test_empty_tensor_with_a_huge_batch_dimension_is_refused(swarm):
    """A [10^9, 0, 32] tensor costs 0 bytes: it passes the cap and the stage computes on it without error, so its
    batch dimension must not reach the throughput estimate nor the stage optimizer's sample count."""
    peer = swarm.start("server", SMALL_GPT, env=SERVE_ENV)
    node = SwarmNode(initial_peers=peer.addresses()).start()
    try:
        client = RawClient(node, PeerID.from_base58(peer.addresses()[0].rsplit("/", 1)[-1]), swarm.run_id)
        wait_until_serving(client, peer)
        empty = wire(torch.empty(10**9, 0, D_MODEL))
        assert len(empty.buffer) == 0
        outcomes = {}
        for method, tensors in (("forward", [empty]), ("backward", [empty, empty])):
            try:
                outcomes[method] = f"answered {[t.shape for t in client.call(method, tensors)]}"
            except P2PHandlerError as e:
                outcomes[method] = str(e)
        info = client.info()
        print(f"  empty [10^9, 0, 32] requests: {outcomes}; then rpc_info: {info}")
        assert all("SwarmRequestError" in outcome for outcome in outcomes.values()), outcomes
        assert info["backward_samples"] == 0 and info["throughput"] < 1e6, info
        assert peer.alive()
    finally:
        node.shutdown()
