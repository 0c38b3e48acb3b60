"""The swarm node's DHT records, on a real hivemind DHT in this process."""

from __future__ import annotations

import multiprocessing
import os
import time
from functools import partial

import pytest

from lightning_swarm.errors import JoinError
from lightning_swarm.node import SwarmNode, _OrphansDropped


def test_a_later_record_replaces_an_earlier_one_that_would_outlive_it():
    """The DHT keeps the value that expires last, so a peer's "leaving" record (short-lived) stored after its
    "joining" one (long-lived, during a move) was dropped, and others saw it vanish instead of leave."""
    node = SwarmNode().start()
    try:
        assert node.dht_store("records_test", "me", "joining", ttl=60.0)
        assert node.dht_store("records_test", "me", "leaving", ttl=5.0)
        assert node.dht_get("records_test") == {"me": "leaving"}
    finally:
        node.shutdown()


def test_joining_through_a_peer_that_died_ends_with_one_clear_line():
    """The peer that started the swarm exits before a joiner starts: the joiner's error names what failed, the
    address it tried and what to check, without the daemon's raw error chained to it."""
    first = SwarmNode().start()
    addresses = first.visible_maddrs()
    first.shutdown()
    with pytest.raises(JoinError) as failure:
        SwarmNode(addresses).start(attempts=1)
    message = str(failure.value)
    assert message.startswith("Could not join the swarm through " + ", ".join(addresses)) and "\n" not in message
    assert "Check that a peer still runs at that address" in message
    assert failure.value.__suppress_context__


async def _block_until(path: str, dht, node) -> None:  # runs in the DHT process: blocks its loop, requests queue
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


async def _orphans_dropped(dht, node) -> int:  # runs in the DHT process
    return dht.orphans_dropped


def _send_requests_and_exit(dht) -> None:
    for _ in range(4):
        dht.get("orphaned", latest=True, return_future=True)
    os._exit(0)  # before the DHT process read them


def test_requests_of_a_process_that_exited_do_not_stall_the_dht(tmp_path):
    """A process that shares the node's DHT (an averager) exits with requests still queued, as on a rebalancing
    move: the DHT process cannot fetch their reply pipes and drops them at once, each of the four. Before, hivemind
    slept 3 s on each (12 s here) while the requests behind them waited: a peer's DHT calls timed out for minutes
    after a move. The DHT process reads the requests only once their sender has exited (its loop is held until
    then), and the node's own requests behind them are answered."""
    node = SwarmNode().start()
    released = tmp_path / "sender exited"
    try:
        node.dht.get("warm-up", latest=True)  # this process's resource sharer is running, as in a peer
        assert node.dht.run_coroutine(_orphans_dropped) == 0
        node.dht.run_coroutine(partial(_block_until, str(released)), return_future=True)
        child = multiprocessing.get_context("fork").Process(target=_send_requests_and_exit, args=(node.dht,))
        child.start()
        child.join(timeout=30)
        assert child.exitcode == 0
        released.touch()
        node.dht_store("after_orphans", "me", "value", ttl=30.0)
        assert node.dht_get("after_orphans") == {"me": "value"}
        assert node.dht.run_coroutine(_orphans_dropped) == 4
    finally:
        node.shutdown()


@pytest.mark.parametrize("error", [FileNotFoundError, ConnectionRefusedError, ConnectionResetError, EOFError])
def test_a_request_whose_pipe_cannot_be_fetched_is_dropped(error):
    """However fetching an orphaned request's reply pipe fails (the sender's resource sharer gone, refusing, or gone
    mid-handover: a reset seen in a Python 3.14 run, an end of file in a CI run), the DHT process drops the request
    instead of raising into hivemind, which logged it and slept 3 s (an EOFError it does not catch ended the DHT
    process)."""

    class Pipe:
        def recv(self):
            raise error(104, "from the sender's resource sharer")

    assert _OrphansDropped(Pipe()).recv() == ("_drop_orphan", [], {})
