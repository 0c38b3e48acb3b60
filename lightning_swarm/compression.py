"""Compression of the tensors that cross a stage boundary (SWARM section 7).

Activations going forward and their gradients coming back are quantized to 8 bits blockwise (bitsandbytes'
dynamic code, one fp32 scale per block of 4096 values, through hivemind's ``BLOCKWISE_8BIT`` codec): about a
quarter of fp32 traffic. ``float16`` halves it; ``none`` sends tensors as they are (exact).
"""

from __future__ import annotations

from typing import Literal

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

Codec = Literal["none", "float16", "8bit"]
CODECS: dict[str, int] = {
    "none": runtime_pb2.CompressionType.NONE,
    "float16": runtime_pb2.CompressionType.FLOAT16,
    "8bit": runtime_pb2.CompressionType.BLOCKWISE_8BIT,
}
BLOCK_SIZE = 4096  # hivemind's BLOCKWISE_8BIT block


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ValueError(f"Unknown compression {codec!r}: choose one of {sorted(CODECS)}")
    return codec


def serialize(tensor: torch.Tensor, codec: str) -> runtime_pb2.Tensor:
    """Encode ``tensor`` for the wire. Integer and bf16-under-float16 tensors are sent as they are."""
    compression = CODECS[codec]
    if not tensor.is_floating_point() or (codec == "float16" and tensor.dtype == torch.bfloat16):
        compression = runtime_pb2.CompressionType.NONE
    return serialize_torch_tensor(tensor.detach().cpu(), compression)


def deserialize(message: runtime_pb2.Tensor) -> torch.Tensor:
    return deserialize_torch_tensor(message)


def error_bound(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """The largest elementwise error ``deserialize(serialize(tensor, codec))`` may have, per element."""
    if codec == "none" or not tensor.is_floating_point():
        return torch.zeros_like(tensor, dtype=torch.float32)
    flat = tensor.detach().float().flatten()
    if codec == "float16":  # round to nearest: half an ulp of float16 (10 mantissa bits), min normal spacing
        return (flat.abs() * 2.0**-11 + 2.0**-25).view(tensor.shape)
    from bitsandbytes.functional import create_dynamic_map

    # a value is coded by one of the two codes that bracket it (scaled by its block's absmax)
    max_gap = float(create_dynamic_map(signed=True).sort().values.diff().max())
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % BLOCK_SIZE))
    absmax = padded.view(-1, BLOCK_SIZE).abs().amax(dim=1, keepdim=True)
    bound = (absmax * max_gap * (1 + 1e-6)).expand(-1, BLOCK_SIZE).flatten()[: flat.numel()]
    return bound.view(tensor.shape)
