"""A stage server in-process serves any input its blocks take, with side inputs, and refuses what they do not take,
too many samples, and outsiders' streams."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from unittest.mock import patch

import pytest
import torch
from helpers.raw_client import NONE_META, wire
from helpers.stage import HeldLock, StageOptimizerStub, ask, blocks
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from lightning_swarm import compression, device_sync, protocol
from lightning_swarm.errors import NonFiniteInputError, PeerNotAllowedError, StageBusyError, SwarmRequestError
from lightning_swarm.logs import RateLimit
from lightning_swarm.security import AUTH_FIELD, AccessPolicy, create_identity
from lightning_swarm.server.stage_server import BUSY_HOLD, StageServer

CPU = torch.device("cpu")


def evaluation_forward(server: StageServer) -> runtime_pb2.ExpertRequest:
    """A small forward request for ``server``'s stage, not kept for a backward."""
    return runtime_pb2.ExpertRequest(
        uid=server.uid,
        tensors=[compression.serialize(torch.randn(2, 16), "none")],
        metadata=protocol.encode_metadata({"codec": "none", "train": False}),
    )


def test_any_input_the_blocks_take_is_served_others_and_too_many_samples_are_refused():
    """The stage serves every input shape its blocks take (sequence length and batch size may change from request to
    request); an input they do not take (found on the meta device, before any compute) or one claiming more than
    max_request_samples is refused as the caller's fault, the stage untouched."""
    server = StageServer("run", 0, blocks(), CPU, max_request_samples=16)
    try:
        for shape in [(4, 8, 16), (4, 5, 16), (2, 16)]:
            x = torch.randn(*shape)
            assert ask(server, "forward", [x]).shape == x.shape
        params = [p.detach().clone() for p in server.params]
        x = torch.randn(4, 8, 16)
        for wrong in (torch.randn(4, 8, 15), torch.randn(4, 16, 8)):
            for kind, tensors in (("forward", [wrong]), ("backward", [wrong, wrong])):
                refused = re.escape(f"do not take an input of shape {list(wrong.shape)}")
                with pytest.raises(SwarmRequestError, match=refused):
                    ask(server, kind, tensors)
        too_many = torch.randn(17, 8, 16)
        for kind, tensors in (("forward", [too_many]), ("backward", [x, too_many]), ("backward", [too_many] * 2)):
            with pytest.raises(SwarmRequestError, match="at most 16 samples .*claims 17"):
                ask(server, kind, tensors)

        with pytest.raises(SwarmRequestError, match="without a batch dimension"):
            ask(server, "forward", [torch.tensor(1.0)])
        assert server.backward_samples == 0 and len(server.kept) == 0 and server.info()["queued_samples"] == 0
        assert all(torch.equal(p, q) for p, q in zip(server.params, params)) and all(p.grad is None for p in params)
        assert ask(server, "backward", [x, torch.ones_like(x)]).shape == x.shape and server.backward_samples == 4
    finally:
        server.shutdown()


def test_nan_or_inf_is_refused_once_computed_on_and_leaves_nothing_behind():
    """A request's finiteness is computed beside its decoding and read only once the stage computed on it, so no
    request waits to know (on a GPU: no host sync per request). A forward with NaN is refused, its kept graph dropped;
    a backward with NaN or Inf is refused, its gradients never reach the stage optimizer; a valid backward after them
    is accumulated (so the checks can fail)."""
    steps = []

    class Optimizer(StageOptimizerStub):
        def step(self, batch_size: int) -> None:
            steps.append((batch_size, [p.grad.clone() for p in server.params]))

    server = StageServer("run", 0, blocks(), CPU, optimizer=Optimizer())
    order, later = [], device_sync.all_finite_later

    def recorded(tensors):
        flag = later(tensors)
        read = flag.read
        flag.read = lambda: order.append("read") or read()
        return flag

    computed = server.backend.compute
    server.backend.compute = lambda *a, **k: order.append("computed") or computed(*a, **k)
    try:
        x = torch.randn(4, 8, 16)
        nan, inf = x.clone(), torch.ones_like(x)
        nan[1, 2, 3], inf[0, 0, 0] = math.nan, math.inf
        with patch.object(device_sync, "all_finite_later", recorded):
            with pytest.raises(NonFiniteInputError):
                ask(server, "forward", [nan], keep="k", train=True)
            assert order == ["computed", "read"] and len(server.kept) == 0
            for tensors in ([nan, torch.ones_like(x)], [x, nan], [x, inf]):
                with pytest.raises(NonFiniteInputError):
                    ask(server, "backward", tensors)
            assert steps == [] and server.backward_samples == 0 and all(p.grad is None for p in server.params)
            assert ask(server, "forward", [x], keep="k", train=True).shape == x.shape and len(server.kept) == 1
            assert ask(server, "backward", [torch.ones_like(x)], kept="k").shape == x.shape
        deadline = time.monotonic() + 30  # the reply goes out while the stage optimizer takes its turn
        while not steps and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.backward_samples == 4 and len(steps) == 1 and steps[0][0] == 4
        assert all(torch.isfinite(grad).all() for grad in steps[0][1])
    finally:
        server.shutdown()


