"""A peer behind NAT says so in its record, and ``lightning-swarm status`` shows it."""

from __future__ import annotations

import re

from lightning_swarm.cli import status as cli
from lightning_swarm.discovery import PeerRecord, PeerState


def test_unreachable_record_round_trip_and_older_formats():
    nated = PeerRecord("p", 1, PeerState.SERVING, 2.5, 3, True, reachable=False)
    assert nated.to_value() == (1, 2.5, 3, 1, "", 1, 0)
    assert PeerRecord.from_value("p", 1, nated.to_value()) == nated
    reachable = PeerRecord("p", 1, PeerState.SERVING, 2.5, 3, True, "h:1")
    assert reachable.to_value() == (1, 2.5, 3, 1, "h:1")  # the format of peers that predate the flag
    assert PeerRecord.from_value("p", 1, reachable.to_value()).reachable
    assert PeerRecord.from_value("p", 1, (*nated.to_value(), 0)) is None
    assert PeerRecord.from_value("p", 1, (1, 2.5, 3, 1, "", 1, "no")) is None


def test_status_marks_peers_behind_nat():
    records = {
        "r_stage0": {"a": PeerRecord("a", 0, PeerState.SERVING, 1.0, 0, False, "h:1").to_value()},
        "r_stage1": {"b": PeerRecord("b", 1, PeerState.SERVING, 1.0, 0, False, reachable=False).to_value()},
    }

    class Node:
        def dht_get(self, key: str, timeout=None):
            return records.get(key)

    text = cli.format_status(cli.read_status(Node(), "r", num_stages=2))
    assert re.search(r"^a +0 +serving +1\.0 +0 +no$", text, re.MULTILINE)
    assert re.search(r"^b +1 +serving +1\.0 +0 +no +behind NAT", text, re.MULTILINE)
