"""Compression of the tensors that cross a stage boundary (SWARM section 7).

Activations going forward and their gradients coming back are quantized to 8 bits blockwise: bitsandbytes' signed
dynamic code, one fp32 scale (the block's absmax) per block of 4096 values, about a quarter of fp32 traffic.
``float16`` halves it; ``none`` sends tensors as they are (exact).

Encoding runs on the tensor's own device (the GPU when it lives there), so only the compressed bytes cross to the
host. Decoding runs on the CPU, or on ``device`` when asked (a GPU: the bytes go through a pinned buffer, copied
without blocking, and are decoded there). Messages are hivemind's ``runtime_pb2.Tensor``, so
hivemind's streaming splits and joins them; ``buffer`` holds data in host byte order (little-endian wherever
torch wheels run):

- ``NONE``: the raw elements; ``dtype`` is the torch dtype's name (``float32``, ``bfloat16``, ``int64``...).
- ``FLOAT16``: float16 elements (clamped to float16's range); ``dtype`` names the original floating dtype.
- ``BLOCKWISE_8BIT``: ``dtype`` is the original dtype's name + ``EIGHT_BIT_TAG`` (``float32:dynamic8-4096``); the
  buffer is ceil(n / 4096) fp32 absmax values, then n uint8 codes. The 256-entry code table is a constant known to
  both sides and is not sent (hivemind's own ``BLOCKWISE_8BIT`` sends it in every message; its messages, with a
  bare dtype, are refused).

``NONE`` and ``FLOAT16`` messages are the ones hivemind writes, so either side may be hivemind's serializer.
``deserialize`` checks every length against the declared shape before reading, and raises ``ValueError`` on any
mismatch. Decoded tensors are owned by the caller and never require grad.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from types import ModuleType
from typing import Any, Literal, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
from hivemind.proto import runtime_pb2

from lightning_swarm import device_sync

Codec = Literal["none", "float16", "8bit"]
CODECS: dict[str, int] = {
    "none": runtime_pb2.CompressionType.NONE,
    "float16": runtime_pb2.CompressionType.FLOAT16,
    "8bit": runtime_pb2.CompressionType.BLOCKWISE_8BIT,
}
BLOCK_SIZE = 4096
EIGHT_BIT_TAG = ":dynamic8-4096"  # marks our 8-bit layout (signed dynamic code, blocks of 4096, no code table)
FP16_MIN, FP16_MAX = torch.finfo(torch.float16).min, torch.finfo(torch.float16).max

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)  # what bitsandbytes quantizes natively
_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (*_FLOATS, *_INTEGERS, torch.complex64, torch.complex128)
}

# decoding reads the message's (immutable) bytes through a view: harmless, as every decoded tensor is a fresh copy
warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning, __name__)


def check_codec(codec: str) -> str:
    """``codec`` if it is one of ``CODECS``, else a ``ValueError`` naming the choices."""
    if codec not in CODECS:
        raise ValueError(f"Unknown compression {codec!r}: choose one of {sorted(CODECS)}")
    return codec


class WireTensor(NamedTuple):
    """An encoded tensor with ``runtime_pb2.Tensor``'s fields, without the copy into a protobuf message:
    ``buffer`` is ``bytes`` or a view (of received bytes, or of the host buffer an encoding copied its bytes into).
    Everything here reads either."""

    buffer: Any
    size: Sequence[int]
    dtype: str
    compression: int


def serialize(tensor: torch.Tensor, codec: str) -> runtime_pb2.Tensor:
    """Encode ``tensor`` for the wire as hivemind's message (see :func:`encode`)."""
    return to_message(encode(tensor, codec))


def to_message(tensor: Union[WireTensor, runtime_pb2.Tensor]) -> runtime_pb2.Tensor:
    """``tensor`` as hivemind's message (a copy of its buffer, unless it is one already)."""
    if isinstance(tensor, runtime_pb2.Tensor):
        return tensor
    buffer = tensor.buffer if isinstance(tensor.buffer, bytes) else bytes(tensor.buffer)
    return runtime_pb2.Tensor(buffer=buffer, size=tensor.size, dtype=tensor.dtype, compression=tensor.compression)