def test_an_outsiders_stream_is_refused_on_its_first_message(tmp_path):
    """With a secret (and no allow-list), a streamed request without a valid token is refused on its first message:
    the server reads nothing more of it (it used to read up to twice the size cap before checking the token). A
    member's stream, token on its first message, is served."""
    policy = AccessPolicy.create(secret="s3cret")
    member, server_id = (PeerID.from_base58(create_identity(str(tmp_path / n))) for n in ("member", "server"))
    outsider = PeerID.from_base58(create_identity(str(tmp_path / "outsider")))
    server = StageServer("run", 0, blocks(), CPU, policy=policy, max_request_bytes=2**20)
    x = torch.randn(64, 8, 16)  # 32 KiB, sent in 4 KiB chunks
    pulled = []

    def stream(caller: PeerID, metadata: dict, copies: int = 1):
        async def requests():
            for part in list(protocol.chunks([wire(x)])) * copies:
                pulled.append(part)
                yield runtime_pb2.ExpertRequest(
                    uid=server.uid, tensors=[part], metadata=protocol.encode_metadata(metadata)
                )

        async def answer() -> list:
            context = P2PContext("run::StageService.rpc_forward_stream", server_id, caller)
            reply, _ = await protocol.receive_stream(server.rpc_forward_stream(requests(), context), 10, "test")
            return reply

        return answer()

    try:
        with patch.object(protocol, "CHUNK_BYTES", 4096):
            forged = {**NONE_META, AUTH_FIELD: AccessPolicy.create(secret="guess").token("run", outsider, server_id)}
            for metadata in (NONE_META, forged):
                pulled.clear()
                with pytest.raises(PeerNotAllowedError, match="did not prove the swarm's secret"):
                    asyncio.run(stream(outsider, metadata, copies=100))  # 3.2 MB: 3 times the size cap
                assert len(pulled) == 1
            signed = policy.sign_metadata(NONE_META, "run", member, server_id)
            pulled.clear()
            reply = asyncio.run(stream(member, signed))
            assert len(pulled) == 8 and compression.deserialize(reply[0]).shape == x.shape
    finally:
        server.shutdown()


def test_a_flood_of_busy_answers_is_one_log_line_per_caller(caplog):
    """A caller answered busy many times in a row is named in one log line, not in one per answer (a flood of them
    cost the server a log line each, beside the answer itself); another caller answered busy gets its own line (and
    so does each kind of busy answer: a full queue, a place given up to another caller, out of memory)."""
    server = StageServer("run", 0, blocks(), torch.device("cpu"), max_queue=1, throttle=200)
    request = evaluation_forward(server)

    async def flood(callers: list[str]) -> list[str]:
        async def one(caller: str) -> str:
            try:
                await server.answer("forward", request, caller)
                return "served"
            except StageBusyError:
                return "busy"

        return await asyncio.gather(*map(one, callers))

    try:
        with caplog.at_level(logging.WARNING, logger="lightning_swarm.server.stage_server"):
            outcomes = asyncio.run(flood(["flooder"] * 12 + ["other"] * 3))
        lines = [r.getMessage() for r in caplog.records if "refused a forward request" in r.getMessage()]
        assert outcomes.count("busy") >= 12 - 2  # the queue's one place and the request being computed
        said = [tuple(line.split(" from ")[1].split(": ", 1)) for line in lines]  # (caller, the busy answer)
        assert {caller for caller, _ in said} == {"flooder", "other"} and len(set(said)) == len(said) < 12 - 2
    finally:
        server.shutdown()


