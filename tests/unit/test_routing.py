"""Choosing a peer: stochastic wiring shares work by throughput and load."""

from __future__ import annotations

import threading
import time

from lightning_swarm.client.routing import PeerLoad, StageRouter
from lightning_swarm.discovery import PeerRecord, PeerState


def _router_with(loads: dict) -> StageRouter:
    """A router over one stage whose peer loads are given (no network: the DHT is never refreshed)."""
    router = StageRouter(node=None, run_id="unit", num_stages=1, refresh_period=float("inf"))
    router._peers[0] = loads
    return router


def _shares(router, draws: int = 20000) -> dict:
    counts: dict = {}
    for _ in range(draws):
        peer = router.choose(0, batch=8)
        counts[peer] = counts.get(peer, 0) + 1
    return {peer: n / draws for peer, n in counts.items()}


def test_stochastic_wiring_shares_work_by_throughput_and_load():
    def load(throughput=0.0, **kwargs) -> PeerLoad:
        record = PeerRecord("p", 0, PeerState.SERVING, throughput, kwargs.pop("queue", 0))
        return PeerLoad(record, **kwargs)

    shares = _shares(_router_with({"fast": load(300.0), "slow": load(100.0)}))
    assert abs(shares["fast"] - 0.75) < 0.02  # idle peers: in proportion to throughput

    shares = _shares(_router_with({"a": load(100.0, in_flight=24), "b": load(100.0)}))
    assert abs(shares["b"] - 0.8) < 0.02  # 8 samples to do on b, 32 on a: b is 4x as likely

    shares = _shares(_router_with({"known": load(100.0), "new": load(0.0)}))
    assert abs(shares["new"] - 0.5) < 0.02  # a newcomer is assumed as fast as the fastest, so it gets tried

    banned = load(1000.0, banned_until=time.monotonic() + 60)
    assert _shares(_router_with({"banned": banned, "ok": load(1.0)}), draws=100) == {"ok": 1.0}
    assert _router_with({"banned": banned}).choose(0, batch=8) is None


def test_a_ban_doubles_with_each_failure_in_a_row_up_to_four_ban_timeouts():
    """Doubling without end kept a stage whose peers were all banned waiting longer than stage_wait_timeout for a
    peer that had recovered: capped at MAX_BAN_FACTOR ban timeouts."""
    router = _router_with({"p": PeerLoad(PeerRecord("p", 0, PeerState.SERVING, 1.0, 0))})
    bans = []
    for _ in range(6):
        router._ban(0, "p")
        bans.append(round((router._peers[0]["p"].banned_until - time.monotonic()) / router.ban_timeout, 2))
    assert bans == [1, 2, 4, 4, 4, 4]


def test_a_peer_never_chooses_itself_for_a_stage_it_moved_away_from():
    """The record of the stage a peer moved from outlives the move (its time to live): other routers find out from a
    failed call, but this peer's own call to itself went over libp2p and failed ("dial to self attempted"), a
    failover at every move. It is chosen for the stage its own server serves, and never for another."""
    from types import SimpleNamespace

    def serving() -> PeerLoad:
        return PeerLoad(PeerRecord("p", 0, PeerState.SERVING, 100.0, 0))

    router = StageRouter(node=SimpleNamespace(peer_id="me"), run_id="unit", num_stages=2, refresh_period=float("inf"))
    router._peers = [{"me": serving(), "other": serving()}, {"me": serving()}]
    router.local_server = SimpleNamespace(stage=1)  # moved from stage 0 to stage 1
    assert {router.choose(0, batch=8) for _ in range(200)} == {"other"}
    assert router.choose(1, batch=8) == "me"
    router.local_server = None  # left serving altogether
    assert router.choose(1, batch=8) is None
    router.local_server = SimpleNamespace(stage=0)
    assert {router.choose(0, batch=8) for _ in range(200)} == {"me", "other"}


