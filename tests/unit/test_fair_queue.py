"""The fair queue serves callers in turn and makes room for newcomers."""

from __future__ import annotations

import queue

import pytest

from lightning_swarm.server.fair_queue import FairQueue


def test_the_queue_serves_callers_in_turn_and_makes_room_for_newcomers():
    """In one process: a caller that keeps the queue full does not delay another's requests beyond the one being
    computed, and gives up queued places to it, down to an equal share."""
    fair = FairQueue(8)
    for i in range(8):
        assert fair.put("flooder", ("flooder", i), 4) is None
    with pytest.raises(queue.Full):
        fair.put("flooder", ("flooder", 8), 4)
    assert fair.put("trainer", ("trainer", 0), 4) == ("flooder", 7)  # its newest request makes room
    order = []
    for _ in range(8):  # the trainer sends its next request once the last one was served
        caller, i = fair.get(timeout=1)
        order.append(caller)
        if caller == "trainer":
            fair.put("trainer", ("trainer", i + 1), 4)
    assert order == ["flooder", "trainer"] * 4
    for _ in range(8):  # both keep asking: the places end up shared equally
        for caller in ("flooder", "trainer"):
            try:
                fair.put(caller, (caller, -1), 4)
            except queue.Full:
                pass
    assert fair.queued("trainer") == fair.queued("flooder") == 4 and fair.qsize() == 8