def test_each_request_runs_in_the_mode_it_asks_for():
    """A forward asks for training or evaluation (dropout on or off), whatever mode the stage's last request left
    it in (the stage switches its modules only when the mode changes)."""
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))
    server = StageServer("run", 0, module, CPU)
    x = torch.randn(4, 16)
    try:
        expected = module[0](x).detach()
        outputs = {train: [] for train in (False, True)}
        for train in (False, True, True, False, False, True):
            outputs[train].append(ask(server, "forward", [x], train=train))
        assert all(torch.equal(output, expected) for output in outputs[False])
        assert not any(torch.equal(output, expected) for output in outputs[True])
        assert module.training and module[1].training  # the last request trained
    finally:
        server.shutdown()


async def until(condition, what: str, patience: float = 30.0) -> None:
    """Let the event loop run until ``condition()`` holds (failing after ``patience`` seconds)."""
    deadline = time.monotonic() + patience
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)


def test_a_caller_refused_again_within_a_second_waits_for_its_busy_answer():
    """A caller's first busy answer each second is sent at once (a trainer fails over at once); its further busy
    answers that second are held BUSY_HOLD seconds, so a caller that resends as soon as it is refused (a flooder)
    sends a few requests a second, not hundreds. Another caller's first busy answer is still sent at once, and so is
    the flooder's first one of the next second. The server's clock is the test's: stopped, then moved on a second."""
    server = StageServer("run", 0, blocks(), CPU, max_queue=1)
    now = [0.0]
    server._busy_at_once = RateLimit(1.0, clock=lambda: now[0])
    server.backend.lock = server.lock = lock = HeldLock()
    request = evaluation_forward(server)

    async def held(caller: str) -> bool:
        """Whether the busy answer to ``caller``'s request was held back (then for BUSY_HOLD seconds at least)."""
        start = time.monotonic()
        answer = asyncio.ensure_future(server.answer("forward", request, caller))
        was_held = False
        while not answer.done():
            was_held = was_held or server._held > 0
            await asyncio.sleep(0)
        with pytest.raises(StageBusyError):
            answer.result()
        assert not was_held or time.monotonic() - start >= BUSY_HOLD - 0.01
        return was_held

    async def scenario() -> tuple[list[bool], bool, bool]:
        served = [asyncio.ensure_future(server.answer("forward", request, "flooder"))]
        await until(lock.wanted.is_set, "the worker took the first request")  # and waits for the lock
        served.append(asyncio.ensure_future(server.answer("forward", request, "flooder")))
        await until(lambda: server._tasks.qsize() == 1, "the second request queued")  # the queue is full
        try:
            flooder = [await held("flooder") for _ in range(3)]
            other = await held("other")
            now[0] += 1.0
            next_second = await held("flooder")
        finally:
            lock.release()
        await asyncio.wait_for(asyncio.gather(*served), 30)
        return flooder, other, next_second

    lock.acquire()  # the worker waits for it to compute
    try:
        flooder, other, next_second = asyncio.run(scenario())
        assert flooder == [False, True, True] and not other and not next_second, (flooder, other, next_second)
    finally:
        server.shutdown()


