"""The wire protocol: errors keep their class across the wire; a streamed reply arrives whole or raises."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator
from unittest.mock import patch

import pytest
import torch
from hivemind.proto import runtime_pb2

from lightning_swarm import compression, protocol
from lightning_swarm.errors import StageBusyError, SwarmRequestError


def test_a_server_error_survives_the_wire_by_its_class_name():
    sent = protocol.error_for_wire(StageBusyError("stage 1 is busy"))
    received = protocol.error_from_wire(f"handler failed: {sent}")
    assert type(received) is StageBusyError and "stage 1 is busy" in str(received)
    nested = protocol.error_from_wire("SwarmRequestError('stage 0 failed: StageBusyError()')")
    assert type(nested) is SwarmRequestError  # the class named first is the one raised
    assert protocol.error_from_wire("ValueError('no swarm error')") is None


def streamed(messages: list) -> AsyncIterator:
    async def stream():
        for message in messages:
            yield message

    return stream()


def test_a_streamed_reply_cut_off_by_a_closed_connection_raises_instead_of_arriving_short():
    """hivemind ends a stream whose connection closed as if it were complete: the reader must notice a missing end
    (a checkpoint once lost a stage's last two tensors this way), and a tensor short of chunks."""
    state = {"a": torch.randn(64, 64), "b": torch.randn(3), "c": torch.randn(5, 5)}
    response = runtime_pb2.ExpertResponse(
        tensors=[compression.serialize(t, "none") for t in state.values()],
        metadata=protocol.encode_metadata({"keys": list(state)}),
    )
    with patch.object(protocol, "CHUNK_BYTES", 4096):
        messages = list(protocol.stream_response(response))
    assert len(messages) == 4 + 1 + 1 + 1  # a in 4 chunks, b, c, the end

    tensors, metadata = asyncio.run(protocol.receive_stream(streamed(messages), 5, "rpc_state"))
    assert metadata["keys"] == list(state)
    for tensor, expected in zip(tensors, state.values(), strict=True):
        assert torch.equal(compression.deserialize(tensor), expected)

    with pytest.raises(ConnectionError, match="cut off after 3 tensors"):
        asyncio.run(protocol.receive_stream(streamed(messages[:-1]), 5, "rpc_state"))  # closed before the end
    with pytest.raises(ConnectionError, match="cut off after 2 tensors"):
        asyncio.run(protocol.receive_stream(streamed(messages[:-2]), 5, "rpc_state"))  # at a tensor's boundary
    with pytest.raises(ConnectionError, match="with 3 of its 4 chunks"):
        asyncio.run(protocol.receive_stream(streamed(messages[:2] + messages[3:]), 5, "rpc_state"))
    with pytest.raises(ConnectionError, match="ended without a reply"):
        asyncio.run(protocol.receive_stream(streamed([]), 5, "rpc_state"))

    empty = list(protocol.stream_response(runtime_pb2.ExpertResponse(metadata=protocol.encode_metadata({"k": 1}))))
    assert asyncio.run(protocol.receive_stream(streamed(empty), 5, "rpc_info")) == ([], {"k": 1})
