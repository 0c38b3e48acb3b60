"""The codecs: round trips within their bounds, wire compatibility with hivemind, malformed messages refused."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from helpers.oracles import error_bound
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from lightning_swarm import compression, protocol


@pytest.mark.parametrize("codec", ["none", "float16", "8bit"])
@pytest.mark.parametrize("shape", [(3, 7), (2, 64, 96), (5000,)])
def test_codec_round_trips_within_its_bound(codec, shape):
    tensor = torch.randn(*shape) * torch.logspace(-2, 2, shape[-1])
    message = compression.serialize(tensor, codec)
    assert compression.raw_nbytes(message) == tensor.numel() * 4  # what the message carries, uncompressed
    wire = message.SerializeToString()  # the bytes that cross the network
    decoded = compression.deserialize(runtime_pb2.Tensor.FromString(wire))
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    error = (decoded - tensor).abs()
    assert (error <= error_bound(tensor, codec)).all()
    ratio = len(wire) / (tensor.numel() * 4)
    if codec == "none":
        assert torch.equal(decoded, tensor)
    elif codec == "8bit":
        # one byte per value, an fp32 scale per block of 4096 and a small header: no code table
        blocks = -(-tensor.numel() // compression.BLOCK_SIZE)
        assert len(wire) <= tensor.numel() + 4 * blocks + 64
        assert error.mean() < 0.02 * tensor.abs().mean()
    else:
        assert ratio <= 0.5 + 128 / (tensor.numel() * 4)


def test_error_bound_is_tight_enough_to_catch_a_broken_codec():
    tensor = torch.randn(4096)
    wrong = tensor + error_bound(tensor, "8bit") * 3
    assert not ((wrong - tensor).abs() <= error_bound(tensor, "8bit")).all()


def _round_trip(tensor: torch.Tensor, codec: str) -> tuple[torch.Tensor, bytes]:
    wire = compression.serialize(tensor, codec).SerializeToString()
    return compression.deserialize(runtime_pb2.Tensor.FromString(wire)), wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(), (1,), (0, 5), (4095,), (4097,), (3, 4096), (2, 3, 5001), (16, 64, 1024)])
def test_8bit_round_trips_within_its_bound_for_any_size_and_float_dtype(shape, dtype):
    tensor = (torch.randn(shape) * 3).to(dtype)
    decoded, wire = _round_trip(tensor, "8bit")
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    error = (decoded.double() - tensor.double()).abs()
    assert (error <= error_bound(tensor, "8bit")).all()
    blocks = -(-tensor.numel() // compression.BLOCK_SIZE)
    assert len(wire) <= tensor.numel() + 4 * blocks + 64


def test_8bit_sends_at_most_027_of_fp32_for_an_activation():
    activation = torch.randn(16, 64, 1024)
    message = compression.serialize(activation, "8bit")
    assert message.dtype == "float32" + compression.EIGHT_BIT_TAG
    assert len(message.buffer) == activation.numel() + 4 * (activation.numel() // compression.BLOCK_SIZE)
    assert len(message.SerializeToString()) <= 0.27 * activation.numel() * 4


def test_8bit_messages_survive_streaming_in_chunks():
    tensor = torch.randn(3, 5000)
    message = compression.serialize(tensor, "8bit")
    parts = list(split_for_streaming(message, 1000))
    assert len(parts) > 1
    (joined,) = protocol.combine(runtime_pb2.Tensor.FromString(p.SerializeToString()) for p in parts)
    assert torch.equal(compression.deserialize(joined), compression.deserialize(message))


_CODE_DURING_IMPORT = """
import sys, threading, torch
from lightning_swarm import compression
assert "bitsandbytes" not in sys.modules
outcome = []

def code():
    try:
        compression.deserialize(compression.serialize(torch.randn(4096), "8bit"))
        outcome.append("ok")
    except Exception as e:
        outcome.append(repr(e)[:300])

class CodeWhileImporting:  # a second thread codes just before bitsandbytes registers its CPU kernels
    def find_spec(self, name, path, target=None):
        if name == "bitsandbytes.backends.cpu.ops":
            other = threading.Thread(target=code)
            other.start()
            other.join(timeout=2)  # a thread that waits for the whole import would wait forever here
            threads.append(other)