def test_requests_whose_callers_stopped_waiting_are_dropped_without_error():
    """A queued request whose handler was cancelled (its caller hung up) is dropped, without error, where it gives
    its place to another caller and where the server shuts down (both set an error on a cancelled future before)."""
    server = StageServer("run", 0, blocks(), CPU, max_queue=2)
    request = evaluation_forward(server)
    shutdown_errors: list[BaseException] = []

    def shut_down() -> None:
        try:
            server.shutdown()
        except BaseException as e:
            shutdown_errors.append(e)

    async def scenario() -> list:
        first = asyncio.ensure_future(server.answer("forward", request, "flooder"))
        await asyncio.sleep(0.2)  # taken by the worker, which waits for the lock
        hung_up = [asyncio.ensure_future(server.answer("forward", request, "flooder")) for _ in range(2)]
        await asyncio.sleep(0.2)  # both queued: the queue is full
        for task in hung_up:
            task.cancel()
        other = asyncio.ensure_future(server.answer("forward", request, "other"))  # displaces a hung-up request
        await asyncio.sleep(0.2)
        closing = threading.Thread(target=shut_down)
        closing.start()  # drops the other hung-up request and answers "other" busy
        await asyncio.sleep(0.2)
        server.lock.release()
        closing.join(timeout=30)
        return await asyncio.wait_for(asyncio.gather(first, other, return_exceptions=True), 30)

    server.lock.acquire()  # the worker waits for it to compute
    first, other = asyncio.run(scenario())
    assert not shutdown_errors, shutdown_errors
    assert isinstance(first, runtime_pb2.ExpertResponse)
    assert isinstance(other, StageBusyError) and "shutting down" in str(other), other


def test_a_request_is_queued_computed_and_encoded_while_the_event_loop_is_held():
    """The decoding thread queues the request itself, and the worker hands the output to an encoding thread itself:
    no turn of the event loop stands between a request's decoding and its reply (each turn is a thread's wake-up,
    on a loaded host a fraction of a millisecond or more per hop). Here the loop is held from the end of decoding
    until the reply is encoded; with either hand-over going through the loop, nothing would be encoded before the
    hold ends."""
    server = StageServer("run", 0, blocks(), CPU)
    held, released, during_hold = threading.Event(), threading.Event(), []
    decode, encode = server._decode_request, server._encode

    def hold() -> None:
        held.set()
        released.wait(10)
        held.clear()

    async def scenario() -> runtime_pb2.ExpertResponse:
        loop = asyncio.get_running_loop()

        def decoded_then_hold(*args):
            task = decode(*args)
            loop.call_soon_threadsafe(hold)
            assert held.wait(10)
            return task

        def encoded(*args):
            during_hold.append(held.is_set())
            released.set()
            return encode(*args)

        with patch.object(server, "_decode_request", decoded_then_hold), patch.object(server, "_encode", encoded):
            return await server.answer("forward", evaluation_forward(server))

    try:
        reply = asyncio.run(scenario())
        assert during_hold == [True]
        assert compression.deserialize(reply.tensors[0]).shape == (2, 16)
    finally:
        server.shutdown()


def test_a_request_computed_after_its_reply_threads_stopped_is_answered_busy_not_left_waiting():
    """The worker hands a computed output to a pool of threads that encode it; if that pool was shut down meanwhile
    (the server closing), the request is answered busy at once rather than waiting for a reply that never comes."""
    server = StageServer("run", 0, blocks(), CPU)
    submit, queued = server._submit, threading.Event()

    def submitted(*args) -> None:
        submit(*args)
        queued.set()

    async def scenario() -> BaseException:
        answer = asyncio.ensure_future(server.answer("forward", evaluation_forward(server)))
        await until(queued.is_set, "the request to be decoded and queued")
        server._codec.shutdown(wait=False, cancel_futures=True)
        server.lock.release()
        return await asyncio.wait_for(asyncio.gather(answer, return_exceptions=True), 30)

    server.lock.acquire()  # the worker waits for it to compute
    try:
        with patch.object(server, "_submit", submitted):
            (error,) = asyncio.run(scenario())
        assert isinstance(error, StageBusyError) and "shutting down" in str(error), error
    finally:
        server.shutdown()


class Sleepy(torch.nn.Linear):
    """A block whose forward takes at least 20 ms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            time.sleep(0.02)
        return super().forward(x)


def test_a_throttled_stage_publishes_the_throughput_it_serves_at():
    """throttle=3: a request's measured time holds its compute and the wait after it, so the throughput the stage
    publishes is at most a third of what its compute alone (at least 20 ms for 4 samples) would allow; routers and
    rebalancing see the peer as slow as it serves."""
    server = StageServer("run", 0, Sleepy(16, 16), CPU, throttle=3)
    try:
        for _ in range(3):
            ask(server, "forward", [torch.randn(4, 16)], train=False)
        info = server.info()
    finally:
        server.shutdown()
    assert 0 < info["throughput"] <= 4 / (3 * 0.02), info
