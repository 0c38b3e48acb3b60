"""Failures on a peer's side, malformed replies included, send the microbatch to another peer; only the caller's
own mistakes raise; retrying a banned peer does not restart the wait for a stage; a peer that finished training
lingers until no other peer has trained for an update period."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from helpers.stage import PeersRouter
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import P2P

from lightning_swarm import compression, discovery, protocol, transport
from lightning_swarm.block_calls import MetaBlocks
from lightning_swarm.client import routing
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.client.routing import PeerLoad, StageRouter
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.errors import (
    ActivationsLostError,
    NotServingError,
    StageFailedError,
    StageUnavailableError,
    SwarmRequestError,
)
from lightning_swarm.server.stage_host import StageHost
from lightning_swarm.server.stage_server import StageServer
from lightning_swarm.transport import DirectRequest

CPU = torch.device("cpu")
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class FakeClock:
    """Stands in for the ``time`` module in routing: ``sleep`` advances ``monotonic`` at once, so that waits and pauses
    are counted exactly and cost no real time."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def test_wait_for_a_stage_is_not_restarted_by_retrying_a_banned_peer(monkeypatch):
    """A dead peer's record outlives it: each time its ban expires it is tried again, and fails. The time without a
    live peer counts from the first wait on, so the call gives up after stage_wait_timeout (not after max_retries
    attempts spaced by growing pauses, with the wait restarted at each). On a fake clock: the give-up time and the
    attempts are exact, whatever the machine's load."""
    clock = FakeClock()
    monkeypatch.setattr(routing, "time", clock)
    router = StageRouter(None, "run", 1, max_retries=6, stage_wait_timeout=2.0)
    banned_until, attempts = 0.0, []

    def choose(stage, batch, exclude=frozenset()):
        return None if "dead" in exclude or clock.now < banned_until else "dead"

    def call_dead_peer(*args, **kwargs):
        nonlocal banned_until
        attempts.append(clock.now)
        banned_until = clock.now + 1.5  # longer than the first pauses between attempts
        raise ConnectionError("dead")

    monkeypatch.setattr(router, "refresh", lambda stage, force=False: None)
    monkeypatch.setattr(router, "choose", choose)
    monkeypatch.setattr(router, "call_peer", call_dead_peer)
    with pytest.raises(StageUnavailableError, match="has had no live peer for"):
        router.call(0, "forward", [], {}, 1)
    # the dead peer was retried once its ban expired, and the wait went on counting from the first one: it gave up
    # within one pause and one wait tick of stage_wait_timeout, long before max_retries attempts
    assert 2 <= len(attempts) < router.max_retries and attempts == sorted(attempts), attempts
    assert router.stage_wait_timeout <= clock.now <= router.stage_wait_timeout + 1.5, (clock.now, attempts)


def one_stage(peers: dict, first: str = "", **kwargs) -> PeersRouter:
    """A real router over one stage whose peers are ``peers`` (``first`` all but sure to be chosen first)."""
    return PeersRouter([peers], (first,), **kwargs)


def linear_stage(module: Optional[torch.nn.Module] = None) -> StageServer:
    """A stage server of ``module`` (default: a seeded linear layer of 8 features) on the CPU."""
    torch.manual_seed(0)
    return StageServer("run", 0, module or torch.nn.Linear(8, 8), CPU)


