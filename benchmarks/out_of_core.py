"""A stage larger than its device-memory budget, served out of core (issue 16, KARMA): samples/s against the same
stage resident, the copy/compute overlap seen, peak device memory, and the loss curves.

The stage: `--blocks` examples/gpt.py blocks of `--d-model` (64 dimensions per head), trained on a fixed stream of
random batches (`--batch-size` x `--tokens` x d_model, targets likewise; loss: mean squared error of the stage's
output), an optimizer step (AdamW) every `--step-every` batches. Three runs, in this order, in one process:

- resident: the stage on the device, plain autograd (its graph kept until backward), optimizer on the device;
- recompute: the out-of-core stage with no budget (every block resident on the device): the out-of-core compute
  (forward, then recompute and backward block by block, gradients copied to the host, host-side optimizer step)
  without the swaps; the reference the swaps' overlap is measured against;
- for each `--ratios` r: the stage's parameters are r times a device-memory cap, set with
  `torch.cuda.set_per_process_memory_fraction`; the out-of-core plan gets the cap less what the activations need
  (each block's input, kept, and one block's forward and backward workspace, measured beforehand), and swaps.

Samples/s over the timed batches after warm-up ones, and their time apart: forward and backward (compute, the swaps'
copies included) per batch, and the optimizer step (the device synchronised around each timed step) per step.
Overlap: the share of the swaps' copy time (the bytes copied beyond the recompute run's, at the measured pinned-copy
bandwidth) that did not show in the time per batch. Peak: torch's `max_memory_allocated` against the cap. Loss: the
largest difference from the resident run's loss curve.

Targets (issue 16): at 2x the budget at least 0.7 of the resident stage's samples/s, at 4x at least 0.5; peak
device memory within the budget; the same loss curve as the resident stage.

The plan's window needs four blocks (two blocks' parameters, two blocks' gradients), and each block's input stays on
the device: so the defaults take many blocks (32 of d_model 2048, 6.4 GB in fp32) and a batch whose activations
are small next to them (4 x 512 tokens). Throughput is bounded by bytes copied per token: a larger batch hides more.

On a lent GPU (see ../shared/gpu/README.md). Here, once: `bash ../shared/gpu/fetch_wheels.sh` (the wheels the GPU
machine lacks, hivemind among them, into .whl/). Then a `run` carrying `[".whl"]`, whose command is (times
estimated, not measured: the default stage's 1.6B parameters are initialised and copied on the CPU, and AdamW steps
them on the host)

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
      export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
    timeout -k 20 540 python3 benchmarks/out_of_core.py --smoke --out $OUT/RESULTS.md    # ~1 min, a small stage
    timeout -k 20 540 python3 benchmarks/out_of_core.py --out $OUT/RESULTS.md            # ~3-5 min
    timeout -k 20 540 python3 benchmarks/out_of_core.py --out $OUT/RESULTS.md --batch-size 16  # if time is left

then here: `python benchmarks/out_of_core.py --merge <files_at>/results/out_of_core.json` (into
benchmarks/results/out_of_core.json and the out_of_core section of benchmarks/RESULTS.md).

Without CUDA, `--smoke` prints that it skipped and exits 0; `--device cpu` runs it on the CPU with a small stage
(no memory cap there: the plan's budget alone makes it swap; copies are plain copies, so it measures the
schedule's overhead, recompute and copies, not an overlap).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpt import Block  # noqa: E402
from harness import script_parser  # noqa: E402
from report import RESULTS, machine, table, update_section  # noqa: E402

from lightning_swarm.server.out_of_core import (  # noqa: E402
    OutOfCoreStage,
    block_bytes,
    measure_copy_bandwidth,
    plan_out_of_core,
)

MIB = 2**20


def make_blocks(d_model: int, n_blocks: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(d_model, max(1, d_model // 64)) for _ in range(n_blocks))).to(dtype)


def make_data(n: int, batch: int, tokens: int, d_model: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    shape = (batch, tokens, d_model)
    return [(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))] * n


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(module: nn.Module, device: torch.device, data: list, warmup: int, step_every: int) -> dict:
    """Train ``module`` on ``data``: losses, samples/s over the batches after ``warmup``, and the time of those
    batches apart: the forward and backward passes (``compute_s_per_batch``, the swaps' copies included) and the
    optimizer step (``step_s``: seconds per step, None without a step among them; the device is synchronised before
    and after each timed step, so that each side's work is counted on its side); peak device memory."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    losses, start, steps, step_seconds = [], time.perf_counter(), 0, 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i, (x, y) in enumerate(data):
        if i == warmup:
            synchronize(device)
            start = time.perf_counter()
        x, y = x.to(device, non_blocking=True).requires_grad_(), y.to(device, non_blocking=True)
        loss = nn.functional.mse_loss(module(x).float(), y.float())
        loss.backward()
        losses.append(loss.detach())
        if (i + 1) % step_every == 0:
            timed = i >= warmup
            if timed:
                synchronize(device)
                step_start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if timed:
                synchronize(device)
                steps, step_seconds = steps + 1, step_seconds + time.perf_counter() - step_start
    synchronize(device)
    elapsed = time.perf_counter() - start
    batches = len(data) - warmup
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dict(
        losses=[float(v) for v in losses],
        samples_per_s=batches * data[0][0].shape[0] / elapsed,
        s_per_batch=elapsed / batches,
        compute_s_per_batch=(elapsed - step_seconds) / batches,
        step_s=step_seconds / steps if steps else None,
        peak=peak,
    )


def activation_reserve(blocks: nn.Sequential, device: torch.device, x: torch.Tensor) -> int:
    """Device bytes the activations of an out-of-core pass need besides the plan's parameters and gradients: every
    block's input (kept), and one block's forward and backward workspace (measured on the first block)."""
    kept = len(blocks) * x.numel() * x.element_size()
    if device.type != "cuda":
        return kept
    block = copy.deepcopy(blocks[0]).to(device)
    params = block_bytes([block])[0]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    inputs = x.to(device).requires_grad_()
    torch.autograd.grad(block(inputs).sum(), [inputs, *block.parameters()])
    workspace = torch.cuda.max_memory_allocated(device) - base - 2 * params  # less its parameters and gradients
    del block, inputs
    torch.cuda.empty_cache()
    return kept + max(workspace, 0)


def measure(a: argparse.Namespace, device: torch.device) -> dict:
    dtype = getattr(torch, a.dtype)
    data = make_data(a.warmup + a.batches, a.batch_size, a.tokens, a.d_model, dtype)
    blocks = make_blocks(a.d_model, a.blocks, dtype)
    stage_bytes = sum(block_bytes(blocks))
    bandwidth = measure_copy_bandwidth(device)
    figures = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        d_model=a.d_model,
        blocks=a.blocks,
        batch=f"{a.batch_size}x{a.tokens}",
        dtype=a.dtype,
        stage_bytes=stage_bytes,
        bandwidth=bandwidth,
        machine=machine(),
        runs=[],
    )
    print(f"stage: {a.blocks} blocks of d_model {a.d_model}, {stage_bytes / MIB:.0f} MiB; copies {bandwidth} B/s")

    resident = train(copy.deepcopy(blocks).to(device), device, data, a.warmup, a.step_every)
    figures["runs"].append(dict(kind="resident", ratio=None, **resident))
    torch.cuda.empty_cache() if device.type == "cuda" else None
    print(f"resident: {resident['samples_per_s']:.2f} samples/s, peak {resident['peak']}")

    reserve = activation_reserve(blocks, device, data[0][0])
    runs: list[tuple[str, Optional[float]]] = [("recompute", None)] + [("out of core", r) for r in a.ratios]
    for kind, ratio in runs:
        cap = None if ratio is None else int(stage_bytes / ratio)
        budget = None if cap is None else cap - reserve
        entry = dict(kind=kind, ratio=ratio, cap=cap, budget=budget)
        try:
            plan = plan_out_of_core(block_bytes(blocks), None, bandwidth, budget)
        except ValueError as e:
            entry.update(status=f"does not fit: {e}")
            figures["runs"].append(entry)
            print(f"{kind} at {ratio}x: {entry['status']}")
            continue
        stage = OutOfCoreStage(list(copy.deepcopy(blocks)), device, plan, copy_bandwidth=bandwidth)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else cap / total, device)
        try:
            result = train(stage, device, data, a.warmup, a.step_every)
            plan = stage.plan  # planned again from the timings of the warm-up batches (CUDA)
            entry.update(status="ok", **result, plan=plan.describe(), resident_blocks=len(plan.resident))
            entry.update(copied_per_batch=stage.copied_bytes / len(data), peak_blocks=stage.peak_blocks_on_device)
        except torch.OutOfMemoryError as e:
            entry.update(status=f"out of memory: {str(e).splitlines()[0]}")
        finally:
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, device)
            del stage
        figures["runs"].append(entry)
        print(
            f"{kind} at {ratio}x: {entry.get('samples_per_s', 0):.2f} samples/s, {entry['status']}, {entry.get('plan')}"
        )
    return figures


