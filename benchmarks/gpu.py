"""Plain training on one GPU against the 2-stage swarm on the same GPU: samples/s, their ratio, and each process's
peak GPU memory.

examples/gpt.py with 8 blocks, d_model 1024, 2048 and 4096 (64 dimensions per head), batch 8 x 512 tokens. Plain:
`gpt.py --single` on the GPU. Swarm: one serve-only peer per stage and one drive-only trainer, all on the same
GPU, so plain training is the ceiling (the same GPU does the same compute); 8-bit wire, an optimizer step every
batch, synchronous or delayed stage updates, the strategy's default microbatches (`--microbatches` sets them).
Precision through `gpt.py --precision` (`32-true`, `bf16-mixed`). Each run trains warm-up
batches, then timed batches: samples/s over the timed ones, from the trainer's own step times. Peak GPU memory per
process: torch's `max_memory_reserved` and `max_memory_allocated` as the process reports them itself
(examples/gpt.py with `GPT_CUDA_MEMORY_DIR`), and the most `nvidia-smi --query-compute-apps` showed for its pid,
polled every 0.5 s. A run that runs out of memory (plain, or any swarm process) is reported as "out of memory"
with the processes whose logs say so; any other failure or a run past `--timeout` (with the samples/s of the
batches it finished) is reported too, and the benchmark goes on with the next run. Every run's peers are stopped by
their process groups before the next one starts, also on an error or SIGTERM. Figures are merged into
`results/gpu.json` beside `--out` (a run replaces the earlier figures of the same configuration), and the `gpu`
section of `--out` is rewritten from all of them.

Targets (issue 14): swarm/plain >= 0.8 at d_model 2048 and >= 0.5 at d_model 1024, in 32-true and bf16-mixed; each
stage peer's peak GPU memory <= 0.6 of plain training's whole-model peak; d_model 4096 runs wherever plain training
of it fits.

Time on an H100, estimated (not yet measured) from the swarm's speed as of 4f5f6c1 (0.1-0.2 of plain training;
a faster swarm takes less): a plain run starts in ~20 s, a swarm run in ~40-50 s (imports, CUDA, three processes
started one after the other and joining; more at d_model 4096, whose 1.6B parameters each process initialises on
the CPU), then 5 + 20 batches. d_model 2048: ~3-4 min per precision, both update modes; d_model 1024: ~4-5 min for
both precisions and both update modes; d_model 4096: ~3-6 min per precision and update mode (each stage peer holds
0.8B parameters, ~13 GB of fp32 weights, gradients and Adam state). All of it is ~25-30 min of device time with the
machine's start: about one session's 30 minutes, so run the targets first (d_model 2048 and 1024), then d_model
4096. `32-true` runs full fp32 matmuls (torch's default, no TF32) in plain training and on the swarm alike.

On a lent GPU (see ../shared/gpu/README.md). Here, once: `bash ../shared/gpu/fetch_wheels.sh` (the wheels the GPU
machine lacks, into .whl/). Then each `run` carries `[".whl"]`, and its command is (timeout leaves the benchmark
20 s to stop its peers, and the whole command ends inside the device's 10 minutes)

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
      export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
    timeout -k 20 540 python3 benchmarks/gpu.py --out $OUT/RESULTS.md ARGS

with ARGS, one command each, in this order:

    --smoke                                                          # ~1 min: a tiny model, the GPU path works
    --d-model 2048 --precision 32-true                               # ~3-4 min
    --d-model 2048 --precision bf16-mixed                            # ~3-4 min
    --d-model 1024                                                   # ~4-5 min: 32-true and bf16-mixed
    --d-model 4096 --precision 32-true --updates synchronous         # ~3-6 min
    --d-model 4096 --precision bf16-mixed --updates synchronous      # ~3-6 min
    --d-model 4096 --precision 32-true --updates delayed --no-plain  # if time is left, ~2-5 min
    --d-model 4096 --precision bf16-mixed --updates delayed --no-plain

After each but the smoke, here: `python benchmarks/gpu.py --merge <files_at>/results/gpu.json` (into
benchmarks/results/gpu.json and the gpu section of benchmarks/RESULTS.md). A command cut short by its timeout keeps
the runs it finished (each run is saved as it ends). `--updates synchronous` or `--updates delayed` runs one update
mode, `--no-plain` only the swarm (plain training measured by an earlier command).

Without CUDA, `--smoke` prints that it skipped and exits 0; `--device cpu` runs the whole harness on the CPU with a
tiny model (d_model 64, 2 blocks, batch 4 x 32, 2 + 3 batches), as tests/swarm/test_benchmarks_gpu.py does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import (  # noqa: E402
    STAGES,
    model_args,
    plain,
    script_parser,
    steady_call_seconds,
    steady_throughput,
    train_on_swarm,
)
from report import RESULTS, table, update_section  # noqa: E402

OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|out of memory", re.IGNORECASE)
MIB = 2**20
# the configuration that makes one run; a run replaces the earlier entry with the same values
KEY = ("device", "d_model", "n_layer", "batch", "block", "precision", "kind", "updates", "microbatches")


class GpuMemoryPoller:
    """The most GPU memory ``nvidia-smi`` shows for each process (bytes by pid) while in use as a context manager,
    and the most all of them held at once (``total``). Empty where nvidia-smi is missing."""

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self.peaks: dict[int, int] = {}
        self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="nvidia-smi", daemon=True)

    def _poll(self) -> None:
        command = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self._stop.wait(self.period):
            try:
                lines = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                continue
            used = {}
            for line in lines:
                pid, _, mib = line.partition(",")
                if pid.strip().isdigit() and mib.strip().isdigit():
                    used[int(pid)] = int(mib) * MIB
            for pid, size in used.items():
                self.peaks[pid] = max(self.peaks.get(pid, 0), size)
            self.total = max(self.total, sum(used.values()))

    def __enter__(self) -> GpuMemoryPoller:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)


def process_memory(directory: Path, poller: GpuMemoryPoller) -> dict:
    """Each process's peak GPU memory by name (``plain``, ``trainer``, ``stage <k>``): what it reported itself
    (``allocated``, ``reserved``) and what nvidia-smi showed for its pid (``nvidia_smi``); pids nvidia-smi showed
    that no process reported (another pid namespace, a helper) as ``pid <n>``, and ``total``: all at once."""
    names = {"single": "plain", "drive": "trainer", "both": "trainer"}
    memory: dict = {}
    for path in sorted(directory.glob("*.json")):
        figures = json.loads(path.read_text())
        name = f"stage {figures['stage']}" if figures["role"] == "serve" else names[figures["role"]]
        smi = poller.peaks.pop(figures["pid"], None)
        memory[name] = {"allocated": figures["allocated"], "reserved": figures["reserved"], "nvidia_smi": smi}
    memory.update({f"pid {pid}": {"nvidia_smi": size} for pid, size in poller.peaks.items()})
    memory["total"] = {"nvidia_smi": poller.total or None}
    return memory


def out_of_memory(logs: dict[str, str]) -> list[str]:
    """The names of the processes whose output (``logs``: name -> text) tells of running out of memory."""
    return [name for name, text in logs.items() if OUT_OF_MEMORY.search(text)]


def failure(error: BaseException, logs: dict[str, str]) -> dict:
    """A failed run's status: "out of memory" (and ``oom_in``: the processes whose ``logs`` say so), else "timed
    out" or "failed"; and the end of the error."""
    oom_in = out_of_memory(logs)
    status = "out of memory" if oom_in else "timed out" if isinstance(error, subprocess.TimeoutExpired) else "failed"
    details = error.stderr if isinstance(error, subprocess.CalledProcessError) else None
    text = details.decode(errors="replace") if details else str(error)
    return {"status": status, "error": text.strip()[-1500:], **({"oom_in": oom_in} if oom_in else {})}


