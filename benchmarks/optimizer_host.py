"""The stage optimizer's work per backward and per step: hivemind's loops over the parameter tensors against the
multi-tensor calls that replaced them (issue 25).

After each backward a stage optimizer adds the parameters' gradients into its accumulators; at a step it scales them
into ``.grad``, runs the optimizer and zeroes the accumulators. hivemind does each with one operation per parameter
tensor (on a GPU, one kernel launch each: a stage of examples/gpt.py's blocks has 12 tensors per block);
``BoundedGradientAverager`` and ``SwarmOptimizer`` now make one multi-tensor call each. Both run here on the same
optimizer (one ``SwarmOptimizer``, alone, its DHT on loopback, over one stage of 4 blocks), taking turns cycle by
cycle: a cycle is 4 backwards' hand-overs (``optimizer.step(batch_size)`` then ``zero_grad``, as a stage server does),
the 4th of which steps. Host: until the call returns; total: until the device has done its work too.

A round (the peers of a stage averaging their gradients) adds two copies around its all-reduce: the accumulated
gradients, scaled, into the averager's shared host buffers, and the average back into ``.grad``. hivemind copies
tensor by tensor through pageable memory and scales on the host; ours scales on the device and copies to and from the
buffers pinned (``device_sync.copy_scaled``, ``copy_waited``). Each cycle also times those two copies ("per round",
no all-reduce) each way on the same optimizer (hivemind's on shared buffers of its own, not pinned).

    python benchmarks/optimizer_host.py            # d_model 64 on the CPU; 1024 and 2048 on a GPU if there is one
    python benchmarks/optimizer_host.py --smoke    # seconds-long check that the script works
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from gpt import Block  # noqa: E402
from harness import script_parser  # noqa: E402
from hivemind.optim import Optimizer  # noqa: E402
from hivemind.optim.grad_averager import GradientAverager  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

from lightning_swarm.node import SwarmNode  # noqa: E402
from lightning_swarm.optimizer import SwarmOptimizer, swarm_optimizer  # noqa: E402

BLOCKS, BATCH, PER_STEP = 4, 8, 4  # blocks per stage, samples per backward, backwards per step
VARIANTS = ("per tensor (hivemind)", "multi-tensor")


def per_tensor_load(optimizer: SwarmOptimizer) -> None:
    """The step's scaling before the change: a copy and a multiply per parameter tensor."""
    averager = optimizer.grad_averager
    scale = 1.0 / averager.local_times_accumulated if averager.local_times_accumulated else 0.0
    with torch.no_grad():
        for param, accumulated in zip(averager.parameters, averager._grad_accumulators()):
            if param.grad is None:
                param.grad = torch.empty_like(param)
            param.grad.copy_(accumulated).mul_(scale)
    averager.notify_used_averaged_gradients()


AVERAGER_METHODS = ("accumulate_grads_", "reset_accumulated_grads_", "load_accumulators_into_averager_")
OPTIMIZER_METHODS = ("_load_local_gradients_into_optimizer", "_load_averaged_gradients_into_optimizer_")


def use(optimizer: SwarmOptimizer, variant: str, buffers: dict[str, tuple]) -> None:
    """Switch ``optimizer`` to ``variant``: hivemind's per-tensor methods bound on the instance, or none (ours); and
    its averager to the variant's shared buffers (``buffers``)."""
    averager = optimizer.grad_averager
    for name in AVERAGER_METHODS:
        vars(averager).pop(name, None)
    for name in OPTIMIZER_METHODS:
        vars(optimizer).pop(name, None)
    averager._averaged_tensors = buffers[variant]
    if variant == VARIANTS[0]:
        for name in AVERAGER_METHODS:
            setattr(averager, name, types.MethodType(getattr(GradientAverager, name), averager))
        optimizer._load_local_gradients_into_optimizer = types.MethodType(per_tensor_load, optimizer)
        optimizer._load_averaged_gradients_into_optimizer_ = types.MethodType(
            Optimizer._load_averaged_gradients_into_optimizer_, optimizer
        )


