"""Bad input to a real stage server: the caller gets a clear error, the server keeps serving, and its parameters
and accumulated gradients are untouched.

One serve-only peer (a real ``examples/gpt.py`` process) serves the only stage of a run; this process talks to it
through raw hivemind RPC (no router, no retries) so that every refusal is seen exactly as the server sent it.
Every refusal must be a ``SwarmRequestError`` naming the problem, so that a router neither bans the peer nor
retries the request elsewhere.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import BLOCK, D_MODEL, MAX_REQUEST_BYTES, SERVE_ENV, SMALL_GPT, activation
from helpers.raw_client import FloodingPeer, RawClient, bytes_of, wait_until_serving, wire
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from lightning_swarm import protocol
from lightning_swarm.client.routing import _remote_error
from lightning_swarm.errors import NotServingError, SwarmRequestError
from lightning_swarm.node import SwarmNode
from lightning_swarm.protocol import stage_uid


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


MAX_REQUEST_SAMPLES = 2048  # below the default: the setting reaches the peer's stage server


def test_bad_requests_are_refused_and_leave_the_stage_untouched(swarm):
    start = time.monotonic()
    peer = swarm.start("server", SMALL_GPT, env={**SERVE_ENV, "SWARM_MAX_REQUEST_SAMPLES": str(MAX_REQUEST_SAMPLES)})
    address = peer.addresses()[0]
    node = SwarmNode(initial_peers=peer.addresses()).start()
    try:
        client = RawClient(node, address, swarm.run_id)
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

        # another stage of the run (the caller's view is stale: it fails over), then an unknown run
        other = stage_uid(swarm.run_id, 7)
        stale = "NotServingError"
        refused(lambda: client.call("forward", [wire(x)], uid=other), "no longer serves", other, remote=stale)
        refused(lambda: client.call("backward", [wire(x), wire(x)], uid=other), other, remote=stale)
        refused(lambda: client.info(uid=other), "no longer serves", other, remote=stale)
        assert isinstance(_remote_error(P2PHandlerError("NotServingError('x')")), NotServingError)
        refused(lambda: client.call("forward", [wire(x)], uid="no-such-run.stage0"), "unknown stage")
        # more samples than the peer's max_request_samples setting (SWARM_MAX_REQUEST_SAMPLES) reaches its server
        many = activation(MAX_REQUEST_SAMPLES + 1, 1, 1)  # few bytes: refused for its samples
        refused(lambda: client.call("forward", [wire(many)]), f"at most {MAX_REQUEST_SAMPLES} samples")

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

        # wrong shape: an input the stage's blocks do not take (checked on the meta device), refused before any
        # compute; an input of another sequence length ([N, 1, C]) is one the blocks take, and is served
        wide = activation(4, BLOCK, D_MODEL + 1)
        refused(lambda: client.call("forward", [wire(wide)]), "blocks do not take an input of shape [4, 32, 33]")
        refused(lambda: client.call("backward", [wire(wide), wire(wide)]), "do not take an input of shape [4, 32, 33]")
        flat = torch.randn(BLOCK * D_MODEL)
        refused(lambda: client.call("forward", [wire(flat)]), f"do not take an input of shape [{BLOCK * D_MODEL}]")
        short = client.call("forward", [wire(activation(12, 1, D_MODEL))])
        assert short[0].shape == (12, 1, D_MODEL)

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
        non_finite = {"remote": "NonFiniteInputError"}  # a SwarmRequestError the caller may pin on whom it relayed
        refused(lambda: client.call("forward", [wire(nan)]), "NaN or Inf", **non_finite)
        refused(lambda: client.call("backward", [wire(nan), wire(x)]), "NaN or Inf", **non_finite)
        refused(lambda: client.call("backward", [wire(x), wire(nan)]), "NaN or Inf", **non_finite)
        refused(lambda: client.call("backward", [wire(x), wire(inf)]), "NaN or Inf", **non_finite)

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
        client = RawClient(node, peer.addresses()[0], swarm.run_id)
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


def test_a_flood_of_requests_is_answered_busy_and_the_server_keeps_serving(swarm):
    """64 concurrent requests to a server that queues at most 4 (and computes slowly, throttled): the excess is
    answered "busy" at once (the queue does not grow), the refusals are logged (one line per caller and kind every
    10 s: a line for each cost the server as much as the answer), and the server then serves again."""
    env = {**SERVE_ENV, "SWARM_MAX_QUEUE": "4", "SWARM_THROTTLE": "200"}
    peer = swarm.start("server", SMALL_GPT, env=env)
    node = SwarmNode(initial_peers=peer.addresses()).start()
    try:
        client = RawClient(node, peer.addresses()[0], swarm.run_id)
        wait_until_serving(client, peer)
        before = client.state()
        x = wire(activation())

        def forward(_):
            try:  # the last of the 5 served waits for 4 throttled forwards: over 25 s on a busy machine
                client.call("forward", [x], {"codec": "none", "train": False}, timeout=120)
                return "served"
            except P2PHandlerError as e:
                return "busy" if "StageBusyError" in str(e) else str(e)

        start = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            outcomes = list(pool.map(forward, range(64)))
        took = time.monotonic() - start
        counts = {outcome: outcomes.count(outcome) for outcome in set(outcomes)}
        print(f"  64 concurrent forwards: {counts} in {took:.1f}s")
        assert set(counts) <= {"served", "busy"}, counts
        assert counts.get("busy", 0) >= 64 - 5 - 8  # at most the queue, the one computing and a few finished
        assert counts.get("served", 0) >= 1
        assert "is busy (4 requests queued)" in peer.log()
        assert client.call("forward", [x], {"codec": "none", "train": False})[0].shape == (4, BLOCK, D_MODEL)
        assert bytes_of(client.state()) == bytes_of(before) and peer.alive()
    finally:
        node.shutdown()


def test_a_flooding_trainer_does_not_starve_another(swarm, tmp_path):
    """Two trainers share a stage server whose queue holds 8 requests. One floods it from 16 threads with training
    forwards that it never follows with their backward (filling the queue and the kept-activation budget); the
    other, a normal trainer process, keeps its share of both: it is never answered busy, none of its forwards'
    graphs is dropped (no backward recomputes), and it does not collapse (benchmarks/flooding.py measures how much
    of its speed it keeps; the flooder, a process of its own, runs at the lowest CPU priority, as if on its own
    machine, but the stage server's work for it still shares this machine's cores with the trainer)."""

    server_env = {**SERVE_ENV, "SWARM_MAX_QUEUE": "8", "SWARM_MAX_ACTIVATION_BYTES": str(4 * 2**20)}
    peer = swarm.start("server", SMALL_GPT, env=server_env)
    node = SwarmNode(initial_peers=peer.addresses()).start()
    try:
        wait_until_serving(RawClient(node, peer.addresses()[0], swarm.run_id), peer)
    finally:
        node.shutdown()

    def train(name: str) -> dict:
        record = tmp_path / f"{name}.json"
        args = [*SMALL_GPT, "--max-steps", "40", "--history", str(record)]
        # 4 microbatches in flight: its full share of the queue's 8 places, no more (a trainer that sends more than
        # its share is answered busy for the rest, as the flooder is)
        swarm.start(name, args, env={**server_env, "SWARM_ROLE": "drive", "SWARM_STAGE": "", "SWARM_MICROBATCHES": "4"})
        assert swarm.wait(name, timeout=300) == 0, swarm.peers[name].log()[-3000:]
        return json.loads(record.read_text())

    alone = train("alone")
    with FloodingPeer(peer.addresses()[0], swarm.run_id, (4, BLOCK, D_MODEL)) as flooder:
        flooded = train("flooded")
    rates = [steady_rate(history["times"]) for history in (alone, flooded)]
    busy = re.findall(r"refused a \w+ request from (\S+): StageBusyError", peer.log())
    print(
        f"  steps/s alone {rates[0]:.2f}, beside the flooder {rates[1]:.2f} ({rates[1] / rates[0]:.2f}x); "
        f"flooder's answers {flooder.outcomes}; busy answers to {set(busy)}; recomputed {flooded['recomputed']}"
    )
    assert flooder.outcomes["busy"] > 0 and flooder.outcomes["served"] > 0, flooder.outcomes
    assert len(set(busy)) == 1  # all to the flooder: a caller's first busy answer of each kind is always logged
    assert flooded["steps"] == 40 and flooded["recomputed"] == 0 and not flooded["failed_calls_per_peer"]
    assert "other callers need their share" in peer.log() and peer.alive()
    # the collapse it guards against: 0.03-0.14 before fair shares. On 2 cores shared with the flooder, the stage
    # server's work for it and another test, the trainer kept 0.28-0.37 in suites (0.48 in benchmarks/flooding.py)
    assert rates[1] >= 0.2 * rates[0]


def steady_rate(times: list[float], skip: int = 5) -> float:
    """Steps per second after the first ``skip`` steps (start-up)."""
    return (len(times) - 1 - skip) / (times[-1] - times[skip])