threads = []
sys.meta_path.insert(0, CodeWhileImporting())
code()
threads[0].join(timeout=60)
print(outcome)
"""


def test_8bit_coding_in_a_thread_waits_for_another_threads_import_of_bitsandbytes():
    """The first 8-bit coding imports bitsandbytes; another thread coding meanwhile must wait for the whole package
    (a CI peer died on "Could not run 'bitsandbytes::quantize_blockwise' with arguments from the 'CPU' backend")."""
    result = subprocess.run(
        [sys.executable, "-c", _CODE_DURING_IMPORT], capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['ok', 'ok']", result.stdout[-3000:]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(5, 7),
        torch.randn(4, 6)[:, ::2],  # not contiguous
        torch.tensor(3.5),
        torch.empty(10**9, 0, 3),
        torch.randn(9, dtype=torch.bfloat16),
        torch.randn(9, dtype=torch.float64),
        torch.arange(-5, 5),
        torch.tensor([True, False, True]),
        torch.randint(0, 255, (7,), dtype=torch.uint8),
    ],
)
def test_none_is_exact_and_decoded_tensors_are_owned(tensor):
    message = runtime_pb2.Tensor.FromString(compression.serialize(tensor, "none").SerializeToString())
    decoded = compression.deserialize(message)
    assert decoded.dtype == tensor.dtype and torch.equal(decoded, tensor)
    decoded.zero_()  # writing to a decoded tensor must not reach the message's bytes
    assert torch.equal(compression.deserialize(message), tensor)


def test_float16_is_exact_on_float16_values_and_leaves_the_input_alone():
    tensor = torch.randn(3, 50).half().float()
    assert torch.equal(_round_trip(tensor, "float16")[0], tensor)
    half = torch.tensor([1.0, float("inf"), -7e4], dtype=torch.float16)
    message = compression.serialize(half, "float16")
    assert half[1] == float("inf"), "the input was clamped in place"
    compression.deserialize(message).fill_(0)  # a float16 tensor decodes to a copy, not to the message's bytes
    assert compression.deserialize(message).tolist() == [1.0, 65504.0, -65504.0]
    bf16 = torch.randn(8, dtype=torch.bfloat16)  # bf16 is sent as it is under float16
    assert torch.equal(_round_trip(bf16, "float16")[0], bf16)


@pytest.mark.parametrize("codec", ["none", "float16", "8bit"])
def test_a_scaled_message_decodes_divided_into_its_slice_of_a_larger_tensor(codec):
    """How the trainer sends a microbatch's gradient times the microbatch count and assembles the input gradients
    that come back: the message carries the tensor times the scale; decoded into a slice of the batch's tensor and
    divided, it writes that slice only, with the values of decoding then dividing (to rounding under 8 bits, where
    the scale and the division go into the blocks' absmax: the codes are those of the unscaled tensor)."""
    tensor = torch.randn(3, 5000)
    scaled = compression.encode(tensor, codec, scale=3.0)
    alone = compression.deserialize(scaled)
    assert ((alone - 3 * tensor).abs() <= error_bound(3 * tensor, codec)).all()
    whole = torch.full((9, 5000), math.nan)
    assert compression.deserialize(scaled, out=whole[3:6], divide=3.0).data_ptr() == whole[3:6].data_ptr()
    assert whole[:3].isnan().all() and whole[6:].isnan().all()
    exact = 0 if codec != "8bit" else 1e-6
    torch.testing.assert_close(whole[3:6], alone / 3, rtol=exact, atol=exact)
    torch.testing.assert_close(compression.deserialize(scaled, divide=3.0), alone / 3, rtol=exact, atol=exact)
    if codec == "8bit":
        blocks = -(-tensor.numel() // compression.BLOCK_SIZE)
        assert scaled.buffer[4 * blocks :] == compression.encode(tensor, codec).buffer[4 * blocks :]


@pytest.mark.parametrize("codec", ["none", "float16", "8bit"])
@pytest.mark.parametrize(
    "shape, dtype, sizes, scale, passes",
    [
        ((8, 2, 4096), torch.float32, [2, 2, 2, 2], 4.0, 1),  # microbatches of whole 8-bit blocks: one pass
        ((8, 2, 4096), torch.bfloat16, [3, 3, 2], 1.0, 1),
        ((6, 2, 4096), torch.float32, [6], 1.0, 1),
        ((8, 7, 96), torch.float32, [2, 2, 2, 2], 2.0, 4),  # parts of blocks under 8 bits: one by one
        ((4, 3), torch.int64, [1, 3], 1.0, 0),
    ],
)
def test_a_batch_encoded_at_once_is_each_microbatch_encoded_alone(
    codec, shape, dtype, sizes, scale, passes, monkeypatch
):
    """The trainer encodes its microbatches' activations (and output gradients, scaled) in one pass: each message is
    byte for byte the one its microbatch alone would make, and under 8 bits the codec runs once when every part but
    the last is whole blocks."""
    tensor = (torch.randn(shape) * 10).to(dtype)
    quantize, calls = compression._quantize, []
    monkeypatch.setattr(compression, "_quantize", lambda t: calls.append(t.numel()) or quantize(t))
    together = compression.encode_split(tensor, codec, sizes, scale)
    expected_passes = passes if codec == "8bit" else 0
    assert len(calls) == expected_passes
    alone = [compression.encode(part, codec, scale) for part in tensor.split(sizes)]
    assert [(m.buffer, list(m.size), m.dtype, m.compression) for m in together] == [
        (bytes(m.buffer), list(m.size), m.dtype, m.compression) for m in alone
    ]


def test_decoding_into_a_tensor_of_another_shape_dtype_or_layout_is_refused():
    message = compression.encode(torch.randn(4, 5), "8bit")
    for out in (torch.empty(5, 4), torch.empty(4, 5, dtype=torch.float64), torch.empty(5, 4).t()):
        with pytest.raises(ValueError, match="cannot decode"):
            compression.deserialize(message, out=out)
    with pytest.raises(ValueError, match="scaled"):
        compression.encode(torch.arange(3), "none", scale=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (4095,), (4097,), (3, 4096), (2, 3, 5001)])
def test_quantization_on_the_current_stream_has_bitsandbytes_layout_and_bound(shape, dtype):
    """The quantization a GPU runs on the current stream (torch operations: bitsandbytes' CUDA kernel takes the
    default stream), checked on the CPU against bitsandbytes' own: the same absmax, codes that decode within the
    codec's bound, and the same nearest code nearly everywhere (a value halfway between two codes may go either way).
    The values are seeded: under bf16 many repeat, and in about 1% of random tensors one on a midpoint made up more
    than 1% of the tensor."""
    tensor = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    codes, absmax = compression.quantize_on_stream(tensor)
    theirs, their_absmax = compression._quantize(tensor)  # on the CPU: bitsandbytes
    assert codes.shape == tensor.shape and codes.dtype == torch.uint8
    assert torch.equal(absmax, their_absmax)
    decoded = compression._dequantize(codes.reshape(-1), absmax, dtype).reshape(shape)
    assert ((decoded.double() - tensor.double()).abs() <= error_bound(tensor, "8bit")).all()
    assert (codes == theirs).float().mean() > 0.99


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_quantized_on_the_current_stream_decodes_non_finite(bad):
    """So that the stage that receives it refuses it (NonFiniteInputError) and blames the sender."""
    tensor = torch.randn(2, 5000)
    tensor[1, 7] = bad
    codes, absmax = compression.quantize_on_stream(tensor)
    assert not compression._dequantize(codes.reshape(-1), absmax, torch.float32).isfinite().all()


def test_none_and_float16_messages_are_hivemind_compatible():
    tensor = torch.randn(4, 9)
    for codec, kind in (("none", runtime_pb2.NONE), ("float16", runtime_pb2.FLOAT16)):
        ours = compression.serialize(tensor, codec)
        assert torch.equal(deserialize_torch_tensor(ours), compression.deserialize(ours))
        theirs = serialize_torch_tensor(tensor, kind)
        assert torch.equal(compression.deserialize(theirs), deserialize_torch_tensor(theirs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("codec", ["none", "float16", "8bit"])
def test_gpu_tensors_encode_on_the_gpu_and_decode_onto_it(codec):
    tensor = torch.randn(4, 64, 1000, device="cuda")
    message = runtime_pb2.Tensor.FromString(compression.serialize(tensor, codec).SerializeToString())
    on_gpu, on_cpu = compression.deserialize(message, "cuda"), compression.deserialize(message)
    assert on_gpu.device.type == "cuda" and on_cpu.device.type == "cpu" and torch.equal(on_gpu.cpu(), on_cpu)
    assert ((on_cpu - tensor.cpu()).abs() <= error_bound(tensor.cpu(), codec)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("codec", ["none", "float16", "8bit"])
def test_gpu_messages_decode_divided_into_their_slice_on_the_gpu(codec):
    message = compression.encode(torch.randn(3, 64, 1000, device="cuda"), codec, scale=3.0)
    whole = torch.full((9, 64, 1000), math.nan, device="cuda")
    compression.deserialize(message, out=whole[3:6], divide=3.0)
    assert whole[:3].isnan().all() and whole[6:].isnan().all()
    torch.testing.assert_close(whole[3:6], compression.deserialize(message, "cuda") / 3, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("codec", ["none", "float16", "8bit"])
def test_encoding_on_a_side_stream_waits_for_the_tensor_and_its_own_kernels(codec):
    """A stage server encodes its replies on a stream beside the compute. bitsandbytes launches its quantization on
    the default stream whatever the current one is: unordered, it read activations not yet computed and the copy to
    the host read scales not yet written (on an H100, a 2-stage swarm then got all-zero activations). Each tensor is
    made on the side stream behind a long matmul and encoded there at once, never synchronized by hand."""
    side = torch.cuda.Stream()
    slow = torch.randn(4096, 4096, device="cuda")
    expected = torch.randn(16, 64, 4096, device="cuda")
    reference = compression.deserialize(compression.encode(expected, codec))
    torch.cuda.synchronize()
    for _ in range(5):
        with torch.cuda.stream(side):
            delay = slow
            for _ in range(20):
                delay = delay @ slow / 64
            tensor = expected + (0 * delay[0, 0]).nan_to_num(0.0, 0.0, 0.0)  # ready once the matmuls are done
            decoded = compression.deserialize(compression.encode(tensor, codec))
        assert torch.equal(decoded, reference)


def _altered(message: runtime_pb2.Tensor, **fields) -> runtime_pb2.Tensor:
    """A copy of ``message`` with some fields replaced."""
    altered = runtime_pb2.Tensor()
    altered.CopyFrom(message)
    if "size" in fields:
        del altered.size[:]
        altered.size.extend(fields.pop("size"))
    for field, value in fields.items():
        setattr(altered, field, value)
    return altered


_TWO_BLOCKS = torch.randn(3, 5000)
_8BIT, _NONE, _FP16 = (compression.serialize(_TWO_BLOCKS, codec) for codec in ("8bit", "none", "float16"))
_LENGTH = "the shape and dtype need"
MALFORMED = {  # name: (message, what the error says)
    "truncated": (_altered(_8BIT, buffer=_8BIT.buffer[:-1]), _LENGTH),
    "one byte too many": (_altered(_8BIT, buffer=_8BIT.buffer + b"\0"), _LENGTH),
    "one absmax missing": (_altered(_8BIT, buffer=_8BIT.buffer[4:]), _LENGTH),
    "one absmax too many": (_altered(_8BIT, buffer=_8BIT.buffer[:4] + _8BIT.buffer), _LENGTH),
    "empty buffer": (_altered(_8BIT, buffer=b""), _LENGTH),
    "shape larger than the buffer": (_altered(_8BIT, size=[3, 5001]), _LENGTH),
    "huge shape": (_altered(_8BIT, size=[10**9, 10**9]), _LENGTH),
    "hivemind's 8-bit format": (_altered(_8BIT, dtype="float32"), "expected '<dtype>:"),
    "other block size": (_altered(_8BIT, dtype="float32:dynamic8-2048"), "expected '<dtype>:"),
    "unknown dtype": (_altered(_8BIT, dtype="object" + compression.EIGHT_BIT_TAG), "unsupported dtype 'object'"),
    "integer 8-bit": (_altered(_8BIT, dtype="int32" + compression.EIGHT_BIT_TAG), "unsupported dtype 'int32'"),
    "unknown compression": (_altered(_8BIT, compression=runtime_pb2.UNIFORM_8BIT), "unsupported compression"),
    "none, unknown dtype": (_altered(_NONE, dtype="object"), "unsupported dtype 'object'"),
    "none, wrong length for the dtype": (_altered(_NONE, dtype="float64"), _LENGTH),
    "none, bool bytes other than 0/1": (_altered(_NONE, buffer=b"\0\2", size=[2], dtype="bool"), "bool tensor"),
    "float16, integer dtype": (_altered(_FP16, dtype="int16"), "unsupported dtype 'int16'"),
    "float16, truncated": (_altered(_FP16, buffer=_FP16.buffer[:-2]), _LENGTH),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_messages_are_refused(name):
    message, error = MALFORMED[name]
    with pytest.raises(ValueError, match=re.escape(error)):
        compression.deserialize(runtime_pb2.Tensor.FromString(message.SerializeToString()))