def encode(tensor: torch.Tensor, codec: str, scale: float = 1.0) -> WireTensor:
    """Encode ``tensor`` times ``scale`` for the wire, compressing on its own device. Integer and
    bf16-under-float16 tensors are sent as they are. Under 8 bits the scale goes into the blocks' absmax, with no pass
    over the values (nor a scaled copy of them)."""
    tensor = tensor.detach()
    return encode_split(tensor.reshape(1, *tensor.shape), codec, [1], scale, squeeze=True)[0]


def encode_split(
    tensor: torch.Tensor, codec: str, sizes: Sequence[int], scale: float = 1.0, squeeze: bool = False
) -> list[WireTensor]:
    """:func:`encode` of each of ``tensor.split(sizes)`` (along the first dimension), byte for byte the same, in one
    pass of the codec with one copy to the host and one wait for it: a trainer's microbatches leave without a pass,
    a copy and a wait each. Under 8 bits that needs each part but the last to be whole blocks of the code; otherwise
    the parts are encoded one by one. ``squeeze``: the parts' first dimension (of size 1) is not sent."""
    tensor = tensor.detach()
    name, compression = _dtype_name(tensor.dtype), CODECS[codec]
    if not tensor.is_floating_point() or (codec == "float16" and tensor.dtype == torch.bfloat16):
        compression = runtime_pb2.CompressionType.NONE
    eight_bit = compression == runtime_pb2.CompressionType.BLOCKWISE_8BIT
    parts = tensor.split(list(sizes))
    if eight_bit and any(part.numel() % BLOCK_SIZE for part in parts[:-1]):
        return [encode(part, codec, scale) for part in parts]
    if scale != 1.0 and not tensor.is_floating_point():
        raise ValueError(f"a {tensor.dtype} tensor cannot be sent scaled")
    if scale != 1.0 and not eight_bit:
        tensor = tensor * scale
    if compression == runtime_pb2.CompressionType.NONE:
        coded = [tensor]
    elif compression == runtime_pb2.CompressionType.FLOAT16:
        coded = [tensor.to(torch.float16, copy=True).clamp_(FP16_MIN, FP16_MAX)]
    else:
        codes, absmax = _quantize(tensor)
        coded, name = [absmax if scale == 1.0 else absmax * scale, codes], name + EIGHT_BIT_TAG
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in coded]
    itemsize = flat[-1].numel() // max(tensor.numel(), 1)  # bytes per element as sent (8 bits: the codes)
    pieces, lengths, offset = [], [], 0
    for part in parts:  # each message's pieces, in its layout: under 8 bits its blocks' absmax, then its codes
        end = offset + part.numel()
        mine = [flat[-1][offset * itemsize : end * itemsize]]
        if eight_bit:
            mine.insert(0, flat[0][4 * (offset // BLOCK_SIZE) : 4 * -(-end // BLOCK_SIZE)])
        pieces += mine
        lengths.append(sum(piece.numel() for piece in mine))
        offset = end
    host = memoryview(device_sync.to_host(pieces).numpy())  # the messages back to back: each sent from its slice
    wires, offset = [], 0
    for part, length in zip(parts, lengths):
        shape = list(part.shape[1:] if squeeze else part.shape)
        wires.append(WireTensor(host[offset : offset + length], shape, name, compression))
        offset += length
    return wires


def deserialize(
    message: Union[WireTensor, runtime_pb2.Tensor],
    device: Union[torch.device, str, None] = None,
    out: Optional[torch.Tensor] = None,
    divide: float = 1.0,
) -> torch.Tensor:
    """Decode a message written by ``serialize`` (on the CPU, or on ``device``), divided by ``divide``; ``ValueError``
    if it is malformed. With ``out`` (contiguous, of the message's shape and dtype), the values are written there,
    on its device, and ``out`` is returned: a caller assembling several messages into one tensor copies nothing
    more. Under 8 bits the division goes into the blocks' absmax, with no pass over the values."""
    device = out.device if out is not None else torch.device("cpu" if device is None else device)
    shape = tuple(message.size)  # unsigned on the wire
    dtype, length = _layout(message)
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"cannot decode a {dtype} tensor of shape {list(shape)} into {out.dtype} {list(out.shape)}")
    raw = _view(message.buffer, length)  # each read of .buffer copies it: read once
    if message.compression == runtime_pb2.CompressionType.BLOCKWISE_8BIT:
        raw, blocks = _to(raw, device), -(-math.prod(shape) // BLOCK_SIZE)
        absmax = raw[: 4 * blocks].view(torch.float32)
        absmax = absmax if divide == 1.0 else absmax / divide
        decoded = _dequantize(raw[4 * blocks :], absmax, dtype, out)
        return out if out is not None else decoded.reshape(shape)
    if message.compression == runtime_pb2.CompressionType.NONE:
        if dtype == torch.bool and bool((raw > 1).any()):
            raise ValueError("bool tensor with bytes other than 0 and 1")
        decoded = _to(raw, device).view(dtype).reshape(shape)
    else:
        decoded = _to(raw, device).view(torch.float16).reshape(shape)
    if out is not None:
        out.copy_(decoded)
        return out if divide == 1.0 else out.div_(divide)
    decoded = decoded.to(dtype)
    return decoded / divide if divide != 1.0 else _owned(decoded, raw)


def check_framing(message: Union[WireTensor, runtime_pb2.Tensor]) -> None:
    """``ValueError`` unless the message's header names a known dtype and codec and its buffer has the length they
    give for its shape: what can be checked without decoding (the values are not looked at)."""
    _view(message.buffer, _layout(message)[1])


def _layout(message: Union[WireTensor, runtime_pb2.Tensor]) -> tuple[torch.dtype, int]:
    """The dtype a message decodes to and the length of buffer its header gives (``ValueError`` if it names no
    known dtype or codec)."""
    numel = math.prod(message.size)
    if message.compression == runtime_pb2.CompressionType.NONE:
        dtype = _dtype(message.dtype)
        return dtype, numel * dtype.itemsize
    if message.compression == runtime_pb2.CompressionType.FLOAT16:
        return _dtype(message.dtype, floating=True), numel * 2
    if message.compression == runtime_pb2.CompressionType.BLOCKWISE_8BIT:
        if not message.dtype.endswith(EIGHT_BIT_TAG):
            raise ValueError(f"8-bit tensor with dtype {message.dtype!r}: expected '<dtype>{EIGHT_BIT_TAG}'")
        return _dtype(message.dtype.removesuffix(EIGHT_BIT_TAG), floating=True), 4 * -(-numel // BLOCK_SIZE) + numel
    raise ValueError(f"unsupported compression {message.compression}")


def raw_nbytes(message: runtime_pb2.Tensor) -> int:
    """The bytes of the tensor a message carries, uncompressed."""
    return math.prod(message.size) * decoded_dtype(message).itemsize


def decoded_dtype(message: runtime_pb2.Tensor) -> torch.dtype:
    """The dtype of the tensor a message carries, from its header (``ValueError`` if it names none)."""
    return _dtype(message.dtype.removesuffix(EIGHT_BIT_TAG))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, floating: bool = False) -> torch.dtype:
    dtype = DTYPES.get(name)
    if dtype is None or (floating and dtype not in _FLOATS):
        raise ValueError(f"unsupported dtype {name!r}")
    return dtype


def _view(buffer: bytes, expected: int) -> torch.Tensor:
    """A read-only uint8 view of ``buffer``, which must hold exactly ``expected`` bytes."""
    if len(buffer) != expected:
        raise ValueError(f"buffer holds {len(buffer)} bytes, the shape and dtype need {expected}")
    return torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8))


def _to(raw: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``raw`` (host bytes) on ``device``: to a GPU through a pinned buffer, without waiting for the copy (work
    queued after it on the device's stream runs once it landed)."""
    if device.type != "cuda":
        return raw.to(device)
    return raw.pin_memory().to(device, non_blocking=True)


def _owned(tensor: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied if it still shares the read-only ``view`` of a message's bytes."""
    return tensor.clone() if tensor.data_ptr() == view.data_ptr() else tensor


_IMPORT_LOCK = threading.Lock()


@functools.cache  # the hot path then skips the lock
def _bitsandbytes() -> ModuleType:
    """``bitsandbytes.functional``, once the whole package has loaded.

    Several threads code tensors at once. Without the lock, a thread's ``from bitsandbytes.functional import ...``
    could return while another thread is still importing the package, before it registered its CPU kernels, and
    the call failed ("Could not run 'bitsandbytes::quantize_blockwise' with arguments from the 'CPU' backend").
    """
    with _IMPORT_LOCK:
        import bitsandbytes.functional

    return bitsandbytes.functional


@functools.cache
def _code_table(device: torch.device) -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit code (256 sorted values in [-1, 1]), kept on ``device``."""
    return _bitsandbytes().create_dynamic_map(signed=True).to(device)


def _quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes and fp32 absmax per block, computed on the tensor's device (on a GPU, on the current stream)."""
    if tensor.numel() == 0:  # bitsandbytes' CUDA kernel cannot be launched on zero blocks
        return tensor.new_empty(tensor.shape, dtype=torch.uint8), tensor.new_empty(0, dtype=torch.float32)
    if tensor.dtype not in _QUANTIZABLE:
        tensor = tensor.float()
    if tensor.is_cuda:
        return quantize_on_stream(tensor)
    codes, state = _bitsandbytes().quantize_blockwise(tensor, code=_code_table(tensor.device), blocksize=BLOCK_SIZE)
    return codes, state.absmax.float()


def quantize_on_stream(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' blockwise quantization (the nearest code to each value over its block's absmax; same layout), in
    torch operations. bitsandbytes launches its CUDA kernel on the default stream whatever the current stream is, so a
    stage server's reply, encoded on a side stream, waited there behind every request the worker had launched on the
    default stream since; these run on the current stream. On the CPU bitsandbytes' kernel is 7x faster (2M values,
    one thread: 16.6 against 112 ms, measured 2026-11-27), so it is used there; decoding is bitsandbytes' everywhere
    (its CUDA kernel takes the current stream)."""
    flat = tensor.reshape(-1)
    blocks = -(-flat.numel() // BLOCK_SIZE)
    padded = torch.nn.functional.pad(flat.float(), (0, blocks * BLOCK_SIZE - flat.numel())).view(blocks, BLOCK_SIZE)
    absmax = torch.linalg.vector_norm(padded, float("inf"), dim=1)  # NaN if the block has one: it decodes to NaN
    padded.div_(absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
    codes = torch.bucketize(padded, _midpoints(tensor.device), out_int32=True).to(torch.uint8)
    return codes.view(-1)[: flat.numel()].view(tensor.shape), absmax


@functools.cache
def _midpoints(device: torch.device) -> torch.Tensor:
    """The midpoints between consecutive values of the code: a value's bucket among them is its nearest code."""
    code = _code_table(device)
    return (code[1:] + code[:-1]) / 2


def _dequantize(
    codes: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    if codes.numel() == 0:
        return torch.empty(codes.shape, dtype=dtype, device=codes.device) if out is None else out
    decoded_dtype = dtype if dtype in _QUANTIZABLE else torch.float32
    bnb = _bitsandbytes()
    state = bnb.QuantState(absmax=absmax, code=_code_table(codes.device), blocksize=BLOCK_SIZE, dtype=decoded_dtype)
    if out is not None and dtype == decoded_dtype and codes.is_cuda:  # bitsandbytes' CPU kernel has no out variant
        return bnb.dequantize_blockwise(codes, state, out=out.view(codes.shape))
    decoded = bnb.dequantize_blockwise(codes, state).to(dtype)
    return decoded if out is None else out.copy_(decoded.view(out.shape))