def measure(d_model: int, device: torch.device, cycles: int) -> dict:
    """Median ms per backward's hand-over and per step's, for each variant, on one stage of ``d_model``."""
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*(Block(d_model, max(1, d_model // 64)) for _ in range(BLOCKS))).to(device)
    params = [p for p in stage.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) for p in params]  # what a backward leaves in .grad
    node = SwarmNode().start()
    optimizer = swarm_optimizer(
        node.dht, "optimizer_host", torch.optim.AdamW(params, lr=1e-4), PER_STEP * BATCH, 1.0, 5.0
    )
    parts = ("backward host", "backward", "step host", "step", "round host", "round")
    times = {v: {part: [] for part in parts} for v in VARIANTS}
    steps = dict.fromkeys(VARIANTS, 0)
    ours = optimizer.grad_averager._averaged_tensors  # pinned on a GPU
    buffers = {VARIANTS[0]: tuple(t.clone().share_memory_() for t in ours), VARIANTS[1]: ours}

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        for cycle in range(cycles + 1):  # the first: a warm-up of each
            for variant in VARIANTS if cycle % 2 else VARIANTS[::-1]:  # each goes first in half the cycles
                use(optimizer, variant, buffers)
                for call in range(PER_STEP):
                    for param, grad in zip(params, grads):
                        param.grad = grad
                    epoch = optimizer.local_epoch
                    synchronize()
                    start = time.perf_counter()
                    optimizer.step(batch_size=BATCH)
                    optimizer.zero_grad()
                    returned = time.perf_counter()
                    synchronize()
                    done = time.perf_counter()
                    stepped = optimizer.local_epoch > epoch
                    if stepped != (call == PER_STEP - 1):
                        raise RuntimeError(f"{variant}: stepped={stepped} at hand-over {call + 1} of {PER_STEP}")
                    steps[variant] += stepped
                    if cycle:
                        part = "step" if stepped else "backward"
                        times[variant][f"{part} host"].append(returned - start)
                        times[variant][part].append(done - start)
                averager = optimizer.grad_averager  # a round's copies (of three backwards), no all-reduce
                for _ in range(3):
                    for param, grad in zip(params, grads):
                        param.grad = grad.clone()
                    averager.accumulate_grads_(BATCH)
                synchronize()
                start = time.perf_counter()
                averager.load_accumulators_into_averager_()
                optimizer._load_averaged_gradients_into_optimizer_()
                returned = time.perf_counter()
                synchronize()
                if cycle:
                    times[variant]["round host"].append(returned - start)
                    times[variant]["round"].append(time.perf_counter() - start)
                if not all(torch.equal(p.grad, (g + g + g).mul_(1 / 3)) for p, g in zip(params, grads)):
                    raise RuntimeError(f"{variant}: a round's copies did not give hivemind's gradients")
                averager.reset_accumulated_grads_()
    finally:
        use(optimizer, VARIANTS[1], buffers)  # its own buffers back: the pinned ones are unregistered at shutdown
        optimizer.shutdown()
        node.shutdown()
    return {
        "device": device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
        "d_model": d_model,
        "tensors": len(params),
        "cycles": cycles,
        "steps": steps,
        "ms": {v: {part: 1e3 * statistics.median(x) for part, x in parts.items()} for v, parts in times.items()},
    }


def main() -> None:
    parser = script_parser(__doc__, "one small stage on the CPU, a few cycles, to check the script")
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS))
    a = parser.parse_args()
    logging.getLogger("lightning_swarm.optimizer").setLevel(logging.ERROR)  # stepping alone this often is the point
    runs = [(64, torch.device("cpu"))]  # small: the per-call costs, which a GPU pays as launches
    if torch.cuda.is_available() and not a.smoke:
        runs += [(d, torch.device("cuda")) for d in (1024, 2048)]
    cycles = 3 if a.smoke else a.cycles
    rows = []
    for d_model, device in runs:
        rows.append(measure(d_model, device, cycles))
        print(rows[-1], flush=True)
    out = Path(a.out)
    write(rows, out, smoke=a.smoke)
    save_data("optimizer_host", rows, out.parent / "results")


def ratio(row: dict, part: str) -> float:
    """hivemind's way over ours: host times, or for a round (which waits for its copies) total times."""
    key = part if part == "round" else f"{part} host"
    return row["ms"][VARIANTS[0]][key] / row["ms"][VARIANTS[1]][key]


def write(rows: list[dict], path: Path, smoke: bool) -> None:
    old, new = VARIANTS
    lines = [
        "## The stage optimizer's host work: per-tensor loops against multi-tensor calls",
        "",
        f"`python benchmarks/optimizer_host.py`{' --smoke' if smoke else ''}, {machine()} (see its docstring): one "
        f"stage of {BLOCKS} examples/gpt.py blocks, one `SwarmOptimizer` alone, a step every {PER_STEP} backwards; "
        "the two ways take turns cycle by cycle on the same optimizer. Median ms: host (until the call returns) / "
        "total (the device done too). Ratio: per-tensor over multi-tensor, host (per round: total). Per round: a "
        "round's two copies, hivemind's (through pageable memory, scaled on the host) against ours (scaled on the "
        "device, through pinned memory on a GPU).",
        "",
        *table(
            ["device", "d_model", "tensors", "cycles", "per backward: per tensor", "multi-tensor", "ratio"]
            + ["per step: per tensor", "multi-tensor", "ratio", "per round: hivemind", "ours", "ratio"],
            [
                [row["device"], str(row["d_model"]), str(row["tensors"]), str(row["cycles"])]
                + [
                    cell
                    for part in ("backward", "step", "round")
                    for cell in (
                        f"{row['ms'][old][part + ' host']:.3f} / {row['ms'][old][part]:.3f}",
                        f"{row['ms'][new][part + ' host']:.3f} / {row['ms'][new][part]:.3f}",
                        f"{ratio(row, part):.2f}",
                    )
                ]
                for row in rows
            ],
        ),
    ]
    update_section("optimizer_host", lines, path)


if __name__ == "__main__":
    main()
