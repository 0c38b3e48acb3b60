"""Stage-to-stage ("chain") wiring with real stage servers in process: each server hands its output on through a
router of its own, the trainer sends only the first stage's input and collects the last stage's output. Exact
against plain computation and against star wiring; the failure paths (a lost kept forward, a failing or missing
next-stage peer, NaN made by a stage) end as star wiring's do."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch
from helpers.stage import PeersRouter

from lightning_swarm import compression, protocol
from lightning_swarm.block_calls import MetaBlocks
from lightning_swarm.chain_wiring import Receipt, collect_wait, onward_hops
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.errors import (
    ActivationsLostError,
    BadReplyError,
    NotServingError,
    StageFailedError,
    SwarmRequestError,
)
from lightning_swarm.server.onward import Parcels
from lightning_swarm.server.stage_server import StageServer

CPU = torch.device("cpu")
SPANS = [(0, 1), (1, 2), (2, 3)]


class Failing:
    """A stage peer whose every request fails on its side."""

    calls = 0

    async def answer_tensors(self, kind, request, caller):
        self.calls += 1
        raise StageFailedError("this peer's worker died")


class Hanging:
    """A stage peer that never answers (its host is gone, and nothing tells the caller)."""

    async def answer_tensors(self, kind, request, caller):
        await asyncio.sleep(3600)


def stage(index: int, module: torch.nn.Module | None = None) -> StageServer:
    torch.manual_seed(index)
    return StageServer("run", index, module or torch.nn.Linear(8, 8), CPU)


def swarm(stages: list[dict], first: tuple = (), servers_see: list[dict] | None = None, **kwargs) -> PeersRouter:
    """The trainer's router over ``stages`` (``kwargs``: its settings); every real server hands on through a router
    of its own over ``servers_see`` (default: the same peers)."""
    onward = PeersRouter(servers_see or stages, first)
    for peers in stages:
        for server in peers.values():
            if isinstance(server, StageServer):
                server.onward.routes = onward
                server.onward.wait_timeout = 0.2
    return PeersRouter(stages, first, **kwargs)


def pipeline(router: PeersRouter, modules: list, wiring: str = "chain", microbatches: int = 2) -> RemotePipeline:
    return RemotePipeline(router, "none", microbatches, spans=SPANS, meta=MetaBlocks(modules), wiring=wiring)


def plain(modules: list, x: torch.Tensor, microbatches: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of the modules run in this process, one microbatch at a time as the pipeline runs
    them: a matmul's rows need not come out bit-equal in a batch of another size (on an AVX-512 CPU, 8 rows and two
    times 4 differed in the last bit)."""
    outputs, grads = [], []
    for chunk in x.detach().chunk(microbatches):
        chunk = chunk.clone().requires_grad_()
        y = chunk
        for module in modules:
            y = module(y)
        y.square().sum().backward()
        outputs.append(y.detach())
        grads.append(chunk.grad)
    return torch.cat(outputs), torch.cat(grads)