def overlap(run: dict, reference: Optional[dict], bandwidth: Optional[float]) -> str:
    """The share of the swaps' extra copy time hidden behind compute ("-" without a bandwidth or reference)."""
    if not bandwidth or reference is None or reference.get("status") != "ok" or run.get("status") != "ok":
        return "-"
    copy_s = (run["copied_per_batch"] - reference["copied_per_batch"]) / bandwidth
    if copy_s <= 0:
        return "-"
    shown = run["s_per_batch"] - reference["s_per_batch"]
    return f"{min(1.0, max(0.0, 1 - shown / copy_s)):.2f}"


def write(results: list[dict], path: Path) -> None:
    rows = []
    for figures in results:
        runs = figures["runs"]
        resident = next(r for r in runs if r["kind"] == "resident")
        recompute = next((r for r in runs if r["kind"] == "recompute"), None)
        label = [
            figures["device"],
            f"{figures['blocks']} x {figures['d_model']} ({figures['stage_bytes'] / MIB:.0f} MiB)",
            figures["batch"],
            figures["dtype"],
        ]
        for run in runs:
            ok = run.get("status", "ok") == "ok"
            speed = f"{run['samples_per_s']:.2f}" if ok else run["status"].split(":")[0]
            ratio = f"{run['samples_per_s'] / resident['samples_per_s']:.2f}" if ok else "-"
            cap = f"{run['cap'] / MIB:.0f}" if run.get("cap") else "-"
            peak = f"{run['peak'] / MIB:.0f}" if ok and run.get("peak") else "n/a"
            loss = f"{max(abs(a - b) for a, b in zip(run['losses'], resident['losses'])):.2g}" if ok else "-"
            kind = run["kind"] + (f" {run['ratio']:g}x" if run.get("ratio") else "")
            blocks = f"{run['resident_blocks']} / {run['peak_blocks']}" if ok and "resident_blocks" in run else "-"
            compute = f"{run['compute_s_per_batch']:.4f}" if ok and "compute_s_per_batch" in run else "-"
            step = f"{run['step_s']:.4f}" if ok and run.get("step_s") is not None else "-"
            rows.append(
                [*label, kind, speed, ratio, compute, step, blocks, overlap(run, recompute, figures["bandwidth"])]
                + [cap, peak, loss]
            )
    lines = [
        "## Out-of-core stages (KARMA): a stage larger than its device-memory budget",
        "",
        "`python benchmarks/out_of_core.py` (see its docstring): the stage resident; out of core with every block "
        "resident (recompute, no swaps); out of core within a memory cap of 1/2 and 1/4 of the stage's parameters "
        "(`torch.cuda.set_per_process_memory_fraction`). Compute: seconds per timed batch in forward and backward (the "
        "swaps' copies included); step: seconds per optimizer step (on the host out of core), timed apart. "
        "Blocks: resident in the plan / most on the device at once. "
        "Overlap: share of the swaps' copy time hidden behind compute. Loss: largest difference from the resident "
        "run's loss curve.",
        "",
        "Targets (issue 16): at 2x the budget >= 0.7 of the resident stage's samples/s, at 4x >= 0.5; peak device "
        "memory within the cap; the same loss curve.",
        "",
    ]
    if not any(f["device"] != "cpu" for f in results):
        doc = __doc__
        lines += [
            "**To be measured on a lent GPU** (no GPU figures yet).",
            "",
            *doc[doc.index("On a lent GPU") : doc.index("Without CUDA, `--smoke`")].strip().splitlines(),
            "",
        ]
    if rows:
        header = [
            "device",
            "stage",
            "batch",
            "dtype",
            "run",
            "samples/s",
            "/ resident",
            "compute (s/batch)",
            "step (s)",
            "blocks",
            "overlap",
            "cap (MiB)",
            "peak (MiB)",
            "loss diff",
        ]
        lines += [f"Measured {results[-1]['machine']}.", "", *table(header, rows)]
    update_section("out_of_core", lines, path)


