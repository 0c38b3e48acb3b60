"""The wire protocol: errors keep their class across the wire."""

from __future__ import annotations

from lightning_swarm import protocol
from lightning_swarm.errors import StageBusyError, SwarmRequestError


def test_a_server_error_survives_the_wire_by_its_class_name():
    sent = protocol.error_for_wire(StageBusyError("stage 1 is busy"))
    received = protocol.error_from_wire(f"handler failed: {sent}")
    assert type(received) is StageBusyError and "stage 1 is busy" in str(received)
    nested = protocol.error_from_wire("SwarmRequestError('stage 0 failed: StageBusyError()')")
    assert type(nested) is SwarmRequestError  # the class named first is the one raised
    assert protocol.error_from_wire("ValueError('no swarm error')") is None