def measure_plain(args: list[str], work: Path, warmup: int, timeout: float) -> dict:
    """One plain training run: samples/s over the timed batches, or how it failed."""
    try:
        history = plain(args, work, timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return failure(e, {"plain": (e.stderr or b"").decode(errors="replace")})
    return {"status": "ok", "samples_per_s": steady_throughput(history, warmup - 1), "batches": history["steps"]}


def measure_swarm(args: list[str], work: Path, run_id: str, env: dict, warmup: int, timeout: float) -> dict:
    """One swarm run: the trainer's samples/s and seconds in calls to each stage per timed batch, the stage peers'
    peak RSS, or how it failed. A run that trained although a process logged running out of memory (a request
    answered as overload) names it in ``oom_in``."""
    try:
        (history,), peak_rss = train_on_swarm(args, work, run_id, env, timeout=timeout)
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        result = failure(e, peer_logs(work / run_id))
        partial = work / f"{run_id}_trainer0.json"  # the history train_on_swarm has the trainer write, every 5 steps
        if result["status"] == "timed out" and partial.exists():
            history = json.loads(partial.read_text())
            if history["steps"] > warmup:  # what the batches it finished after warm-up show
                result.update(samples_per_s=steady_throughput(history, warmup - 1), batches=history["steps"])
        return result
    result = {
        "status": "ok",
        "samples_per_s": steady_throughput(history, warmup - 1),
        "batches": history["steps"],
        "call_seconds": steady_call_seconds(history, warmup - 1),
        "stage_peak_rss": peak_rss,
    }
    return {**result, "oom_in": oom_in} if (oom_in := out_of_memory(peer_logs(work / run_id))) else result


def peer_logs(directory: Path) -> dict[str, str]:
    """What each peer of a LocalSwarm printed, by peer name."""
    return {path.stem: path.read_text(errors="replace") for path in sorted(directory.glob("*.log"))}


def run(settings: dict, run_args: list[str], work: Path, warmup: int, timeout: float, env: dict) -> dict:
    """Measure one configuration (``settings``: the ``KEY`` fields; ``env``: the swarm's settings) with its peak
    memory per process."""
    memory_dir = work / f"memory_{len(list(work.glob('memory_*')))}"
    memory_dir.mkdir()
    os.environ["GPT_CUDA_MEMORY_DIR"] = str(memory_dir)
    run_args = [*run_args, "--precision", settings["precision"]]
    run_id = f"gpu{settings['d_model']}_{memory_dir.name}"
    start = time.time()
    with GpuMemoryPoller() as poller:
        if settings["kind"] == "plain":
            result = measure_plain(run_args, work, warmup, timeout)
        else:
            result = measure_swarm(run_args, work, run_id, env, warmup, timeout)
    figures = {**settings, **result, "seconds": time.time() - start, "memory": process_memory(memory_dir, poller)}
    figures.update(date=time.strftime("%Y-%m-%d %H:%M"), commit=commit())
    print(
        f"{settings['device']} | d_model {settings['d_model']} | {settings['precision']} | {settings['kind']}"
        + (f", {settings['updates']} updates" if settings["updates"] else "")
        + f" | {result['status']}: "
        + (f"{result['samples_per_s']:.2f} samples/s" if result["status"] == "ok" else result["error"][-300:])
        + (f" (out of memory in the logs of {', '.join(result['oom_in'])})" if result.get("oom_in") else "")
        + f" ({figures['seconds']:.0f} s)",
        flush=True,
    )
    return figures


def merge(runs: list[dict], new: list[dict]) -> list[dict]:
    """``runs`` with ``new`` added, each replacing an earlier run of the same configuration."""
    merged = {tuple(r.get(k) for k in KEY): r for r in runs}
    merged.update({tuple(r.get(k) for k in KEY): r for r in new})
    return list(merged.values())


def save(new: list[dict], out: Path) -> None:
    """Merge ``new`` runs into ``results/gpu.json`` beside ``out`` and rewrite the ``gpu`` section of ``out``."""
    data = out.parent / "results" / "gpu.json"
    runs = json.loads(data.read_text())["runs"] if data.exists() else []
    runs = merge(runs, new)
    data.parent.mkdir(exist_ok=True)
    data.with_suffix(".tmp").write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    data.with_suffix(".tmp").replace(data)  # whole, even if a signal stops the benchmark here
    write(runs, out)


def mib(figure: Optional[int]) -> str:
    return "n/a" if figure is None else f"{figure / MIB:.0f}"


def memory_cell(run: Optional[dict], name: str) -> str:
    """``reserved (allocated) / nvidia-smi`` MiB of one process of a run."""
    if run is None:
        return "-"
    m = run["memory"].get(name)
    if m is None:
        return "n/a"
    return f"{mib(m.get('reserved'))} ({mib(m.get('allocated'))}) / {mib(m.get('nvidia_smi'))}"


def speed_cell(run: Optional[dict]) -> str:
    if run is None:
        return "-"
    oom = f" ({', '.join(run['oom_in'])})" if run.get("oom_in") else ""
    if run["status"] == "timed out" and "samples_per_s" in run:
        return f"timed out ({run['samples_per_s']:.2f} over {run['batches']} batches)"
    if run["status"] != "ok":
        return run["status"] + oom
    return f"{run['samples_per_s']:.2f}" + (f", out of memory in the logs{oom}" if oom else "")


def write(runs: list[dict], path: Path) -> None:
    """The ``gpu`` section of the results file, from every run measured so far."""
    groups: dict[tuple, dict] = {}
    for r in runs:
        group = groups.setdefault(tuple(r[k] for k in KEY[:6]), {"plain": None, "swarm": {}})
        if r["kind"] == "plain":
            group["plain"] = r
        else:
            group["swarm"][(r["updates"], r["microbatches"])] = r
    speed_rows, memory_rows = [], []
    for (device, d_model, n_layer, batch, block, precision), group in sorted(groups.items(), key=lambda g: g[0]):
        reference = group["plain"]
        modes = sorted(group["swarm"].items(), key=lambda m: (m[0][0] != "synchronous", str(m[0][1])))
        for (updates, microbatches), swarm in modes or [(("-", None), None)]:
            shape = f"{n_layer} blocks, {batch}x{block}"
            label = [device, str(d_model), shape, precision, updates + (f", {microbatches} mb" if microbatches else "")]
            ok = swarm and reference and swarm["status"] == reference["status"] == "ok"
            ratio = f"{swarm['samples_per_s'] / reference['samples_per_s']:.3f}" if ok else "-"
            calls = " / ".join(f"{s:.3f}" for s in swarm["call_seconds"]) if swarm and "call_seconds" in swarm else "-"
            speed_rows.append([*label, speed_cell(reference), speed_cell(swarm), ratio, calls])
            stage_peak = [
                swarm["memory"].get(f"stage {k}", {}).get("reserved") if swarm else None for k in range(STAGES)
            ]
            plain_peak = reference["memory"].get("plain", {}).get("reserved") if reference else None
            share = f"{max(stage_peak) / plain_peak:.2f}" if None not in stage_peak and plain_peak else "-"
            memory_rows.append(
                [*label, memory_cell(reference, "plain"), memory_cell(swarm, "trainer")]
                + [memory_cell(swarm, f"stage {k}") for k in range(STAGES)]
                + [share, mib(swarm["memory"]["total"]["nvidia_smi"]) if swarm else "-"]
            )
    lines = [
        "## GPU: plain training against the 2-stage swarm on one GPU",
        "",
        "`python benchmarks/gpu.py` (see its docstring): examples/gpt.py with 8 blocks, 64 dimensions per head, "
        "batch 8 x 512 tokens (`--device cpu`: d_model 64, 2 blocks, batch 4 x 32); plain training "
        "(`gpt.py --single`) against one serve-only peer per stage and one drive-only trainer, all on the same GPU; "
        "8-bit wire, an optimizer step every batch; precision through `gpt.py --precision`; samples/s over "
        "timed batches after warm-up ones.",
        "",
        "Targets (issue 14): swarm / plain >= 0.8 at d_model 2048 and >= 0.5 at d_model 1024, in `32-true` and "
        "`bf16-mixed`; each stage peer's peak GPU memory <= 0.6 of plain training's peak; d_model 4096 runs "
        "wherever plain training of it fits.",
        "",
    ]
    if not any(r["device"] != "cpu" for r in runs):
        lines += ["**To be measured on a lent GPU** (no GPU figures yet).", "", *how_to_run(), ""]
    if runs:
        lines += [
            "### Samples/s",
            "",
            "Last column: the trainer's seconds in calls to each stage per timed batch.",
            "",
            *table(
                ["device", "d_model", "model", "precision", "updates", "plain", "swarm", "swarm / plain", "calls (s)"],
                speed_rows,
            ),
            "",
            "### Peak GPU memory (MiB)",
            "",
            "Each process: torch's max_memory_reserved (max_memory_allocated), as the process reported it, / the "
            "most nvidia-smi showed for its pid. Stage / plain: the larger stage peer's reserved memory over plain "
            "training's. Last column: the most nvidia-smi showed for all processes at once.",
            "",
            *table(
                ["device", "d_model", "model", "precision", "updates", "plain", "trainer"]
                + [f"stage {k} peer" for k in range(STAGES)]
                + ["stage / plain", "all (nvidia-smi)"],
                memory_rows,
            ),
        ]
    update_section("gpu", lines, path)


def how_to_run() -> list[str]:
    """The lines of this module's docstring on running it on a lent GPU (one text for both places)."""
    return __doc__[__doc__.index("On a lent GPU") : __doc__.index("Without CUDA, `--smoke`")].strip().splitlines()


def commit() -> Optional[str]:
    """The commit of the code measured, where this checkout has its git history."""
    command = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cuda_device() -> Optional[str]:
    """The GPU's name, or None without CUDA (this process does not start CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    command = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"]
    try:
        name = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        name = ""
    return name or "cuda"


def stop_on_signal(signum: int, frame: object) -> None:
    """SIGTERM (e.g. from ``timeout``): unwind, so that every swarm's peers are stopped by their process groups."""
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main() -> None:
    parser = script_parser(__doc__, "a tiny model on the GPU; skips (exit 0) without CUDA")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a tiny model, to test")
    parser.add_argument("--d-model", type=int, nargs="+", help="default: 1024 2048 4096 (cpu, smoke: 64)")
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--updates", nargs="+", choices=["synchronous", "delayed"], default=["synchronous", "delayed"])
    parser.add_argument("--no-plain", action="store_true", help="only the swarm (plain measured in an earlier run)")
    parser.add_argument("--microbatches", type=int, help="microbatches in flight (default: the strategy's)")
    parser.add_argument("--warmup", type=int, help="batches before the timed ones (default 5; cpu, smoke: 2)")
    parser.add_argument("--batches", type=int, help="timed batches (default 20; cpu, smoke: 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--out", default=str(RESULTS), help="results file; the JSON goes to results/ beside it")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="only merge these results/gpu.json into --out's")
    a = parser.parse_args()
    out = Path(a.out)
    if a.merge:
        save([r for path in a.merge for r in json.loads(Path(path).read_text())["runs"]], out)
        return

    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # for this process and every one it starts
        device = "cpu"
    elif (device := cuda_device()) is None:
        if a.smoke:
            print("gpu benchmark skipped: no CUDA device (--device cpu runs it on the CPU)")
            return
        parser.error("no CUDA device: run it where there is one, or test it with --device cpu")
    tiny = a.smoke or a.device == "cpu"
    sizes = a.d_model or ([64] if tiny else [1024, 2048, 4096])
    n_layer, batch, block = (2, 4, 32) if tiny else (8, 8, 512)
    warmup = max(1, a.warmup or (2 if tiny else 5))
    batches = a.batches or (3 if tiny else 20)
    precisions, updates = (["32-true"], ["synchronous"]) if a.smoke else (a.precision, a.updates)
    env = {"SWARM_MICROBATCHES": str(a.microbatches)} if a.microbatches else {}

    signal.signal(signal.SIGTERM, stop_on_signal)
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as tmp:
        for d_model in sizes:
            run_args = model_args(d_model, warmup + batches, batch, block, n_layer)
            for precision in precisions:
                settings = dict(device=device, d_model=d_model, n_layer=n_layer, batch=batch, block=block)
                settings.update(precision=precision)
                if not a.no_plain:
                    plain_settings = {**settings, "kind": "plain", "updates": None, "microbatches": None}
                    save([run(plain_settings, run_args, Path(tmp), warmup, a.timeout, {})], out)
                for mode in updates:
                    swarm_env = {**env, "SWARM_DELAYED_UPDATES": str(mode == "delayed")}
                    swarm_settings = {**settings, "kind": "swarm", "updates": mode, "microbatches": a.microbatches}
                    save([run(swarm_settings, run_args, Path(tmp), warmup, a.timeout, swarm_env)], out)


if __name__ == "__main__":
    main()