def save(new: list[dict], out: Path) -> None:
    """Merge ``new`` into results/out_of_core.json beside ``out`` (a configuration measured again replaces the old
    figures) and rewrite the section."""
    data = out.parent / "results" / "out_of_core.json"
    key = ("device", "d_model", "blocks", "batch", "dtype")
    old = json.loads(data.read_text())["results"] if data.exists() else []
    merged = [r for r in old if all(tuple(r[k] for k in key) != tuple(n[k] for k in key) for n in new)] + new
    data.parent.mkdir(exist_ok=True)
    data.write_text(json.dumps({"results": merged}, indent=1) + "\n")
    write(merged, out)


def main() -> None:
    parser = script_parser(__doc__, "a small stage on the GPU; skips (exit 0) without CUDA")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--ratios", type=float, nargs="+", default=[2.0, 4.0], help="stage size / memory cap")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batches", type=int, default=16, help="timed batches")
    parser.add_argument("--step-every", type=int, default=4, help="batches per optimizer step")
    parser.add_argument("--out", default=str(RESULTS), help="results file; the JSON goes to results/ beside it")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="only merge these results/out_of_core.json")
    a = parser.parse_args()
    out = Path(a.out)
    if a.merge:
        save([r for path in a.merge for r in json.loads(Path(path).read_text())["results"]], out)
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        if a.smoke:
            print("out_of_core benchmark skipped: no CUDA device (--device cpu runs it on the CPU)")
            return
        parser.error("no CUDA device: run it where there is one, or on the CPU with --device cpu")
    if a.device == "cpu":
        torch.set_num_threads(1)  # the figures compare runs: several threads on shared cores spin and scatter them
    if a.smoke or a.device == "cpu":
        a.d_model, a.blocks, a.batch_size, a.tokens = 128, 24, 2, 32
        a.warmup, a.batches = (1, 3) if a.smoke else (a.warmup, a.batches)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:  # set_per_process_memory_fraction wants an index
        device = torch.device("cuda", torch.cuda.current_device())
    save([measure(a, device)], out)


if __name__ == "__main__":
    main()
