"""The swarm node's DHT records, on a real hivemind DHT in this process."""

from __future__ import annotations

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
