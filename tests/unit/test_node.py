"""The swarm node's DHT records, on a real hivemind DHT in this process."""

from __future__ import annotations

import pytest

from lightning_swarm.errors import JoinError
from lightning_swarm.node import SwarmNode


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
