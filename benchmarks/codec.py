"""Codec throughput: how fast each wire codec encodes and decodes an activation-sized fp32 tensor, how many bytes it
puts on the wire and how much it loses; with hivemind's own ``BLOCKWISE_8BIT`` serializer side by side.

Encoding is ``compression.serialize`` on the tensor's device (the bytes end on the host); decoding is
``compression.deserialize`` of the parsed message, onto the same device. Speeds are MB (10^6 bytes) of fp32 input
per second, the median of several repeats, with one torch thread. On a machine with CUDA the GPU is measured too
(hivemind's serializer then needs the tensor on the host first, and the copy counts).

    python benchmarks/codec.py            # writes benchmarks/RESULTS.md and benchmarks/results/codec.json
    python benchmarks/codec.py --smoke    # seconds-long check that the script works
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")  # bitsandbytes' CPU kernels too

import torch  # noqa: E402
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from harness import script_parser  # noqa: E402
from helpers.oracles import error_bound  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

from lightning_swarm import compression  # noqa: E402

HIVEMIND = "hivemind 8-bit"
CODECS = ["none", "float16", "8bit", HIVEMIND]


def codec_functions(codec: str, device: torch.device) -> tuple[Callable, Callable]:
    """(encode: tensor -> message, decode: message -> tensor on ``device``) for one codec."""
    if codec == HIVEMIND:
        return (
            lambda t: serialize_torch_tensor(t.cpu(), runtime_pb2.CompressionType.BLOCKWISE_8BIT),
            lambda m: deserialize_torch_tensor(m).to(device),
        )
    return lambda t: compression.serialize(t, codec), lambda m: compression.deserialize(m, device)


def median_seconds(calls: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """The median wall time of each call, waiting for the device each time. The calls take turns, so that the load
    of this shared machine falls on all of them alike; one untimed warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def measure(tensor: torch.Tensor, repeats: int) -> list[dict]:
    """One row per codec for ``tensor``, on its device."""
    functions = {codec: codec_functions(codec, tensor.device) for codec in CODECS}
    wires = {codec: encode(tensor).SerializeToString() for codec, (encode, _) in functions.items()}
    messages = {codec: runtime_pb2.Tensor.FromString(wire) for codec, wire in wires.items()}  # as a receiver gets it
    encoding = median_seconds(
        {codec: functools.partial(encode, tensor) for codec, (encode, _) in functions.items()}, repeats, tensor.device
    )
    decoding = median_seconds(
        {codec: functools.partial(decode, messages[codec]) for codec, (_, decode) in functions.items()},
        repeats,
        tensor.device,
    )
    fp32_bytes, reference = tensor.numel() * 4, tensor.cpu()
    rows = []
    for codec, (_, decode) in functions.items():
        error = (decode(messages[codec]).cpu() - reference).abs()
        bound = error_bound(reference, "8bit" if codec == HIVEMIND else codec)
        rows.append(
            {
                "device": tensor.device.type,
                "shape": list(tensor.shape),
                "codec": codec,
                "encode_mb_s": fp32_bytes / 1e6 / encoding[codec],
                "decode_mb_s": fp32_bytes / 1e6 / decoding[codec],
                "wire_bytes": len(wires[codec]),
                "wire_fraction": len(wires[codec]) / fp32_bytes,
                "max_abs_error": float(error.max()),
                "max_rel_error": float(error.max() / reference.abs().max()),
                "within_bound": bool((error <= bound).all()),
            }
        )
    return rows


def main() -> None:
    parser = script_parser(__doc__, "one tiny tensor and few repeats, to check the script")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048], help="hidden sizes (last dim)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS))
    a = parser.parse_args()
    torch.set_num_threads(1)
    shapes = [(4, 16, 64)] if a.smoke else [(a.batch_size, a.block_size, d) for d in a.sizes]
    repeats = 3 if a.smoke else a.repeats
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])

    rows = []
    generator = torch.Generator().manual_seed(0)
    for device in devices:
        for shape in shapes:
            tensor = torch.randn(shape, generator=generator).to(device)
            for row in measure(tensor, repeats):
                rows.append(row)
                print(describe(row), flush=True)
    out = Path(a.out)
    write(rows, out, smoke=a.smoke, repeats=repeats)
    save_data("codec", rows, out.parent / "results")


def describe(row: dict) -> str:
    shape = "x".join(map(str, row["shape"]))
    return (
        f"{row['device']:4s} {shape:12s} {row['codec']:15s} encode {row['encode_mb_s']:8.1f} MB/s, "
        f"decode {row['decode_mb_s']:8.1f} MB/s, wire {row['wire_fraction']:.4f} of fp32, "
        f"max error {row['max_rel_error']:.2e} of the largest value"
    )


def write(rows: list[dict], path: Path, smoke: bool, repeats: int) -> None:
    def key(row: dict) -> tuple:
        return row["device"], tuple(row["shape"])

    by_codec = {(key(row), row["codec"]): row for row in rows}
    comparisons = [
        [row["device"], "x".join(map(str, row["shape"]))]
        + [f"{row[field] / by_codec[key(row), HIVEMIND][field]:.2f}" for field in ("encode_mb_s", "decode_mb_s")]
        + [f"{row['wire_bytes'] / by_codec[key(row), HIVEMIND]['wire_bytes']:.4f}"]
        for row in rows
        if row["codec"] == "8bit"
    ]
    lines = [
        "## Codec throughput",
        "",
        f"`python benchmarks/codec.py`{' --smoke' if smoke else ''}, {machine()}; standard normal fp32 activations, "
        f"one torch thread, median of {repeats} repeats (the codecs take turns). MB/s: MB (10^6 bytes) of fp32 input "
        "per second. Wire: the serialized message's bytes as a fraction of the fp32 bytes (target for 8-bit: at most "
        "0.27). Max error: the largest absolute error; relative: that error over the tensor's largest absolute value; "
        "bound: whether every element is within `error_bound` (tests/helpers/oracles.py). `hivemind 8-bit`: "
        "hivemind's `BLOCKWISE_8BIT` serializer (host only).",
        "",
        *table(
            ["device", "tensor", "codec", "encode MB/s", "decode MB/s", "wire / fp32", "max error", "relative"]
            + ["bound"],
            [
                [
                    row["device"],
                    "x".join(map(str, row["shape"])),
                    row["codec"],
                    f"{row['encode_mb_s']:.1f}",
                    f"{row['decode_mb_s']:.1f}",
                    f"{row['wire_fraction']:.4f}",
                    f"{row['max_abs_error']:.2e}",
                    f"{row['max_rel_error']:.2e}",
                    "yes" if row["within_bound"] else "NO",
                ]
                for row in rows
            ],
        ),
        "",
        "### Our 8-bit codec against hivemind's BLOCKWISE_8BIT, measured side by side",
        "",
        "Ratios ours / hivemind's: above 1 is faster for speeds; below 1 is fewer bytes for the wire.",
        "",
        *table(["device", "tensor", "encode speed", "decode speed", "wire bytes"], comparisons),
    ]
    update_section("codec", lines, path)


if __name__ == "__main__":
    main()
