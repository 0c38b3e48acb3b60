"""Plain training on one GPU against the 2-stage swarm on the same GPU: samples/s, their ratio, the swarm's loss
against plain training's, and each process's peak GPU memory.

examples/gpt.py's model with 8 blocks, d_model 2048 and 1024 (or `--d-model`, 64 dimensions per head), batch 8 x 512
tokens. Plain: `gpt.py --single` on the GPU, warm-up batches then timed ones. Swarm: one serve-only peer per stage
and one drive-only trainer, all on the same GPU, so plain training is the ceiling (the same GPU does the same
compute); 8-bit wire, synchronous or delayed stage updates, one swarm per target batch size (`--targets`: `batch`,
a step every batch, and 128, a step every 16 batches) and `overlap_batches` setting (`--overlap`: on, the default,
and off: "backward not trailing"). Each swarm's trainer runs phases one after the other, side by side in one run:
each of `--microbatches` (4, 8 and "auto"), its warm-up batches (a fixed count gets `--warmup`, the first phase one
more for the connections; "auto" trains until its tuning settled, within `--max-warmup`), then
its timed batches (`--batches`, at least one optimizer step's worth). Samples/s over a phase's timed batches, from
the trainer's own batch end times; a phase whose tuning did not settle within `--max-warmup` says so. Loss: the
largest difference per batch between the swarm's loss and plain training's, over the batches both trained (a swarm
that steps every batch with synchronous updates; the microbatch count does not change the loss).
Precision through `gpt.py --precision` (`32-true`, `bf16-mixed`). Peak GPU memory per process (of the whole swarm,
all phases): torch's `max_memory_reserved` and `max_memory_allocated` as the process reports them itself
(examples/gpt.py's `report_cuda_memory`, through `GPT_CUDA_MEMORY_DIR`), and the most `nvidia-smi
--query-compute-apps` showed for its pid, polled every 0.5 s. A run that runs out of memory (plain, or any swarm
process) is reported as "out of memory" with the processes whose logs say so; any other failure or a run past its
time (with the samples/s of the phases it finished) is reported too, and the benchmark goes on with the next run.
`--budget` bounds the whole command: a run trains at most `--timeout` seconds (a swarm: once its peers joined) and
never past the budget, and a run that cannot start in time is reported as "skipped (budget)". Runs go in order of
priority: every configuration at the first target, then at the next. Every run's peers are stopped by their process
groups before the next one starts, also on an error or SIGTERM. Figures are merged into `results/gpu.json` beside
`--out` (a run replaces the earlier figures of the same configuration; a swarm's ratio stays the one to its own
command's plain run), and the `gpu` section of `--out` is rewritten from all of them. `--trace` records what each
swarm's processes do on a shared timeline (benchmarks/emulated_device.py's records, host clocks only: 3 us a record on
the 2-core development machine, 6-8 records a request) and splits each phase's requests into parts, per stage and kind,
with the steps (`trace_figures`): printed under the phase's line and kept in its figures. `--calibrate` measures one
stage's (4 blocks) forward and backward per sample on the GPU instead, the figures benchmarks/gpu_proxy.py is calibrated
with, into `results/gpu_calibration.json` beside `--out`.

Targets (issue 25): swarm/plain >= 0.8 at d_model 2048 and >= 0.5 at d_model 1024, in 32-true and bf16-mixed; each
stage peer's peak GPU memory <= 0.6 of plain training's whole-model peak; the swarm's loss within 0.01 of plain
training's at every batch.

On a lent GPU (see ../shared/gpu/README.md): `benchmarks/run_on_gpu.sh $OUT` takes every GPU figure in one command
of at most 9 minutes (this benchmark within its share, `--budget`), the wheels carried in `.whl/`. Then, here:
`python benchmarks/gpu.py --merge <files_at>/results/gpu.json` (into benchmarks/results/gpu.json and the gpu section
of benchmarks/RESULTS.md). `--d-model 4096` runs wherever plain training of it fits (each stage peer holds 0.8B
parameters, ~13 GB of fp32 weights, gradients and Adam state), one precision per command.

Without CUDA, `--smoke` prints that it skipped and exits 0; `--device cpu` runs the whole harness on the CPU with a
tiny model (d_model 64, 2 blocks, batch 4 x 32; 2 and "auto" microbatches, 1 warm-up and 2 timed batches), as
tests/swarm/test_benchmarks_gpu.py does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import emulated_device as emu  # noqa: E402
from harness import (  # noqa: E402
    ONE_THREAD,
    STAGES,
    SWARM,
    model_args,
    peak_rss,
    plain,
    script_parser,
    steady_throughput,
)
from report import RESULTS, table, update_section  # noqa: E402

from lightning_swarm.launch import LocalSwarm  # noqa: E402

OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|out of memory", re.IGNORECASE)
MIB = 2**20
# the configuration that makes one run; a run replaces the earlier entry with the same values ("overlap": a swarm's
# overlap_batches, on in the runs from before it was a setting here, as it is by default)
KEY = ("device", "d_model", "n_layer", "batch", "block", "precision", "kind", "updates", "target", "microbatches")
KEY += ("overlap",)
NOT_TRAILING = "backward not trailing"  # how a swarm run with overlap_batches off is labelled
Microbatches = Union[int, str]
SKIPPED = "skipped (budget)"  # the status of a run the budget left no time for


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
    timed_out = isinstance(error, (subprocess.TimeoutExpired, TimeoutError))
    status = "out of memory" if oom_in else "timed out" if timed_out else "failed"
    details = error.stderr if isinstance(error, subprocess.CalledProcessError) else None
    text = details.decode(errors="replace") if details else str(error)
    return {"status": status, "error": text.strip()[-1500:], **({"oom_in": oom_in} if oom_in else {})}


def peer_logs(directory: Path) -> dict[str, str]:
    """What each peer of a LocalSwarm printed, by peer name."""
    return {path.stem: path.read_text(errors="replace") for path in sorted(directory.glob("*.log"))}


# ---- the swarm's peers --------------------------------------------------------------------------------------------


def peer_main(argv: list[str]) -> None:
    """``--peer``: one peer of a benchmark swarm, examples/gpt.py's model and data as ``gpt.py`` trains them; the
    trainer (``SWARM_ROLE=drive``) runs ``--phases`` and writes each batch's figures to ``--record``."""
    import lightning as L
    import torch
    from gpt import GPT, CharDataModule, report_cuda_memory

    import lightning_swarm  # noqa: F401  (registers strategy="swarm")

    parser = argparse.ArgumentParser()
    for name, default in (("max-steps", 200), ("batch-size", 16), ("block-size", 64), ("d-model", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--phases", default="[]", help="JSON: the trainer's phases (see PhaseControl)")
    parser.add_argument("--record", help="the trainer's figures per batch (JSON)")
    a = parser.parse_args(argv)
    role = os.environ.get("SWARM_ROLE", "both")
    if timeline := os.environ.get("GPU_TRACE_TIMELINE"):  # --trace: what the swarm does, on a shared timeline
        emu.instrument(emu.HostRecorder(emu.Timeline(timeline), int(os.environ["GPU_TRACE_PROC"])))
    if directory := os.environ.get("GPT_CUDA_MEMORY_DIR"):
        report_cuda_memory(directory, role)
    torch.set_num_threads(1)
    L.seed_everything(0)
    data = CharDataModule(block_size=a.block_size, batch_size=a.batch_size, seed=0)
    model = GPT(data.vocab_size, a.block_size, a.d_model, a.n_layer, a.n_head)
    trainer = L.Trainer(
        strategy="swarm",
        accelerator="auto",
        precision=a.precision,
        max_steps=a.max_steps,
        callbacks=[phase_control(json.loads(a.phases), a.record)] if role == "drive" else [],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
    )
    trainer.fit(model, data)


def phase_control(phases: list[dict], path: Optional[str]) -> Any:
    """The trainer's callback that runs ``phases`` (lightning is imported in the peers only)."""
    import lightning as L

    from lightning_swarm.client.microbatch_tuning import SETTLING_BATCHES, MicrobatchTuner

    class PhaseControl(L.Callback):
        """The phases, one after the other: each ``{"microbatches": 4 or "auto", "warmup": n, "max_warmup": n,
        "batches": n}`` sets the remote pipeline's microbatches (a fresh tuner), trains its warm-up batches ("auto":
        also until its tuning settled and ``SETTLING_BATCHES`` batches used the count it settled on, within
        ``max_warmup``: a change of count unsettles the pipeline), then its timed batches. After each batch it rewrites
        ``path`` with every batch's figures so far, so that a run stopped on time keeps them: its phase, whether it
        was timed, the microbatch count it used, the count "auto" settled on (None while tuning), its end
        (``time.time``), its loss, and the trainer's seconds in calls to each stage so far. After the last phase
        training stops."""

        def __init__(self) -> None:
            self.index = self.warm = self.timed = self.count = self.at_settled = 0
            self.warmed = self.current_timed = False
            self.records: list[dict] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            remote = trainer.strategy._remote
            if self.warm == 0 and self.timed == 0:  # a phase begins
                remote.tuner = MicrobatchTuner(phases[self.index]["microbatches"], remote.num_stages)
            self.count = remote.tuner.count(len(batch[0]))  # what this batch's pipeline uses
            self.current_timed = self.warmed

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            phase, tuner = phases[self.index], trainer.strategy._remote.tuner
            settled = tuner.settled(len(batch[0])) if phase["microbatches"] == "auto" else self.count
            calls = {str(k): v for k, v in trainer.strategy.router_stats.seconds.items()}
            self.records.append(
                dict(phase=self.index, timed=self.current_timed, count=self.count, settled=settled, end=time.time())
            )
            self.records[-1].update(monotonic=time.monotonic())  # the clock of --trace's timeline
            self.records[-1].update(loss=float(outputs["loss"]), calls=calls)
            if path:
                with open(path + ".tmp", "w") as f:
                    json.dump(self.records, f)
                os.replace(path + ".tmp", path)
            if not self.current_timed:
                self.warm += 1
                self.at_settled = self.at_settled + 1 if settled is not None and self.count == settled else 0
                ready = phase["microbatches"] != "auto" or self.at_settled >= SETTLING_BATCHES
                limit = self.warm >= phase.get("max_warmup", phase["warmup"])
                self.warmed = self.warm >= phase["warmup"] and (ready or limit)
                return
            self.timed += 1
            if self.timed >= phase["batches"]:
                self.index, self.warm, self.timed, self.warmed, self.at_settled = self.index + 1, 0, 0, False, 0
                trainer.should_stop = self.index == len(phases)

    return PhaseControl()


# ---- measuring ---------------------------------------------------------------------------------------------------


def measure_plain(args: list[str], work: Path, warmup: int, timeout: float) -> dict:
    """One plain training run: samples/s over the timed batches and the loss of every batch, or how it failed."""
    try:
        history = plain(args, work, timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return failure(e, {"plain": (e.stderr or b"").decode(errors="replace")})
    return {
        "status": "ok",
        "samples_per_s": steady_throughput(history, warmup - 1),
        "batches": history["steps"] - warmup,
        "losses": history["losses"],
    }


def phase_figures(records: list[dict], phases: list[dict], batch: int, traced: Any = None) -> list[dict]:
    """Each phase's figures from the trainer's records: samples/s over its timed batches (from the end of its last
    warm-up batch to the end of its last timed one), the trainer's seconds in calls to each stage per timed batch,
    its warm-up batches, the counts its timed batches used and, for "auto", the count it settled on (None: it had
    not settled within its ``max_warmup``); with ``traced`` (``--trace``'s timeline records), the timed batches'
    ``trace_figures``. A phase without timed batches has none of the figures."""
    figures = []
    for index, phase in enumerate(phases):
        rows = [r for r in records if r["phase"] == index]
        warm, timed = [r for r in rows if not r["timed"]], [r for r in rows if r["timed"]]
        entry: dict = {"warmup": len(warm), "batches": len(timed)}
        if phase["microbatches"] == "auto" and rows:
            entry["settled"] = rows[-1]["settled"]
        if warm and timed:
            seconds = timed[-1]["end"] - warm[-1]["end"]
            calls = [timed[-1]["calls"].get(str(k), 0) - warm[-1]["calls"].get(str(k), 0) for k in range(STAGES)]
            entry.update(samples_per_s=len(timed) * batch / seconds, call_seconds=[c / len(timed) for c in calls])
            entry["counts"] = sorted({r["count"] for r in timed})
            if traced is not None:
                entry["trace"] = trace_figures(traced, warm[-1]["monotonic"], timed[-1]["monotonic"])
        figures.append(entry)
    return figures


TRACE_PARTS = (
    "transfer",  # a call's start (trainer or handing stage) -> the stage server has the request
    "decode",  # -> queued for the worker (host copy, host-to-device copy, dequantize, checks)
    "queue",  # -> the worker took it
    "serve",  # -> the worker handed it back (launches; the device is waited for only where the code must)
    "reply",  # -> the reply left the handler (encode, and for a chained request the hand-on to the next stage)
)


def trace_figures(records: Any, start: float, end: float) -> dict:
    """``--trace``: a phase's requests from its timed batches' records (``start``, ``end``: ``time.monotonic``),
    ms, median per stage and request kind for each of ``TRACE_PARTS``, with the request count; and the stages' and
    trainer's optimizer steps (``step``: median ms and count)."""
    inside = records[(records["t0"] >= start) & (records["t0"] <= end)]

    def by_key(kind: int, proc_field: str) -> dict:
        rows = inside[inside["kind"] == kind]
        return {(int(x[proc_field]), int(x["key"]), int(x["extra"])): x for x in rows if int(x["key"])}

    calls = by_key(emu.CALL, "value")  # keyed by the stage called
    arrive, submit, serve, answer = (by_key(k, "proc") for k in (emu.ARRIVE, emu.SUBMIT, emu.SERVE, emu.ANSWER))
    # a backward's worker answers when it hands the gradients over (an optimizer step may follow)
    handovers = {(int(x["proc"]), int(x["key"])): float(x["t0"]) for x in inside[inside["kind"] == emu.HANDOVER]}
    figures: dict = {}
    for (stage, key, code), a in arrive.items():
        call, queued, served, ending = (found.get((stage, key, code)) for found in (calls, submit, serve, answer))
        if any(x is None for x in (call, queued, served, ending)):
            continue
        answered = handovers.get((stage, key), float(served["t1"])) if code == 2 else float(served["t1"])
        answered = min(answered, float(ending["t1"]))  # its worker may go on after handing the result back
        times = [float(call["t0"]), float(a["t0"]), float(queued["t0"]), float(served["t0"]), answered]
        times.append(float(ending["t1"]))
        name = f"stage {stage} {'forward' if code == 1 else 'backward'}"
        entry = figures.setdefault(name, {p: [] for p in TRACE_PARTS})
        for part, t0, t1 in zip(TRACE_PARTS, times, times[1:]):
            entry[part].append(1000 * (t1 - t0))
    out = {
        name: {"count": len(parts["transfer"]), **{p: statistics.median(v) for p, v in parts.items()}}
        for name, parts in sorted(figures.items())
    }
    for proc, name in [*((k, f"stage {k} step") for k in range(STAGES)), (emu.TRAINER, "trainer step")]:
        since, until = (start, end) if proc == emu.TRAINER else served_span(records, proc, start, end)
        steps = records[(records["kind"] == emu.STEP) & (records["proc"] == proc)]
        steps = steps[(steps["t0"] >= since) & (steps["t0"] <= until)]
        if len(steps):
            out[name] = {"count": len(steps), "step": 1000 * statistics.median(steps["t1"] - steps["t0"])}
    return out


def served_span(records: Any, proc: int, start: float, end: float) -> tuple[float, float]:
    """The span of a stage's timed steps: a stage steps after handing its last gradients over, so maybe after the
    trainer's batch began or ended; its timed steps are those from its first request served at ``start`` or later to
    its first one after ``end``."""
    served = records[(records["kind"] == emu.SERVE) & (records["proc"] == proc)]["t0"]
    first, after = served[served >= start], served[served > end]
    return (first.min() if len(first) else start), (after.min() if len(after) else float("inf"))


def loss_gap(swarm: list[float], reference: list[float]) -> Optional[float]:
    """The largest difference between two loss curves over the batches both have (None: none in common)."""
    common = list(zip(swarm, reference))
    return max(abs(a - b) for a, b in common) if common else None


def run_swarm(
    args: list[str], work: Path, run_id: str, env: dict, phases: list[dict], timeout: float, deadline: float
) -> tuple[list[dict], dict, Optional[BaseException]]:
    """Train on a 2-stage swarm (``SWARM`` and ``env``): one serve-only peer per stage, then a drive-only trainer
    that runs ``phases``, started together (within 120 s), and given ``timeout`` seconds once they joined; neither
    past ``deadline`` (``time.monotonic``). Returns the trainer's records per batch (those it wrote before a failure
    or the timeout included), each stage peer's peak RSS (None for a peer that had exited) and the error, if any."""
    record = work / f"{run_id}.records.json"
    rss: dict = {}
    error: Optional[BaseException] = None
    trainer_args = [*args, "--phases", json.dumps(phases), "--record", str(record)]
    peers = {f"stage{k}": (args, {"SWARM_ROLE": "serve", "SWARM_STAGE": str(k)}) for k in range(STAGES)}
    peers["trainer"] = (trainer_args, {"SWARM_ROLE": "drive"})
    if os.environ.get("GPU_TRACE"):
        timeline = work / f"{run_id}.timeline"
        emu.Timeline.create(timeline)
        env = {**env, "GPU_TRACE_TIMELINE": str(timeline)}
        for proc, (_, peer_env) in zip([*range(STAGES), emu.TRAINER], peers.values()):
            peer_env["GPU_TRACE_PROC"] = str(proc)
    try:
        with LocalSwarm(
            [__file__, "--peer"], work / run_id, run_id=run_id, env={**ONE_THREAD, **SWARM, **env}
        ) as local:
            local.start_together(peers, wait=max(1.0, min(120.0, deadline - time.monotonic())))
            code = local.wait("trainer", timeout=max(1.0, min(timeout, deadline - time.monotonic())))
            rss = {f"stage {k}": peak_rss(local.peers[f"stage{k}"].process.pid) for k in range(STAGES)}
            if code != 0:
                logs = "".join(f"\n---- {peer.name}:\n{peer.log()[-2000:]}" for peer in local.peers.values())
                raise RuntimeError(f"the trainer of {run_id} exited with {code}; the peers' logs end with:{logs}")
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        error = e
    records = json.loads(record.read_text()) if record.exists() else []
    return records, rss, error


def measure_swarm(
    args: list[str], work: Path, run_id: str, env: dict, phases: list[dict], batch: int, timeout: float, deadline: float
) -> list[dict]:
    """One swarm's figures per phase (see ``phase_figures``), with the run's status: "ok", or for a failed run the
    phases it finished ("ok") and how the others failed (the trainer's loss per batch in the first phase's)."""
    records, rss, error = run_swarm(args, work, run_id, env, phases, timeout, deadline)
    failed = failure(error, peer_logs(work / run_id)) if error is not None else None
    oom_in = out_of_memory(peer_logs(work / run_id))
    results = []
    timeline = work / f"{run_id}.timeline"  # --trace
    traced = emu.Timeline(timeline).records() if timeline.exists() else None
    for phase, figures in zip(phases, phase_figures(records, phases, batch, traced)):
        finished = "samples_per_s" in figures and figures["batches"] >= phase["batches"]
        status = {"status": "ok"} if finished else failed or {"status": "failed", "error": "no timed batches"}
        results.append({**figures, **status, "stage_peak_rss": rss, **({"oom_in": oom_in} if oom_in else {})})
    results[0]["losses"] = [r["loss"] for r in records]
    return results


def run(
    settings: dict, run_args: list[str], work: Path, warmup: int, phases: list[dict], timeout: float, deadline: float
) -> list:
    """Measure one configuration (``settings``: the ``KEY`` fields but the microbatches; for a swarm, one run per
    phase) with its peak memory per process: ``timeout`` seconds of training at most, never past ``deadline``."""
    memory_dir = work / f"memory_{len(list(work.glob('memory_*')))}"
    memory_dir.mkdir()
    os.environ["GPT_CUDA_MEMORY_DIR"] = str(memory_dir)
    run_args = [*run_args, "--precision", settings["precision"]]
    start = time.time()
    with GpuMemoryPoller() as poller:
        if settings["kind"] == "plain":
            timeout = min(timeout, deadline - time.monotonic())
            results = [{**measure_plain(run_args, work, warmup, timeout), "microbatches": None}]
        else:
            env = {"SWARM_DELAYED_UPDATES": str(settings["updates"] == "delayed")}
            env["SWARM_OVERLAP_BATCHES"] = str(settings["overlap"])
            env["SWARM_TARGET_BATCH_SIZE"] = str(settings["target"])
            run_id = f"gpu{settings['d_model']}_{memory_dir.name}"
            phase_results = measure_swarm(run_args, work, run_id, env, phases, settings["batch"], timeout, deadline)
            swarm = f"{run_id} {time.strftime('%Y-%m-%d %H:%M:%S')}"  # its phases' losses are in the first one's
            results = [{**r, "microbatches": p["microbatches"], "swarm": swarm} for p, r in zip(phases, phase_results)]
    seconds, memory = time.time() - start, process_memory(memory_dir, poller)
    extra = dict(seconds=seconds, memory=memory, date=time.strftime("%Y-%m-%d %H:%M"), commit=commit())
    runs = [{**settings, **r, **extra} for r in results]
    for r in runs:
        print(describe(r), flush=True)
        for name, parts in r.get("trace", {}).items():  # --trace
            print(f"    {name}: " + ", ".join(f"{p} {v:.4g}" for p, v in parts.items()), flush=True)
    return runs


def describe(run: dict) -> str:
    """One line on a run, as it ends."""
    text = f"{run['device']} | d_model {run['d_model']} | {run['precision']} | {run['kind']}"
    if run["kind"] == "swarm":
        trailing = "" if run.get("overlap", True) else f", {NOT_TRAILING}"
        text += f", {run['updates']} updates{trailing}, target {run['target']}, {run['microbatches']} microbatches"
    text += f" | {run['status']}: "
    if run["status"] == "ok":
        text += f"{run['samples_per_s']:.2f} samples/s"
    else:
        text += run.get("error", "")[-300:]
    if run.get("oom_in"):
        text += f" (out of memory in the logs of {', '.join(run['oom_in'])})"
    return text + f" ({run['seconds']:.0f} s)"


def skipped(settings: dict, phases: list[dict]) -> list[dict]:
    """The runs of a configuration the budget left no time for."""
    microbatches = [None] if settings["kind"] == "plain" else [p["microbatches"] for p in phases]
    status = {"status": SKIPPED, "error": "no time left in --budget", "memory": {}}
    return [{**settings, **status, "microbatches": m} for m in microbatches]


def with_loss_gaps(runs: list[dict]) -> list[dict]:
    """``runs`` with each synchronous swarm run that steps every batch given ``loss_gap``: its swarm's loss curve
    (all its phases') against plain training's of the same configuration."""
    plains = {tuple(r[k] for k in KEY[:6]): r for r in runs if r["kind"] == "plain" and r.get("losses")}
    for r in runs:
        reference = plains.get(tuple(r[k] for k in KEY[:6]))
        swarm = r.get("swarm")  # which swarm ran it (none: a plain run, or a run the budget skipped)
        curve = next((s["losses"] for s in runs if s.get("losses") and swarm and s.get("swarm") == swarm), None)
        steps_every_batch = r["kind"] == "swarm" and r["updates"] == "synchronous" and r["target"] == r["batch"]
        if steps_every_batch and reference and curve:
            r["loss_gap"] = loss_gap(curve, reference["losses"])
    return runs


def configuration(run: dict) -> tuple:
    """The ``KEY`` fields of a run: a run replaces an earlier one of the same configuration."""
    return tuple(run.get(k, run["kind"] == "swarm" if k == "overlap" else None) for k in KEY)


def updates_label(run: dict) -> str:
    """A swarm's updates, and whether a batch's backward may trail the next batch's forward when it is not on."""
    return run["updates"] + ("" if run.get("overlap", True) else f", {NOT_TRAILING}")


def merge(runs: list[dict], new: list[dict]) -> list[dict]:
    """``runs`` with ``new`` added, each replacing an earlier run of the same configuration; a run the budget
    skipped replaces nothing (it is added only where the configuration has no figures yet)."""
    merged = {configuration(r): r for r in runs}
    for r in new:
        key = configuration(r)
        if key not in merged or r["status"] != SKIPPED:
            merged[key] = r
    return list(merged.values())


def save(new: list[dict], out: Path) -> None:
    """Merge ``new`` runs into ``results/gpu.json`` beside ``out`` and rewrite the ``gpu`` section of ``out``."""
    data = out.parent / "results" / "gpu.json"
    runs = json.loads(data.read_text())["runs"] if data.exists() else []
    runs = with_loss_gaps(merge(runs, new))
    data.parent.mkdir(parents=True, exist_ok=True)  # an --out in a folder not made yet (a lost run, 2026-11-27)
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


def microbatch_label(run: dict) -> str:
    """A swarm run's microbatches: the fixed count, or "auto" with the count it settled on (and its warm-up)."""
    if run["microbatches"] != "auto":
        return str(run["microbatches"])
    if run.get("settled") is None:
        return f"auto (not settled in {run.get('warmup', 0)} batches)"
    return f"auto ({run['settled']} after {run['warmup']} batches)"


def latest_measured_swarms(swarms: list[dict]) -> list[dict]:
    """One run per swarm configuration (updates, target, overlap), the latest with memory figures: its phases share
    one set of processes, so any of them gives the swarm's peaks."""
    latest: dict[tuple, dict] = {}
    for r in swarms:
        key = (r["updates"], r["target"], r.get("overlap", True))
        if r.get("memory") and (key not in latest or r["date"] > latest[key]["date"]):
            latest[key] = r
    chosen = {id(r) for r in latest.values()}
    return [r for r in swarms if id(r) in chosen]


def write(runs: list[dict], path: Path) -> None:
    """The ``gpu`` section of the results file, from every run measured so far."""
    groups: dict[tuple, dict] = {}
    for r in runs:
        group = groups.setdefault(tuple(r[k] for k in KEY[:6]), {"plain": None, "swarm": []})
        if r["kind"] == "plain":
            group["plain"] = r
        else:
            group["swarm"].append(r)
    speed_rows, memory_rows = [], []
    for (device, d_model, n_layer, batch, block, precision), group in sorted(groups.items(), key=lambda g: g[0]):
        reference = group["plain"]
        swarms = sorted(
            group["swarm"],
            key=lambda r: (
                r["updates"] != "synchronous",
                r["target"],
                not r.get("overlap", True),
                str(r["microbatches"]).zfill(4),
            ),
        )
        shape = f"{n_layer} blocks, {batch}x{block}"
        for swarm in swarms or [None]:
            label = [device, str(d_model), shape, precision]
            if swarm is None:
                label += ["-", "-", "-"]
            else:
                label += [updates_label(swarm), str(swarm["target"]), microbatch_label(swarm)]
            base = reference  # the plain run measured in the swarm's own command, if any: a ratio side by side
            if swarm and swarm.get("plain_samples_per_s") is not None:
                base = {"status": "ok", "samples_per_s": swarm["plain_samples_per_s"]}
            ok = swarm and base and swarm["status"] == base["status"] == "ok"
            ratio = f"{swarm['samples_per_s'] / base['samples_per_s']:.3f}" if ok else "-"
            calls = " / ".join(f"{s:.3f}" for s in swarm["call_seconds"]) if swarm and "call_seconds" in swarm else "-"
            gap = f"{swarm['loss_gap']:.4f}" if swarm and swarm.get("loss_gap") is not None else "-"
            speed_rows.append([*label, speed_cell(base), speed_cell(swarm), ratio, calls, gap])
        for swarm in latest_measured_swarms(swarms) or [None]:
            label = [device, str(d_model), shape, precision]
            label += [f"{updates_label(swarm)}, target {swarm['target']}" if swarm else "-"]
            memory = swarm["memory"] if swarm else {}
            stage_peak = [memory.get(f"stage {k}", {}).get("reserved") for k in range(STAGES)]
            plain_peak = reference["memory"].get("plain", {}).get("reserved") if reference else None
            share = f"{max(stage_peak) / plain_peak:.2f}" if None not in stage_peak and plain_peak else "-"
            memory_rows.append(
                [*label, memory_cell(reference, "plain"), memory_cell(swarm, "trainer")]
                + [memory_cell(swarm, f"stage {k}") for k in range(STAGES)]
                + [share, mib(memory.get("total", {}).get("nvidia_smi")) if swarm else "-"]
            )
    lines = [
        "## GPU: plain training against the 2-stage swarm on one GPU",
        "",
        "`python benchmarks/gpu.py` (see its docstring; all GPU figures: `benchmarks/run_on_gpu.sh`): examples/gpt.py "
        "with 8 blocks, 64 dimensions per head, batch 8 x 512 tokens (`--device cpu`: d_model 64, 2 blocks, batch "
        "4 x 32); plain training (`gpt.py --single`) against one serve-only peer per stage and one drive-only trainer, "
        "all on the same GPU; 8-bit wire; precision through `gpt.py --precision`; one swarm per target batch size, "
        'its microbatch settings run one after the other, each timed after its own warm-up ("auto": until its '
        "tuning settled).",
        "",
        "Targets (issue 25): swarm / plain >= 0.8 at d_model 2048 and >= 0.5 at d_model 1024, in `32-true` and "
        "`bf16-mixed`; each stage peer's peak GPU memory <= 0.6 of plain training's peak; the swarm's loss within "
        "0.01 of plain training's at every batch.",
        "",
    ]
    if not any(r["device"] != "cpu" for r in runs):
        lines += ["**To be measured on a lent GPU** (no GPU figures yet).", "", *how_to_run(), ""]
    if runs:
        lines += [
            "### Samples/s",
            "",
            "Calls: the trainer's seconds in calls to each stage per timed batch. Loss: the largest difference per "
            "batch from plain training's loss, over the batches both trained (a swarm stepping every batch, "
            "synchronous updates; all its phases).",
            "",
            *table(
                ["device", "d_model", "model", "precision", "updates", "target", "microbatches"]
                + ["plain", "swarm", "swarm / plain", "calls (s)", "loss"],
                speed_rows,
            ),
            "",
            "### Peak GPU memory (MiB)",
            "",
            "Each process, over a whole swarm (all its phases): torch's max_memory_reserved (max_memory_allocated), as "
            "the process reported it, / the most nvidia-smi showed for its pid. Stage / plain: the larger stage peer's "
            "reserved memory over plain training's. Last column: the most nvidia-smi showed for all processes at once.",
            "",
            *table(
                ["device", "d_model", "model", "precision", "swarm", "plain", "trainer"]
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


def calibrate(sizes: list[int], precisions: list[str], out: Path, n_layer: int = 8, batch: int = 8) -> None:
    """One stage's (``n_layer`` / 2 blocks of examples/gpt.py) forward and backward seconds per sample on the GPU,
    batch ``batch`` x 512 tokens, timed with CUDA events (median of 10 after 3 warm-up passes), per d_model and
    precision ("bf16-mixed": under autocast): the figures benchmarks/gpu_proxy.py's calibration takes from the H100,
    into ``results/gpu_calibration.json`` beside ``out``."""
    import torch
    from gpt import Block

    figures = []
    for d_model in sizes:
        stage = torch.nn.Sequential(*(Block(d_model, d_model // 64) for _ in range(n_layer // STAGES))).cuda()
        x = torch.randn(batch, 512, d_model, device="cuda", requires_grad=True)
        for precision in precisions:
            autocast = torch.autocast("cuda", torch.bfloat16, enabled=precision.startswith("bf16"))
            times: dict[str, list[float]] = {"forward": [], "backward": []}
            for i in range(13):
                events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                events[0].record()
                with autocast:
                    y = stage(x)
                events[1].record()
                torch.autograd.grad(y.float().sum(), [x, *stage.parameters()])
                events[2].record()
                torch.cuda.synchronize()
                if i >= 3:
                    times["forward"].append(events[0].elapsed_time(events[1]) / 1e3 / batch)
                    times["backward"].append(events[1].elapsed_time(events[2]) / 1e3 / batch)
            entry = {"device": cuda_device(), "d_model": d_model, "precision": precision, "blocks": len(stage)}
            entry.update({kind: sorted(t)[len(t) // 2] for kind, t in times.items()})
            figures.append(entry)
            print(
                f"d_model {d_model} {precision}: one stage per sample, forward {1e3 * entry['forward']:.3f} ms, "
                f"backward {1e3 * entry['backward']:.3f} ms",
                flush=True,
            )
        del stage, x
        torch.cuda.empty_cache()
    data = out.parent / "results" / "gpu_calibration.json"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit(), "stages": figures}))


def stop_on_signal(signum: int, frame: object) -> None:
    """SIGTERM (e.g. from ``timeout``): unwind, so that every swarm's peers are stopped by their process groups."""
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def microbatches(value: str) -> Microbatches:
    """A ``--microbatches`` value: a count, or "auto"."""
    return "auto" if value == "auto" else int(value)


def plan(a: argparse.Namespace, device: str) -> list[tuple[dict, list[dict]]]:
    """The runs, in order of priority (every configuration at the first target, then the next): each run's settings
    and, for a swarm, its phases."""
    tiny = a.smoke or a.device == "cpu"
    n_layer, batch, block = (2, 4, 32) if tiny else (8, 8, 512)
    warmup = max(1, a.warmup or (1 if tiny else 2))
    runs = []
    targets = a.targets or (["batch"] if tiny else ["batch", "128"])
    for t, target in enumerate(batch if value == "batch" else int(value) for value in targets):
        timed = max(a.batches or (2 if tiny else 5), math.ceil(target / batch))  # an optimizer step's worth at least
        phases = [{"microbatches": m, "warmup": warmup, "max_warmup": a.max_warmup, "batches": timed} for m in a.mb]
        phases[0]["warmup"] += 1  # the first batches open the connections
        for d_model in a.d_model or ([64] if tiny else [2048, 1024]):
            for precision in ["32-true"] if a.smoke else a.precision:
                settings = dict(device=device, d_model=d_model, n_layer=n_layer, batch=batch, block=block)
                settings.update(precision=precision)
                if t == 0 and not a.no_plain:
                    runs.append(({**settings, "kind": "plain", "updates": None, "target": None}, []))
                for mode in ["synchronous"] if a.smoke else a.updates:
                    for overlap in ["on"] if a.smoke else a.overlap:
                        swarm = dict(kind="swarm", updates=mode, target=target, overlap=overlap == "on")
                        runs.append(({**settings, **swarm}, phases))
    return runs


def main() -> None:
    parser = script_parser(__doc__, "a tiny model on the GPU; skips (exit 0) without CUDA")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a tiny model, to test")
    parser.add_argument("--d-model", type=int, nargs="+", help="default: 2048 1024 (cpu, smoke: 64)")
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--updates", nargs="+", choices=["synchronous", "delayed"], default=["synchronous"])
    parser.add_argument(
        "--overlap", nargs="+", choices=["on", "off"], default=["on"], help="the swarm's overlap_batches (on: default)"
    )
    parser.add_argument(
        "--targets", nargs="+", help='target batch sizes, "batch": one (default: batch 128; cpu: batch)'
    )
    parser.add_argument(
        "--microbatches", dest="mb", type=microbatches, nargs="+", help='the phases: counts or "auto" (4 8 auto)'
    )
    parser.add_argument("--no-plain", action="store_true", help="only the swarm (plain measured in an earlier run)")
    parser.add_argument("--warmup", type=int, help="warm-up batches of a fixed count (default 2; cpu, smoke: 1)")
    parser.add_argument("--max-warmup", type=int, default=100, help='most warm-up batches of "auto"')
    parser.add_argument("--batches", type=int, help="timed batches per phase (default 5; cpu, smoke: 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may train (swarm: once up)")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds all the runs may take")
    parser.add_argument("--out", default=str(RESULTS), help="results file; the JSON goes to results/ beside it")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="only merge these results/gpu.json into --out's")
    parser.add_argument("--calibrate", action="store_true", help="only time one stage's blocks on the GPU")
    parser.add_argument(
        "--trace", action="store_true", help="split each phase's requests into parts, ms (see trace_figures)"
    )
    a = parser.parse_args()
    deadline = time.monotonic() + a.budget
    if a.trace:
        os.environ["GPU_TRACE"] = "1"
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
    if a.calibrate:
        calibrate(a.d_model or [2048, 1024], a.precision, out)
        return
    tiny = a.smoke or a.device == "cpu"
    a.mb = a.mb or ([2, "auto"] if a.device == "cpu" else [4] if a.smoke else [4, 8, "auto"])
    warmup = max(1, a.warmup or (1 if tiny else 2))
    signal.signal(signal.SIGTERM, stop_on_signal)
    plains: dict[tuple, dict] = {}  # this command's plain runs, by configuration
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as tmp:
        for settings, phases in plan(a, device):
            left = deadline - time.monotonic()
            if left < min(a.timeout, 30.0):  # too little for even a plain run: reported, not started
                save(skipped(settings, phases), out)
                continue
            batches = sum(p.get("max_warmup", p["warmup"]) + p["batches"] for p in phases) + 1
            n_layer, batch, block = settings["n_layer"], settings["batch"], settings["block"]
            steps = batches if phases else warmup + 1 + (a.batches or (2 if tiny else 20))
            run_args = model_args(settings["d_model"], steps, batch, block, n_layer)
            new = run(settings, run_args, Path(tmp), warmup + 1, phases, a.timeout, deadline)
            for r in new:  # a swarm run remembers this command's plain figure: a later command's may replace it
                configuration = tuple(r[k] for k in KEY[:6])
                if r["kind"] == "plain":
                    plains[configuration] = r
                elif plains.get(configuration, {}).get("status") == "ok":
                    r["plain_samples_per_s"] = plains[configuration]["samples_per_s"]
            save(new, out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer"]:
        peer_main(sys.argv[2:])
    else:
        main()