def run(remote: RemotePipeline, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = remote(x)
    y.square().sum().backward()
    return y.detach(), x.grad


def shutdown(router: PeersRouter) -> None:
    for server in router.servers.values():
        if isinstance(server, StageServer):
            server.shutdown()


def test_chain_equals_plain_and_star_and_the_trainer_sends_each_microbatch_once():
    """3 stages: output and input gradient equal plain computation's and star wiring's, exactly; the trainer's own
    calls carry the input and output gradient once per microbatch (a third of star's bytes sent), its stage-0
    calls keep the forwards under this trainer's name on every hop, and no parcel or kept forward is left; the bytes
    counted uncompressed are those sent (no codec), the chained backward's included."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    expected = plain(modules, x)
    chain_router = swarm([{f"p{k}": s} for k, s in enumerate(servers)])
    star_router = PeersRouter([{f"p{k}": s} for k, s in enumerate(servers)])
    try:
        chained = run(pipeline(chain_router, modules), x)
        starred = run(pipeline(star_router, modules, "star"), x)
        for got in (chained, starred):
            torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
        # per microbatch: a forward to stage 0 and a backward to stage 2, each with a collect of the parcel
        assert chain_router.stats.calls == 2 * 4 and star_router.stats.calls == 2 * 6
        assert star_router.stats.bytes_sent == 3 * chain_router.stats.bytes_sent
        for router in (chain_router, star_router):  # uncompressed: every call's tensors counted raw as sent
            assert router.stats.raw_bytes_sent == router.stats.bytes_sent > 0, router.stats
        assert all(len(s.kept) == 0 and len(s.onward.parcels) == 0 for s in servers)
        assert chain_router.stats.failovers == chain_router.stats.recomputed == 0
        assert chain_router.stats.chained == 2 and star_router.stats.chained == 0
    finally:
        shutdown(chain_router)


def test_a_kept_forward_lost_mid_chain_is_recomputed_and_the_chain_goes_on():
    """Stage 1's peer drops its kept forwards before backward: stage 2 cannot hand its gradient on, parks it, and
    the trainer recomputes stage 1 from its input (sent again through stage 0, unkept), then goes on to stage 0.
    The input gradient equals plain computation's; each microbatch counts one recomputation."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    expected = plain(modules, x)
    router = swarm([{f"p{k}": s} for k, s in enumerate(servers)])
    try:
        remote = pipeline(router, modules)
        x_ = x.clone().requires_grad_()
        y = remote(x_)
        servers[1].kept.clear()
        y.square().sum().backward()
        torch.testing.assert_close(x_.grad, expected[1], rtol=0, atol=0)
        assert router.stats.recomputed == 2 and not any(len(s.onward.parcels) for s in servers)
    finally:
        shutdown(router)


def test_a_last_stage_peer_lost_before_backward_is_recomputed_elsewhere_and_counted_as_a_failover():
    """The stage-2 peer that ran the forward dies before the backward comes: the trainer sends stage 2's input again
    through stages 0 and 1 (unkept), has the other stage-2 peer recompute it, then goes on stage to stage."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(4, 8)
    stages = [{"p0": servers[0]}, {"p1": servers[1]}, {"p2": servers[2], "p2b": stage(2)}]
    router = swarm(stages, first=("p2",))
    try:
        remote = pipeline(router, modules, microbatches=1)
        x_ = x.clone().requires_grad_()
        y = remote(x_)
        router.servers["p2"] = Failing()
        y.square().sum().backward()
        torch.testing.assert_close(x_.grad, plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert router.stats.recomputed == router.stats.failovers == 1 and router.banned("p2")
        assert router.stats.chained == 1 and len(servers[0].kept) == len(servers[1].kept) == 0
    finally:
        shutdown(router)
        stages[2]["p2"].shutdown()


def test_a_failing_next_stage_peer_fails_over_inside_the_chain_and_the_trainer_hears_of_it():
    """Stage 0's peer hands its output to a failing peer of stage 1 first, then to the other: the result is exact,
    and the failover reaches the trainer's router (counted with the failed call, and as an event) through the
    receipt."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    failing = Failing()
    router = swarm([{"p0": servers[0]}, {"bad": failing, "p1": servers[1]}, {"p2": servers[2]}], first=("bad",))
    heard = []
    router.on_event = heard.append
    try:
        got = run(pipeline(router, modules, microbatches=1), x)
        torch.testing.assert_close(got[1], plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert failing.calls == 1 and router.stats.failovers == 1 and router.stats.failed == {"bad": 1}
        assert [(e.stage, e.failed_peer, e.retried_on) for e in heard] == [(1, "bad", "p1")]
    finally:
        shutdown(router)


def test_a_failover_inside_the_chain_is_counted_once_where_the_trainer_serves_the_first_stage():
    """A peer that trains and serves stage 0 hands on through its trainer's own router: the failed call to stage
    1's failing peer bans it there, and is counted once, as the one failover it caused (not again from the
    receipt)."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    router = PeersRouter([{"p0": servers[0]}, {"bad": Failing(), "p1": servers[1]}, {"p2": servers[2]}], ("bad",))
    for server in servers:
        server.onward.routes = router
    try:
        got = run(pipeline(router, modules, microbatches=1), x)
        torch.testing.assert_close(got[1], plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert router.stats.failovers == 1 and router.stats.failed == {"bad": 1} and router.banned("bad")
    finally:
        shutdown(router)


@pytest.mark.parametrize("shared", [False, True], ids=["servers-routers", "trainers-router"])
def test_a_backward_the_next_peer_fails_stops_there_and_counts_one_failed_call(shared):
    """Stage 1's peer that kept the forward fails before the backward: stage 2's peer parks the gradient, the
    trainer recomputes stage 1 on its other peer and counts the failover with the one failed call behind it,
    whether stage 2's peer handed on through a router of its own or through the trainer's."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(4, 8)
    stages = [{"p0": servers[0]}, {"p1": servers[1], "p1b": stage(1)}, {"p2": servers[2]}]
    router = swarm(stages, first=("p1",))
    if shared:
        for server in (*servers, stages[1]["p1b"]):
            server.onward.routes = router
    try:
        x_ = x.clone().requires_grad_()
        y = pipeline(router, modules, microbatches=1)(x_)
        for seen_by in (router, servers[2].onward.routes):
            seen_by.servers["p1"] = Failing()
        y.square().sum().backward()
        torch.testing.assert_close(x_.grad, plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert router.stats.recomputed == router.stats.failovers == 1 and router.stats.failed == {"p1": 1}
    finally:
        shutdown(router)
        stages[1]["p1b"].shutdown()
        servers[1].shutdown()


def test_a_backward_to_a_peer_the_server_banned_is_parked_at_once():
    """Two microbatches' forwards kept on stage 1's peer p1, which then fails: the first backward's hand-on to it
    fails and the stage-2 peer bans it; the second is parked at once, p1 not called again (each call to an
    unreachable peer waited until the trainer's deadline), and the trainer recomputes both on p1b. Exact."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(4, 8)
    stages = [{"p0": servers[0]}, {"p1": servers[1], "p1b": stage(1)}, {"p2": servers[2]}]
    router = swarm(stages, first=("p1",))
    failing = Failing()
    try:
        inputs = [chunk.clone().requires_grad_() for chunk in x.chunk(2)]
        remote = pipeline(router, modules, microbatches=1)
        outputs = [remote(chunk) for chunk in inputs]
        for seen_by in (router, servers[2].onward.routes):
            seen_by.servers["p1"] = failing
        for chunk, y in zip(inputs, outputs):
            y.square().sum().backward()
            torch.testing.assert_close(chunk.grad, plain(modules, chunk.detach(), microbatches=1)[1], rtol=0, atol=0)
        assert failing.calls == 1 and router.stats.recomputed == 2
    finally:
        shutdown(router)
        stages[1]["p1b"].shutdown()
        servers[1].shutdown()


def test_a_trainer_told_its_own_stage_server_was_unreachable_computes_the_hop_there_without_banning_itself():
    """The trainer serves stage 0 itself; stage 1's peer cannot reach it to hand the gradient back (to it, the
    trainer fails): the gradient is parked, and the trainer recomputes stage 0 on its own server, banning nobody
    (banning itself left its stage with no live peer). Exact."""
    servers = [stage(k) for k in range(2)]
    modules = [s.module for s in servers]
    x = torch.randn(4, 8)
    stages = [{"trainer": servers[0]}, {"p1": servers[1]}]
    router = swarm(stages, servers_see=[{"trainer": Failing()}, stages[1]])
    router.local_server = servers[0]
    try:
        remote = RemotePipeline(router, "none", 1, spans=SPANS[:2], meta=MetaBlocks(modules), wiring="chain")
        got = run(remote, x)
        torch.testing.assert_close(got[1], plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert router.stats.recomputed == 1 and not router.banned("trainer") and router.stats.failed == {}
    finally:
        shutdown(router)


def test_after_a_chain_stopped_at_a_stage_server_the_trainer_relays_for_a_ban_timeout_doubled_while_it_recurs():
    """Stage 1's peer sees no peer of stage 2 (its view is stale): the first batch's chains stop there after its wait,
    and the trainer relays them; the next batch is relayed at once, without a chain, within ban_timeout. Once that
    passed, chains are tried again; they stop again, and chaining pauses for twice as long. Exact throughout."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    stages = [{f"p{k}": s} for k, s in enumerate(servers)]
    router = swarm(stages, servers_see=[stages[0], stages[1], {}], ban_timeout=60.0)
    remote = pipeline(router, modules)
    try:
        for breaks in (2, 2, 4):
            if breaks == 4:  # the pause is over
                remote._relaying._until = time.monotonic()
            got = run(remote, x)
            torch.testing.assert_close(got, plain(modules, x), rtol=0, atol=0)
            assert router.stats.failovers == router.stats.chain_breaks == breaks and router.stats.chained == 0
            pause = remote._relaying._until - time.monotonic()
            assert 60.0 * (breaks // 2) - 30.0 < pause <= 60.0 * (breaks // 2)
    finally:
        shutdown(router)


def test_a_chain_with_no_peer_for_a_stage_breaks_and_the_trainer_relays_the_microbatch():
    """The servers see no peer of stage 2 (their view is stale): stage 1's peer gives up after its wait, the chain
    is broken without blaming anyone, and the trainer relays that microbatch itself. Exact; one failover each."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    stages = [{f"p{k}": s} for k, s in enumerate(servers)]
    router = swarm(stages, servers_see=[stages[0], stages[1], {}])
    try:
        got = run(pipeline(router, modules), x)
        torch.testing.assert_close(got[0], plain(modules, x)[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], plain(modules, x)[1], rtol=0, atol=0)
        assert router.stats.failovers == router.stats.chain_breaks == 2 and router.stats.failed == {}
    finally:
        shutdown(router)


class LeavesWithItsParcels:
    """A stage peer that serves as ``server`` does, but answers a request whose metadata has ``field`` as a peer that
    does not serve the stage: by default it has moved on to another stage once a parcel is collected."""

    def __init__(self, server: StageServer, field: str = "collect") -> None:
        self.server, self.field = server, field

    async def answer_tensors(self, kind, request, caller):
        if self.field in protocol.decode_metadata(request.metadata):
            raise NotServingError("this peer does not serve the stage")
        return await self.server.answer_tensors(kind, request, caller)


def test_a_gradient_parked_by_a_peer_that_left_is_recomputed_on_another_peer():
    """Stage 1's peer that kept the forward fails, so stage 2's peer parks the gradient, then moves to another stage
    before the trainer collects it: the trainer recomputes stage 2's hop on the other peer of stage 2 (its input sent
    again through stages 0 and 1), then stage 1's. The input gradient is exact."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(4, 8)
    others = [stage(1), stage(2)]
    stages = [{"p0": servers[0]}, {"p1": servers[1], "p1b": others[0]}, {"p2": servers[2], "p2b": others[1]}]
    router = swarm(stages, first=("p1", "p2"))
    try:
        x_ = x.clone().requires_grad_()
        y = pipeline(router, modules, microbatches=1)(x_)
        for seen_by in (router, servers[2].onward.routes):
            seen_by.servers["p1"] = Failing()
        router.servers["p2"] = LeavesWithItsParcels(servers[2])
        y.square().sum().backward()
        torch.testing.assert_close(x_.grad, plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert router.stats.recomputed == 2 and router.banned("p2")
    finally:
        shutdown(router)
        for server in (*servers, *others):
            server.shutdown()


def test_an_input_gradient_parked_by_a_first_stage_peer_that_left_is_recomputed_from_the_top():
    """The chained backward reaches stage 0, whose peer parks the input gradient and leaves before the trainer
    collects it (a peer killed in CI's chaos test did so, and the trainer crashed): the gradients between are gone
    and the chain used up the kept forwards, so the trainer recomputes stage 2's hop, then stage 1's, then stage 0's
    (on its other peer). The input gradient is exact."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(4, 8)
    other = stage(0)
    stages = [{"p0": servers[0], "p0b": other}, {"p1": servers[1]}, {"p2": servers[2]}]
    router = swarm(stages, first=("p0",))
    try:
        x_ = x.clone().requires_grad_()
        y = pipeline(router, modules, microbatches=1)(x_)
        router.servers["p0"] = LeavesWithItsParcels(servers[0])  # the stage servers still reach it
        y.square().sum().backward()
        torch.testing.assert_close(x_.grad, plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert router.stats.recomputed == 3 and router.banned("p0")
        # p0 answers its hop's backward again (no graph: recomputed), so nothing failed that no failover explains
        assert router.stats.failed == {} and router.stats.failovers == 0
    finally:
        shutdown(router)
        for server in (*servers, other):
            server.shutdown()


def test_a_chain_that_cannot_go_on_answers_before_its_caller_stops_waiting():
    """Stage 0's peer hands on to a stage-1 peer that never answers, with a router whose own request timeout is far
    longer than the trainer's: the trainer's budget bounds the hand-on, so stage 0's peer answers that the chain
    broke while the trainer still waits, naming the peer that failed. The trainer then relays the microbatch
    (exact), blaming no stage-0 peer, and reports the failover from that peer to the one the relay used."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(4, 8)
    stages = [{"p0": servers[0]}, {"hang": Hanging(), "p1": servers[1]}, {"p2": servers[2]}]
    onward = PeersRouter(stages, first=("hang",), request_timeout=600.0)
    for server in servers:
        server.onward.routes = onward
    router = PeersRouter(stages, first=("p1",), request_timeout=3.0)
    heard = []
    router.on_event = heard.append
    try:
        got = run(pipeline(router, modules, microbatches=1), x)
        torch.testing.assert_close(got[1], plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert router.stats.failovers == 1 and router.stats.failed == {"hang": 1} and router.stats.chain_breaks == 0
        assert [(e.stage, e.method, e.failed_peer, e.retried_on) for e in heard] == [(1, "forward", "hang", "p1")]
        assert not router.banned("p0") and onward.banned("hang") and onward.stats.failed == {}
    finally:
        shutdown(router)


class NaNs(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * math.nan


def test_nan_made_by_a_stage_is_its_peers_fault_and_its_hop_runs_elsewhere():
    """Stage 0's first peer makes NaN: stage 1 refuses it, that peer reports its own failure, and the trainer bans
    it and sends the microbatch to the honest peer of stage 0."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    liar = stage(0, NaNs())
    router = swarm([{"liar": liar, "p0": servers[0]}, {"p1": servers[1]}, {"p2": servers[2]}], first=("liar",))
    try:
        with torch.no_grad():
            y = pipeline(router, modules, microbatches=1)(torch.ones(4, 8))
        torch.testing.assert_close(y, plain(modules, torch.ones(4, 8), microbatches=1)[0])
        assert router.banned("liar") and router.stats.failed == {"liar": 1}
    finally:
        shutdown(router)
        liar.shutdown()


def test_a_receipt_is_checked_and_onward_hops_are_validated():
    encoded = Receipt(["a", "b"], False, [[1, "forward", "x", "y", "e"]]).encode()
    assert Receipt.read([encoded]) == Receipt(["a", "b"], False, [[1, "forward", "x", "y", "e"]])
    assert Receipt.read([encoded]).after("z", []).peers == ["z", "a", "b"]
    stop = [1, "forward", "x", "", "e"]  # the failed call that stopped a chain: retried on no peer
    malformed = [[[1], "forward", "x", "y", "e"], ["1", "forward", "x", "y", "e"], [1, "forward", None, "y", "e"]]
    assert Receipt.read([Receipt([], True, [stop, *malformed]).encode()]).failovers == [stop]  # the others dropped
    for reply in ([], [encoded, encoded], [compression.encode(torch.ones(3), "none")]):
        with pytest.raises(BadReplyError):
            Receipt.read(reply)
    good = {"parcel": "k", "origin": "t", "onward": [{"stage": 1, "keep": "a", "sides": 0}]}
    assert onward_hops(good, "forward") == good["onward"]
    for bad in (
        {**good, "onward": "x"},
        {**good, "origin": None},
        {**good, "onward": [{"stage": "1"}]},
        {**good, "onward": [{"stage": 1, "sides": -1}]},
        {**good, "parcel": "k" * 65},
    ):
        with pytest.raises(SwarmRequestError):
            onward_hops(bad, "forward")
    with pytest.raises(SwarmRequestError):  # a backward hop names the peer that kept the forward
        onward_hops({**good, "onward": [{"stage": 1, "kept": "a"}]}, "backward")


RELEASE = threading.Event()  # lets HeldBackward's backward go on (a module-level event: servers copy modules)


class _HeldBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        assert RELEASE.wait(60), "never released"
        return grad


class HeldForward(torch.nn.Module):
    """``module``, whose forward waits until :data:`RELEASE` is set."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert RELEASE.wait(60), "never released"
        return self.module(x)


class HeldBackward(torch.nn.Module):
    """``module``, whose backward waits until :data:`RELEASE` is set."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HeldBackward.apply(self.module(x))


def wait_for(condition, seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(0.01)


def test_the_input_gradient_is_asked_for_as_the_chained_backward_starts_and_comes_once_parked():
    """The trainer's collect of the input gradient waits at the first stage's peer while the chained backward is
    still on its way (here held in stage 0's backward): so the gradient comes back as it is parked, not after the
    receipt went back along the chain and another request came. One collect per microbatch, no waiter left, and the
    input gradient is exact."""
    RELEASE.clear()
    first = torch.nn.Linear(8, 8)
    servers = [stage(0, HeldBackward(first)), stage(1), stage(2)]
    modules = [first, servers[1].module, servers[2].module]
    x = torch.randn(4, 8)
    router = swarm([{f"p{k}": s} for k, s in enumerate(servers)])
    try:
        x_ = x.clone().requires_grad_()
        y = pipeline(router, modules, microbatches=1)(x_)
        calls = router.stats.calls
        backward = threading.Thread(target=lambda: y.square().sum().backward())
        backward.start()
        wait_for(lambda: servers[0].onward.parcels.waiting == 1)  # the collect came before the gradient
        assert backward.is_alive() and len(servers[0].onward.parcels) == 0
        RELEASE.set()
        backward.join(60)
        assert not backward.is_alive()
        torch.testing.assert_close(x_.grad, plain(modules, x, microbatches=1)[1], rtol=0, atol=0)
        assert router.stats.calls - calls == 2  # the backward to stage 2, and the one collect from stage 0
        assert servers[0].onward.parcels.waiting == len(servers[0].onward.parcels) == 0
        assert router.stats.recomputed == router.stats.failovers == 0
    finally:
        RELEASE.set()
        shutdown(router)


def test_the_output_is_asked_for_at_the_last_stage_peer_the_trainer_named_as_the_chained_forward_starts():
    """The trainer names the last hop's peer (here one of two) and its collect of the output waits there while the
    chained forward is still on its way (held in that stage's forward); the output comes back exact, with one
    collect per microbatch. Where the hop before fails over from the named peer (it fails), the receipt names the
    peer that ran it and the output is collected there."""
    RELEASE.clear()
    first = torch.nn.Linear(8, 8)
    servers = [stage(0), stage(1), stage(2, HeldForward(first))]
    other = stage(2, first)  # the same weights: either peer computes the same output
    modules = [servers[0].module, servers[1].module, first]
    x = torch.randn(4, 8)
    router = swarm([{"p0": servers[0]}, {"p1": servers[1]}, {"p2": servers[2], "p2b": other}], first=("p2",))
    try:
        remote = pipeline(router, modules, microbatches=1)
        forward = threading.Thread(target=lambda: remote(x))
        forward.start()
        wait_for(lambda: servers[2].onward.parcels.waiting == 1)  # its collect came before its output
        assert forward.is_alive() and other.onward.parcels.waiting == 0
        RELEASE.set()
        forward.join(60)
        torch.testing.assert_close(remote(x), plain(modules, x, microbatches=1)[0], rtol=0, atol=0)
        assert router.stats.calls == 2 * 2  # per forward: the chained request and the one collect
        for seen_by in (router, servers[1].onward.routes):
            seen_by.servers["p2"] = Failing()
        torch.testing.assert_close(remote(x), plain(modules, x, microbatches=1)[0], rtol=0, atol=0)
        assert router.stats.chosen.get("p2b") == 1 and router.stats.failovers == 1
        assert all(s.onward.parcels.waiting == len(s.onward.parcels) == 0 for s in (*servers, other))
    finally:
        RELEASE.set()
        shutdown(router)
        other.shutdown()


def test_a_waiting_collect_that_failed_fails_nobody_and_the_parcel_is_asked_for_again():
    """The peers at both ends of the chain refuse the collects that would wait: the trainer asks for each parcel
    again once the receipt came, blames and bans nobody, and the output and input gradient are exact."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    router = swarm([{f"p{k}": s} for k, s in enumerate(servers)])
    for peer in ("p0", "p2"):
        router.servers[peer] = LeavesWithItsParcels(router.servers[peer], "wait")  # as one not serving yet
    try:
        got = run(pipeline(router, modules), x)
        expected = plain(modules, x)
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
        assert router.stats.calls == 2 * 6  # per microbatch and direction: the chained call and two collects
        assert router.stats.failed == {} and router.stats.failovers == router.stats.recomputed == 0
        assert not router.banned("p0") and not router.banned("p2")
    finally:
        shutdown(router)


def test_a_collect_waits_for_its_parcel_up_to_its_wait_and_a_bounded_number_wait():
    """A collect that waits gets the parcel parked after it came; one whose wait runs out finds none (as a collect
    without a wait does); past ``max_waiting`` waiting collects, or a caller's share of them, or for a key already
    waited for, a collect is answered at once; no waiter is left behind; a wait that is not a number of seconds is
    refused."""
    parcel = compression.encode(torch.ones(2, 3), "none")

    async def waiting(parcels: Parcels, count: int) -> None:
        while parcels.waiting != count:
            await asyncio.sleep(0.001)

    async def scenario() -> None:
        parcels = Parcels(2**20, max_waiting=2, max_waiting_per_caller=1)
        first = asyncio.create_task(parcels.take_when_parked("a", 30.0, "t"))
        await asyncio.wait_for(waiting(parcels, 1), 30.0)
        for key, caller in (("b", "t"), ("a", "u")):  # the caller's only place is taken; so is key "a"'s
            with pytest.raises(ActivationsLostError):
                await parcels.take_when_parked(key, 30.0, caller)
        second = asyncio.create_task(parcels.take_when_parked("b", 30.0, "u"))
        await asyncio.wait_for(waiting(parcels, 2), 30.0)
        with pytest.raises(ActivationsLostError):  # every place is taken
            await parcels.take_when_parked("c", 30.0, "v")
        assert not first.done() and not second.done()
        for key in ("a", "b"):
            threading.Thread(target=parcels.park, args=(key, parcel)).start()  # parked by a hand-on thread
        assert await asyncio.wait_for(asyncio.gather(first, second), 30.0) == [parcel, parcel]
        with pytest.raises(ActivationsLostError):
            await parcels.take_when_parked("c", 0.05, "v")  # never parked: its wait runs out
        parcels.park("d", parcel)
        assert await parcels.take_when_parked("d", 0.0) is parcel
        assert parcels.waiting == len(parcels) == 0

    asyncio.run(scenario())
    assert collect_wait({"collect": "k"}) == 0.0 and collect_wait({"collect": "k", "wait": 5}) == 5.0
    for bad in (-1.0, "5", True, 1e9):
        with pytest.raises(SwarmRequestError):
            collect_wait({"collect": "k", "wait": bad})


class HoldsReceipts:
    """A stage peer that serves as ``server`` does, but holds back its answer to each chained request (its receipt)
    until ``release`` is set, as a long way back along the chain would; then answers it, or with ``fail``, fails
    it. ``held``: the receipts it holds now; ``calls``: the requests it had, by kind."""

    def __init__(self, server: StageServer, release: threading.Event, fail: bool = False) -> None:
        self.server, self.release, self.fail = server, release, fail
        self.held, self.calls = 0, {"forward": 0, "backward": 0}

    async def answer_tensors(self, kind, request, caller):
        self.calls[kind] += 1
        reply = await self.server.answer_tensors(kind, request, caller)
        if "parcel" in protocol.decode_metadata(request.metadata):
            self.held += 1
            try:
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
            finally:
                self.held -= 1
            if self.fail:
                raise StageFailedError("this peer's answer was lost")
        return reply


def test_the_output_and_the_input_gradient_come_before_their_receipts_and_the_backward_waits_for_the_peers():
    """A chain's parcel comes back while the receipt is still on its way back along the chain (held here at the
    peer the trainer called): the forward returns the exact output then, and the backward returns the exact input
    gradient then. The backward of a forward whose receipt is still out waits for it (it names the peers that
    kept the forwards), and sends nothing to the stages before."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    expected = plain(modules, x)
    forward_receipts, backward_receipts = threading.Event(), threading.Event()
    router = swarm([{f"p{k}": s} for k, s in enumerate(servers)])
    first = router.servers["p0"] = HoldsReceipts(servers[0], forward_receipts)
    last = router.servers["p2"] = HoldsReceipts(servers[2], backward_receipts)
    try:
        x_ = x.clone().requires_grad_()
        y = pipeline(router, modules)(x_)
        wait_for(lambda: first.held == 2)  # both microbatches' outputs came while their receipts were held
        torch.testing.assert_close(y, expected[0], rtol=0, atol=0)
        backward = threading.Thread(target=lambda: y.square().sum().backward())
        backward.start()
        time.sleep(0.3)
        assert backward.is_alive() and last.calls["backward"] == 0  # it waits for the receipts: no peers yet
        forward_receipts.set()
        backward.join(60)
        assert not backward.is_alive()
        torch.testing.assert_close(x_.grad, expected[1], rtol=0, atol=0)
        assert last.calls["backward"] == 2  # and the input gradients came before the receipts, still held:
        wait_for(lambda: last.held == 2)
        backward_receipts.set()
        wait_for(lambda: last.held == 0)
        assert router.stats.failed == {} and router.stats.failovers == router.stats.recomputed == 0
        assert all(len(s.kept) == 0 and s.onward.parcels.waiting == len(s.onward.parcels) == 0 for s in servers)
    finally:
        forward_receipts.set()
        backward_receipts.set()
        shutdown(router)


def test_a_receipt_lost_after_the_output_came_makes_the_backward_run_the_forward_again_relayed():
    """The chain's output came, then the peer the trainer called failed to answer (its receipt lost): the peers
    that kept the forwards are unknown, so the backward runs the microbatch's forward again, relayed by the
    trainer and kept on the peers it used (the failed peer banned), and goes back along that route. The input
    gradient is exact, and the failover and the failed call are counted."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    spare = stage(0, servers[0].module)  # the same weights
    x = torch.randn(4, 8)
    expected = plain(modules, x, microbatches=1)
    receipts = threading.Event()
    router = swarm([{"p0": servers[0], "p0b": spare}, {"p1": servers[1]}, {"p2": servers[2]}], first=("p0",))
    failing = router.servers["p0"] = HoldsReceipts(servers[0], receipts, fail=True)
    try:
        x_ = x.clone().requires_grad_()
        y = pipeline(router, modules, microbatches=1)(x_)
        wait_for(lambda: failing.held == 1)  # the output came first
        torch.testing.assert_close(y, expected[0], rtol=0, atol=0)
        receipts.set()
        y.square().sum().backward()
        torch.testing.assert_close(x_.grad, expected[1], rtol=0, atol=0)
        assert router.stats.failed == {"p0": 1} and router.banned("p0")
        assert router.stats.failovers == 1 and router.stats.chosen.get("p0b") == 2  # the forward again, its backward
        assert len(spare.kept) == 0  # the relayed forward's graph, used by its backward
        assert len(servers[1].kept) == 1  # the chain's, which nobody can name now: left to expire
    finally:
        receipts.set()
        shutdown(router)
        spare.shutdown()


def test_a_chain_whose_first_peer_fails_is_sent_again_to_another_peer_of_the_first_stage():
    """The first stage's peer the trainer sent the chained forward to fails: the forward goes to another peer of
    that stage, still stage to stage, the failover and the failed call counted as for any call; exact."""
    servers = [stage(k) for k in range(3)]
    modules = [s.module for s in servers]
    x = torch.randn(8, 8)
    failing = Failing()
    router = swarm([{"p0": failing, "p0b": servers[0]}, {"p1": servers[1]}, {"p2": servers[2]}], first=("p0",))
    try:
        got = run(pipeline(router, modules, microbatches=1), x)
        expected = plain(modules, x, microbatches=1)
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
        assert failing.calls == 1 and router.stats.failed == {"p0": 1} and router.banned("p0")
        assert router.stats.failovers == 1 and router.stats.chained == 1
    finally:
        shutdown(router)
