"""The wire format shared by stage servers and routers: hivemind's ExpertRequest/ExpertResponse messages whose
``tensors`` hold the (compressed) tensors and whose ``metadata`` holds a small msgpack dict.

Requests and replies above hivemind's unary payload limit travel as streams of chunks. A stage is named on the wire
by :func:`stage_uid`; a server's errors cross it by class name (:func:`error_for_wire`, :func:`error_from_wire`),
on libp2p and on the direct path alike.
"""

from __future__ import annotations

from typing import AsyncIterator, Callable, Iterable, Sequence

from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE, MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import aiter_with_timeout, iter_as_aiter
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from lightning_swarm.errors import (
    ActivationsLostError,
    ChainBrokenError,
    NonFiniteInputError,
    NotServingError,
    PeerNotAllowedError,
    StageBusyError,
    StageFailedError,
    SwarmRequestError,
)

# what a stage server sends back by name (libp2p and the direct path alike), and callers raise again by that name
WIRE_ERRORS = (
    NonFiniteInputError,
    SwarmRequestError,
    PeerNotAllowedError,
    StageBusyError,
    StageFailedError,
    ActivationsLostError,
    NotServingError,
    ChainBrokenError,
)

CHUNK_BYTES = DEFAULT_MAX_MSG_SIZE // 2
END_OF_STREAM = "end_of_stream"  # the last message of a streamed reply: how many tensors it carried


def stage_uid(run_id: str, stage: int) -> str:
    return f"{run_id}.stage{stage}"


def error_for_wire(error: Exception) -> Exception:
    """The error a server raises so that its class name reaches the caller (hivemind sends ``str(e)`` only)."""
    return type(error)(repr(error))


def error_from_wire(text: str) -> Exception | None:
    """The swarm error a server raised, from the text that crossed the wire (the class named first in it), or
    None for another error."""
    named = [(text.find(kind.__name__), i) for i, kind in enumerate(WIRE_ERRORS) if kind.__name__ in text]
    return WIRE_ERRORS[min(named)[1]](text) if named else None


def payload_bytes(tensors: Sequence[runtime_pb2.Tensor]) -> int:
    return sum(len(t.buffer) for t in tensors)


def needs_stream(tensors: Sequence[runtime_pb2.Tensor]) -> bool:
    return payload_bytes(tensors) > MAX_UNARY_PAYLOAD_SIZE


def chunks(tensors: Iterable[runtime_pb2.Tensor]) -> Iterable[runtime_pb2.Tensor]:
    return (part for tensor in tensors for part in split_for_streaming(tensor, CHUNK_BYTES))


def combine(parts: Iterable[runtime_pb2.Tensor]) -> list[runtime_pb2.Tensor]:
    """Reassemble streamed chunks: a chunk that carries a dtype starts a new tensor, which says how many chunks it
    has (``ConnectionError`` if fewer arrived)."""
    groups: list[list[runtime_pb2.Tensor]] = []
    for part in parts:
        if part.dtype or not groups:
            groups.append([])
        groups[-1].append(part)
    for group in groups:
        if group[0].chunks and len(group) != group[0].chunks:
            raise ConnectionError(f"a streamed tensor arrived with {len(group)} of its {group[0].chunks} chunks")
    return [combine_from_streaming(group) for group in groups]


def encode_metadata(metadata: dict) -> bytes:
    return MSGPackSerializer.dumps(metadata)


def decode_metadata(raw: bytes) -> dict:
    try:
        metadata = MSGPackSerializer.loads(raw) if raw else {}
    except Exception as e:
        raise SwarmRequestError(f"request metadata is not valid msgpack: {e!r}") from None
    if not isinstance(metadata, dict):
        raise SwarmRequestError("request metadata must be a msgpack dict")
    return metadata


async def call(
    stub, method: str, uid: str, tensors: list[runtime_pb2.Tensor], metadata: dict, timeout: float
) -> tuple[list[runtime_pb2.Tensor], dict]:
    """Call ``rpc_<method>`` (or its ``_stream`` form for large payloads) on a peer; returns tensors and metadata."""
    raw_metadata = encode_metadata(metadata)
    if not needs_stream(tensors):
        request = runtime_pb2.ExpertRequest(uid=uid, tensors=tensors, metadata=raw_metadata)
        response = await getattr(stub, f"rpc_{method}")(request, timeout=timeout)
        return list(response.tensors), decode_metadata(response.metadata)
    requests = [runtime_pb2.ExpertRequest(uid=uid, tensors=[part], metadata=raw_metadata) for part in chunks(tensors)]
    stream = await getattr(stub, f"rpc_{method}_stream")(iter_as_aiter(requests))
    return await receive_stream(stream, timeout, f"rpc_{method}_stream")


async def gather_request(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], max_bytes: int, check: Callable[[bytes], None]
) -> runtime_pb2.ExpertRequest:
    """Server side: collect a streamed request into one message, refusing more than ``max_bytes`` of tensors.
    ``check`` vets the caller on the first message's metadata (its token) before any more is read: a caller it
    refuses costs one message. The request's metadata is the first message's."""
    uid, metadata, parts, size = None, b"", [], 0
    async for request in requests:
        if uid is None:
            check(request.metadata)
            metadata = request.metadata
        elif request.uid != uid:
            raise SwarmRequestError("one streamed request named several stages")
        uid = request.uid
        size += payload_bytes(request.tensors)
        if size > max_bytes:
            async for request in requests:  # closing the stream while the caller still writes loses the error
                size += payload_bytes(request.tensors)
                if size > 2 * max_bytes:
                    break
            raise SwarmRequestError(f"request exceeds the size cap of {max_bytes} bytes")
        parts.extend(request.tensors)
    if uid is None:  # an empty stream: the caller is vetted all the same
        check(metadata)
    return runtime_pb2.ExpertRequest(uid=uid or "", tensors=combine(parts), metadata=metadata)


def stream_response(response: runtime_pb2.ExpertResponse) -> Iterable[runtime_pb2.ExpertResponse]:
    """Server side: split a reply into stream messages, the reply's metadata on the first; a last message says how
    many tensors were sent (:func:`receive_stream` checks it)."""
    parts = list(chunks(response.tensors)) or [None]
    for i, part in enumerate(parts):
        yield runtime_pb2.ExpertResponse(
            tensors=[part] if part is not None else [], metadata=response.metadata if i == 0 else b""
        )
    yield runtime_pb2.ExpertResponse(metadata=encode_metadata({END_OF_STREAM: len(response.tensors)}))


async def receive_stream(
    stream: AsyncIterator[runtime_pb2.ExpertResponse], timeout: float, name: str
) -> tuple[list[runtime_pb2.Tensor], dict]:
    """Client side: read a reply streamed by :func:`stream_response`; returns its tensors and metadata. hivemind ends
    a stream whose connection closed as if it were complete: a reply without its last message, or with a tensor
    short of chunks, raises ``ConnectionError``."""
    messages = [message async for message in aiter_with_timeout(stream, timeout)]
    if not messages:
        raise ConnectionError(f"{name} ended without a reply")
    last = messages[-1]
    sent = decode_metadata(last.metadata).get(END_OF_STREAM) if len(messages) > 1 and not last.tensors else None
    tensors = combine(part for message in messages for part in message.tensors)
    if sent is None:
        raise ConnectionError(f"{name} was cut off after {len(tensors)} tensors: its last message never came")
    if sent != len(tensors):
        raise ConnectionError(f"{name} carried {len(tensors)} tensors, its last message says {sent}")
    return tensors, decode_metadata(messages[0].metadata)