class FailsAfterFirst(torch.nn.Linear):
    """A stage whose module fails on every call after its first (a device fault, a broken kernel)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(8, 8)
        self.error, self.calls = error, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            raise self.error
        return super().forward(x)


class NotReady:
    """A peer that does not serve the stage yet (still joining)."""

    async def answer_tensors(self, kind, request, caller):
        raise NotServingError("this peer serves no stage now")


def test_server_faults_fail_over_and_only_the_callers_faults_raise():
    """Whatever fails on a peer's side (its module, its worker, its memory, or it is not ready) sends the microbatch
    to another peer of the stage; a request the caller got wrong raises at once, and bans nobody."""
    healthy = linear_stage()
    faulty = {
        "module fails": linear_stage(FailsAfterFirst(RuntimeError("CUDA error: an illegal memory access"))),
        "out of memory": linear_stage(FailsAfterFirst(torch.OutOfMemoryError("out of memory"))),
        "worker crashed": linear_stage(),
        "not ready": NotReady(),
    }
    faulty["worker crashed"].shutdown()
    x = torch.randn(4, 8)
    expected = healthy.module(x).detach()
    try:
        for name, server in faulty.items():
            if isinstance(server, StageServer) and server.runtime.is_alive():
                asyncio.run(ask_server(server, x))  # the faulty module's first call is its last good one
            router = one_stage({"faulty": server, "healthy": healthy}, first="faulty", stage_wait_timeout=30.0)
            pipeline = RemotePipeline(router, codec="none", microbatches=1)
            with torch.no_grad():
                torch.testing.assert_close(pipeline(x), expected)
            print(f"  {name}: failed over {router.stats.failovers}x, failed calls {router.stats.failed}")
            assert router.stats.chosen.get("faulty") and router.stats.failovers == 1, (name, router.stats)
            assert router.stats.chosen["healthy"] == 1

        router = one_stage({"healthy": healthy})
        pipeline = RemotePipeline(router, codec="none", microbatches=1)
        for wrong in (torch.randn(4, 9), torch.randn(4, 2, 7)):  # the caller's fault: raised, nobody banned
            with torch.no_grad(), pytest.raises(SwarmRequestError, match="do not take an input of shape"):
                pipeline(wrong)
        assert not router.banned("healthy") and router.stats.calls == 2 and not router.stats.failed
    finally:
        for server in [healthy, *faulty.values()]:
            if isinstance(server, StageServer):
                server.shutdown()


async def ask_server(server: StageServer, x: torch.Tensor) -> list:
    request = DirectRequest(server.uid, [compression.encode(x, "none")], protocol.encode_metadata({"codec": "none"}))
    return await server.answer_tensors("forward", request)


class Liar:
    """A peer that answers every call with ``reply(request tensors)``, whatever was asked."""

    def __init__(self, reply) -> None:
        self.reply, self.calls = reply, 0

    async def answer_tensors(self, kind, request, caller):
        self.calls += 1
        return self.reply([compression.deserialize(t) for t in request.tensors])


GARBAGE = {
    "NaN": lambda ts: [compression.encode(torch.full_like(ts[-1], math.nan), "none")],
    "Inf": lambda ts: [compression.encode(ts[-1] / 0, "none")],
    "wrong shape": lambda ts: [compression.encode(ts[-1][:, :4], "none")],
    "fewer samples": lambda ts: [compression.encode(ts[-1][:1], "none")],
    "more samples": lambda ts: [compression.encode(torch.cat([ts[-1]] * 100), "none")],
    "[N, 1, C]": lambda ts: [compression.encode(ts[-1][:, None, :], "none")],
    "integers": lambda ts: [compression.encode(ts[-1].long(), "none")],
    "float64": lambda ts: [compression.encode(ts[-1].double(), "none")],
    "two tensors": lambda ts: [compression.encode(ts[-1], "none")] * 2,
    "no tensor": lambda ts: [],
    "undecodable": lambda ts: [compression.WireTensor(b"\0" * 3, [4, 8], "float32", 0)],
    "oversized": lambda ts: [compression.WireTensor(b"", [4, 2**40], "float32", 0)],
}


@pytest.mark.parametrize("garbage", list(GARBAGE))
def test_a_peer_that_answers_garbage_is_banned_and_the_microbatch_fails_over(garbage):
    """Replies are input too: a forward's output or a backward's input gradient that is malformed (shape, samples,
    dtype, NaN or Inf, size) bans its peer, and the microbatch goes to another peer: the result is the honest one."""
    honest, liar = linear_stage(), Liar(GARBAGE[garbage])
    router = one_stage({"liar": liar, "honest": honest}, first="liar")
    # the replies are checked against what the stage's block returns on the meta device
    pipeline = RemotePipeline(router, "none", 1, spans=[(0, 1)], meta=MetaBlocks([honest.module]))
    x = torch.randn(4, 8, requires_grad=True)
    try:
        with torch.no_grad():
            torch.testing.assert_close(pipeline(x), honest.module(x).detach())
        assert liar.calls == 1 and router.banned("liar") and router.stats.failed == {"liar": 1}
        assert router.stats.failovers == 1

        router._peers[0]["liar"].banned_until = 0.0  # the backward goes to the liar again: it lies there too
        pipeline(x).sum().backward()
        torch.testing.assert_close(x.grad, honest.module.weight.sum(0).expand(4, 8).detach())
        assert router.banned("liar") and router.stats.failed == {"liar": 2}
    finally:
        honest.shutdown()


class Fragile(torch.nn.Linear):
    """A stage that fails on any batch of 3 samples (a fault on the peer's side), but not on the meta device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta" and x.shape[0] == 3:
            raise RuntimeError("CUDA error: an illegal memory access")
        return super().forward(x)


def test_errors_cross_both_paths_by_name():
    """A stage server's errors reach the router as the errors the server raised, over a real network on both paths:
    the direct path (its reply header) and libp2p (hivemind's handler error, unary and streamed), each with its own
    conversion, as StageRouter.call_peer raises them: the caller's mistakes (a refused request, a forward no longer
    kept), a stage it no longer serves, and a failure on the peer's side."""

    def submit(coroutine):
        return RemoteExpertWorker.run_coroutine(coroutine, return_future=True)

    def run(coroutine, timeout=30.0):
        return submit(coroutine).result(timeout)

    server_p2p = run(P2P.create(host_maddrs=[LOOPBACK]))
    caller_p2p = run(P2P.create(initial_peers=run(server_p2p.get_visible_maddrs()), host_maddrs=[LOOPBACK]))
    torch.manual_seed(0)
    stage = StageServer("run", 0, Fragile(8, 8), CPU)
    direct = transport.DirectServer("run", lambda: stage)
    port = run(direct.start(server_p2p))
    run(stage.add_p2p_handlers(server_p2p, namespace="run"))
    server = str(server_p2p.peer_id)
    node = SimpleNamespace(p2p=caller_p2p, peer_id=caller_p2p.peer_id, policy=None, run=run, submit=submit)
    codec = {"codec": "none"}
    streamed = compression.encode(torch.randn(4000, 200), "none")  # 3.2 MB: a stream on libp2p
    assert protocol.needs_stream([compression.to_message(streamed)])
    cases = [  # stage, method, tensors, metadata: what the server raises
        (0, "forward", [torch.randn(4, 9)], codec, SwarmRequestError, "do not take an input of shape [4, 9]"),
        (0, "forward", [streamed], codec, SwarmRequestError, "do not take an input of shape [4000, 200]"),
        (0, "backward", [torch.randn(4, 8)], {**codec, "kept": "gone"}, ActivationsLostError, "no longer holds"),
        (1, "forward", [torch.randn(4, 8)], codec, NotServingError, "no longer serves 'run.stage1'"),
        (0, "forward", [torch.randn(3, 8)], codec, StageFailedError, "illegal memory access"),
    ]
    try:
        for path in ("direct", "libp2p"):
            router = StageRouter(node, "run", 2, refresh_period=float("inf"), direct=path == "direct")
            for k in range(2):
                router._peers[k] = {
                    server: PeerLoad(PeerRecord(server, k, PeerState.SERVING, 1.0, 0, address=f"127.0.0.1:{port}"))
                }
            x = torch.randn(4, 8)
            reply = router.call_peer(0, server, "forward", [compression.encode(x, "none")], codec, 4)
            torch.testing.assert_close(compression.deserialize(reply[0]), stage.module(x).detach())
            assert (router.stats.direct_calls, router.stats.p2p_calls) == ((1, 0) if path == "direct" else (0, 1))
            for k, method, tensors, metadata, error, text in cases:
                encoded = [
                    t if isinstance(t, compression.WireTensor) else compression.encode(t, "none") for t in tensors
                ]
                with pytest.raises(error, match=re.escape(text)):
                    router.call_peer(k, server, method, encoded, metadata, int(encoded[0].size[0]))
            assert not router._unreachable, f"the direct path fell back to libp2p: {router._unreachable}"
            router.close()
    finally:
        run(direct.stop(server_p2p))
        stage.shutdown()
        for p2p in (caller_p2p, server_p2p):
            run(p2p.shutdown())


def test_a_lingering_peer_leaves_only_once_no_trainer_showed_for_an_update_period(monkeypatch):
    """A trainer's record, refreshed every update period for two, can lapse when a refresh comes late, or a read can
    miss it: one read without it must not make the peers that finished leave a stage it still needs. A lingering
    peer leaves once no other peer has shown as training for an update period; a trainer seen again restarts that."""
    period = 0.05
    reads = iter([{"trainer"}, set(), {"trainer"}, set(), {"trainer"}])  # lapses of one read each, then gone
    seen: list[tuple[float, set]] = []

    def training_peers(node, run_id, num_stages):
        found = next(reads, set())
        seen.append((time.monotonic(), found))
        return found | {"me"}

    monkeypatch.setattr(discovery, "training_peers", training_peers)
    host = SimpleNamespace(
        settings=SimpleNamespace(linger=60.0, update_period=period, run_id="r", num_stages=2),
        node=None,
        peer_id="me",
        stop_requested=threading.Event(),
    )
    served = []
    StageHost.linger(host, lambda: served.append(1))
    gone = next(i for i, (_, found) in enumerate(seen) if i >= 4 and not found)  # the first read after the trainer
    assert len(seen) >= gone + 3  # lapses of one read did not end it; at least three reads without the trainer did
    assert seen[-1][0] - seen[gone][0] >= period and not any(found for _, found in seen[gone:])
    assert len(served) == len(seen) - 1  # it served on between every two reads


@pytest.mark.parametrize(
    "others, waits",
    [({"trainer"}, True), (set(), False), (RuntimeError("DHT unreachable"), True)],
    ids=["a trainer trains", "nobody trains", "records unreadable"],
)
def test_a_leaving_peer_waits_for_routers_to_notice_only_while_another_peer_trains(monkeypatch, others, waits):
    """Leaving, a stage peer announces it and keeps answering until routers re-read the records; with no other peer
    training no request can come (every one starts at a trainer), so it stops once the requests already sent are
    answered. When the records cannot be read it waits, as if a trainer trained."""

    def training_peers(node, run_id, num_stages):
        if isinstance(others, Exception):
            raise others
        return others | {"me"}

    monkeypatch.setattr(discovery, "training_peers", training_peers)
    busy = iter([True, True])  # a request already sent: answered before the server stops, either way
    events = []
    server = SimpleNamespace(
        busy=lambda: next(busy, False),
        remove_p2p_handlers=lambda p2p, namespace: None,
        shutdown=lambda: events.append("shutdown"),
    )
    host = SimpleNamespace(
        _announcer=None,
        _others_training=lambda: StageHost._others_training(host),
        settings=SimpleNamespace(update_period=0.5, run_id="r", num_stages=2),
        node=SimpleNamespace(run=lambda coroutine, timeout: None, p2p=None),
        peer_id="me",
        server=server,
        router=None,
        stage=SimpleNamespace(optimizer=None),
    )
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda seconds: (events.append("sleep"), real_sleep(seconds)))
    StageHost.leave(host, grace=10.0)
    assert events[-1] == "shutdown" and host.server is None
    slept = events.count("sleep")
    # busy twice: two sleeps; waiting for routers to notice (1 s here): more, before those
    assert slept > 2 if waits else slept == 2, events