def test_stale_records_are_read_again_in_the_background_while_microbatches_go_on(monkeypatch):
    """Only the first read of a stage's records is waited for: a stale one is refreshed on another thread, and
    choosing a peer meanwhile takes the records at hand instead of waiting for the DHT."""
    from lightning_swarm import discovery

    release, reads = threading.Event(), []

    def fetch_stage(node, run_id, stage):
        reads.append(threading.current_thread().name)
        if len(reads) > 1:  # the second read, on the refresher's thread: a slow DHT, until released
            assert release.wait(30)
        peers = ["old"] if len(reads) == 1 else ["new"]
        return {p: PeerRecord(p, stage, PeerState.SERVING, 1.0, 0) for p in peers}

    monkeypatch.setattr(discovery, "fetch_stage", fetch_stage)
    router = StageRouter(node=None, run_id="unit", num_stages=1, refresh_period=0.0)
    try:
        assert router.choose(0, batch=1) == "old" and reads == [threading.current_thread().name]
        assert router.choose(0, batch=1) == "old"  # stale: read again behind, the stale record chosen meanwhile
        assert router.choose(0, batch=1) == "old"  # one read in the background at a time
        release.set()
        router._refresher.submit(lambda: None).result(timeout=30)  # the refresher's queue is done
        assert len(reads) == 2 and reads[1].startswith("swarm-refresh")
        assert set(router._peers[0]) == {"new"}
    finally:
        release.set()
        router.close()


def test_a_chained_call_keeps_to_its_budget_when_the_direct_path_fails(monkeypatch):
    """A chained request (a stage server handing a microbatch on, within its trainer's deadline) spends its budget on
    its direct try and its libp2p fallback together, and its caller waits for no more than the budget and a second:
    here the direct try's session took its time and failed, and the fallback got what was left. Before, the fallback
    got a whole timeout more, the hand-on answered after the trainer had stopped waiting for it, and the trainer
    banned a healthy peer (a refill test's swarm stalled for minutes). Any other call's fallback still gets a whole
    timeout."""
    import asyncio

    import pytest
    from helpers.stage import InProcessNode

    from lightning_swarm import protocol
    from lightning_swarm.client import routing
    from lightning_swarm.stage_api import StageService

    peer, given = "12D3KooWNLm8PhMDWXQQfX5bEooRKLHRNkaoGJ8Nv9xwfTdRZKQ2", []

    class NoSession:
        def __init__(self, *args) -> None:
            pass

        async def call(self, *args) -> list:
            await asyncio.sleep(0.5)
            raise routing.DirectUnreachable(f"peer {peer} opened no direct session: TimeoutError()")

    async def over_libp2p(stub, method, uid, tensors, metadata, timeout):
        given.append(timeout)
        await asyncio.sleep(timeout)
        raise TimeoutError()

    monkeypatch.setattr(routing, "DirectClient", NoSession)
    monkeypatch.setattr(protocol, "call", over_libp2p)
    monkeypatch.setattr(StageService, "get_stub", staticmethod(lambda *args, **kwargs: None))
    node = InProcessNode()
    node.p2p = None
    router = StageRouter(node=node, run_id="unit", num_stages=1, refresh_period=float("inf"))
    router._peers[0] = {peer: PeerLoad(PeerRecord(peer, 0, PeerState.SERVING, 1.0, 0, address="127.0.0.1:9"))}
    chained = {"onward": [], "parcel": "p", "origin": "trainer"}
    for metadata, waited in ((chained, 3.0), ({}, 2.0 + 1 + 2 * routing.CONNECT_TIMEOUT)):
        router._unreachable.clear()
        call = router.start_call(0, peer, "forward", [], metadata, 1, timeout=2.0)
        assert call.timeout == waited
        with pytest.raises(TimeoutError):
            router.finish(call)
    assert given[0] <= 1.5 and given[1] == 2.0, given
