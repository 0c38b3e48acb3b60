"""A CPU proxy of the GPU path (issue 25, part 1): the swarm's real code, in real peer processes, on an emulated GPU.

One serve-only peer per stage and one drive-only trainer run on this machine, as benchmarks/gpu.py runs them on one
GPU, with routing, transport, codec framing, kept activations, the fair queue and hivemind's optimizer all real.
Only the device is emulated (benchmarks/emulated_device.py): one timeline shared by the three processes, kernels
enqueued on it, syncs that sleep until the process's work is done, pipeline blocks that hold the GIL for their launch
and return real tensors of the real size without computing them. Calibration: the H100's per-sample block times
(../shared/gpu/README.md), examples/gpt.py's shapes: 8 blocks, batch 8 x 512 tokens, 2 stages, fp32 (``--bf16``:
bf16-mixed's block times, measured on an H100 with ``gpu.py --calibrate``); launch costs measured on this CPU (a tiny
block's forward and backward).

Each swarm (a d_model and a target batch size) runs phases one after the other, side by side in one run: 2, 4 and 8
microbatches, then "auto" (warm-up batches until its tuning settled), each phase's warm-up batches excluded from
its timed ones. Per phase:

- E = ideal / actual batch time, the ideal being the emulated device time per batch (every kernel: blocks,
  trainer's head and embeddings, codec, checks, optimizer);
- the device's idle time, split into gaps while a request was queued at a stage (from its arrival there until its
  first block started on the device), gaps during an optimizer step (a stage's hand-over of its gradients, or the
  trainer's step), and the pipeline's turnarounds (nothing queued: between batches, or with the hops in flight);
- the hop latency from one stage's compute ending to the next stage's starting, p50, and its parts (sender finishing
  its request, encoding and replying, the reply's transfer, the trainer's check, its send and the transfer, the
  receiver's decoding, queue wait, launch and device wait); and the hop less the device's other work meanwhile, p50
  ("idle"): one emulated device serves both stages, so a hop also waits behind the other stage's kernels, which
  keep the device busy and would run on a device of their own with a device per stage;
- each process's framework CPU seconds per batch: its CPU time less the emulated launch holds (and sync spins), and
  its helper processes' (p2pd, hivemind's DHT and averagers) apart.

    python benchmarks/gpu_proxy.py                   # ~5 min on 2 cores; RESULTS.md and results/gpu_proxy.json
    python benchmarks/gpu_proxy.py --updates delayed # the strategy's default updates (~7 min)
    python benchmarks/gpu_proxy.py --quick           # ~1 min smoke: d_model 1024, 2 and 4 microbatches

``--only D,T,M --batches N`` runs one swarm of one phase (d_model D, target T, M microbatches or "auto"), to compare
two worktrees' code run after run; ``--latency-ms L`` makes every message between peers (requests, hand-ons,
collects and their replies) arrive L ms late (``added_latency/sitecustomize.py``: netem is not available here), as
links with that latency would; neither writes the results file unless ``--out`` is given.

``--keep DIR`` saves each swarm's timeline (every kernel, copy, sync and swarm event, numpy) and CPU samples, to look
into a profile beyond the tables (``load_kept`` and ``analyse`` read them back); ``--bf16`` takes bf16-mixed's
block times.

Targets (issue 25): E >= 0.9 at d_model 2048 and >= 0.6 at 1024; median gap while a request is queued <= 0.1 ms;
hop p50 <= 2 ms at 2 MiB; turnarounds <= 5% and step stall <= 5% of ideal with a step every batch; framework CPU
<= 0.3 x ideal.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import emulated_device as emu  # noqa: E402
from harness import ONE_THREAD, STAGES, SWARM  # noqa: E402
from report import RESULTS, save_data, table, update_section  # noqa: E402

from lightning_swarm.launch import LocalSwarm  # noqa: E402

# seconds per sample per stage of 4 blocks on the H100, forward and backward: fp32 (issue 25, from
# ../shared/gpu/README.md) and bf16-mixed (`gpu.py --calibrate` there, 2026-11-25; RESULTS.md, "The first lent GPU")
H100 = {1024: (1.24e-3, 2.48e-3), 2048: (4.4e-3, 8.8e-3)}
H100_BF16 = {1024: (0.312e-3, 0.711e-3), 2048: (0.507e-3, 0.945e-3)}
N_LAYER, BATCH, BLOCK, VOCAB = 8, 8, 512, 96
PROCS = {"stage0": 0, "stage1": 1, "trainer": emu.TRAINER}
IDLE = ("queued", "step", "between_batches", "in_flight")
LATENCY_HOOK = ROOT / "benchmarks" / "added_latency"
HOP_PARTS = (
    "sender_finish",  # compute end -> the worker answered (0 when it answered before the device was done)
    "sender_encode",  # -> the reply left the handler (its wait for the compute, quantize, copy to the host, join)
    "reply_transfer",  # -> the trainer has the reply
    "trainer_check",  # -> the trainer checked it (its header and framing: the next stage checks its values)
    "send_transfer",  # -> the request arrived at the next stage (the trainer's send, the transfer)
    "receiver_decode",  # -> queued there (host copy, host-to-device copy, dequantize, finiteness sync, shape check)
    "queue_wait",  # -> its worker took it
    "launch_and_device",  # -> its first block started on the device
)


# ---- the peers ----------------------------------------------------------------------------------------------------


def peer_main(argv: list[str]) -> None:
    """``--peer``: one peer of the proxy swarm (its role, stage and the timeline come from the environment)."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_swarm  # noqa: F401  (registers strategy="swarm")

    parser = argparse.ArgumentParser()
    parser.add_argument("--d-model", type=int, required=True)
    parser.add_argument("--phases", default="[]")
    parser.add_argument("--max-steps", type=int, default=1000)
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    calibration = emu.Calibration.from_env(os.environ["GPU_PROXY_CALIBRATION"])
    device = emu.EmulatedDevice(
        emu.Timeline(os.environ["GPU_PROXY_TIMELINE"]), int(os.environ["GPU_PROXY_PROC"]), calibration
    )
    emu.install(device)
    emu.instrument(device)
    if os.environ.get("SLOW_LINKS_MESSAGE_LATENCY_MS"):
        runpy.run_path(str(LATENCY_HOOK / "sitecustomize.py"))  # as Python would at start-up, were it on the path

    class ProxyGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = emu.EmulatedEmbedding(VOCAB, BLOCK, a.d_model)
            self.blocks = nn.Sequential(*[emu.EmulatedBlock(a.d_model, calibration) for _ in range(N_LAYER)])
            self.head = emu.EmulatedHead(VOCAB, a.d_model)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.head(self.blocks(self.embed(batch[0])))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Tokens(L.LightningDataModule):
        batch_size = BATCH

        def train_dataloader(self) -> DataLoader:
            data = torch.randint(VOCAB, (a.max_steps * BATCH, BLOCK))
            return DataLoader(TensorDataset(data), batch_size=BATCH)

    model = ProxyGPT()
    if os.environ.get("SWARM_ROLE") == "serve":
        device.optimizer_numel = model.blocks[0].emulated_numel * N_LAYER // STAGES
    else:
        device.optimizer_numel = model.embed.emulated_numel + model.head.emulated_numel
    callbacks = [phase_control(json.loads(a.phases), device)] if os.environ.get("SWARM_ROLE") == "drive" else []
    trainer = L.Trainer(
        strategy="swarm",
        accelerator="cpu",
        devices=1,
        max_steps=a.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, Tokens())


def phase_control(phases: list[dict], device: emu.EmulatedDevice) -> Any:
    """The trainer's callback that runs the phases (lightning is imported in the peers only)."""
    import lightning as L

    from lightning_swarm.client.microbatch_tuning import SETTLING_BATCHES, MicrobatchTuner

    class PhaseControl(L.Callback):
        """The trainer's phases: each sets the remote pipeline's microbatches (a fresh tuner), trains its warm-up
        batches ("auto": until its tuning settled and ``SETTLING_BATCHES`` batches used the count it settled on,
        within ``max_warmup``), then its timed batches; every batch is recorded on the timeline (``BATCH``: extra =
        phase, key = batch number, key2 = 1 if timed, value = microbatches). After the last phase training stops."""

        def __init__(self, phases: list[dict], device: emu.EmulatedDevice) -> None:
            self.phases, self.device = phases, device
            self.index = self.warm = self.timed = self.number = self.count = self.at_settled = 0
            self.warmed, self.start, self.current_timed = False, 0.0, False

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            remote = trainer.strategy._remote
            if self.warm == 0 and self.timed == 0:  # a phase begins
                remote.tuner = MicrobatchTuner(self.phases[self.index]["microbatches"], remote.num_stages)
            self.count = remote.tuner.count(len(batch[0]))  # what this batch's pipeline uses
            self.current_timed = self.warmed
            self.start = time.monotonic()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            end, phase, remote = time.monotonic(), self.phases[self.index], trainer.strategy._remote
            size = len(batch[0])
            count = remote.tuner.settled(size) if phase["microbatches"] == "auto" else remote.tuner.count(size)
            self.device.timeline.record(
                self.start,
                end,
                self.device.proc,
                emu.BATCH,
                self.number,
                int(self.current_timed),
                value=count or 0,
                extra=self.index,
            )
            self.number += 1
            if not self.current_timed:
                self.warm += 1
                self.at_settled = self.at_settled + 1 if count is not None and self.count == count else 0
                ready = phase["microbatches"] != "auto" or self.at_settled >= SETTLING_BATCHES
                self.warmed = self.warm >= phase["warmup"] and (ready or self.warm >= phase.get("max_warmup", 0))
                return
            self.timed += 1
            if self.timed >= phase["batches"]:
                self.index, self.warm, self.timed, self.warmed, self.at_settled = self.index + 1, 0, 0, False, 0
                if self.index == len(self.phases):
                    trainer.should_stop = True

    return PhaseControl(phases, device)


# ---- running a swarm ----------------------------------------------------------------------------------------------


class CpuSampler:
    """Each watched peer's CPU seconds (its process: all threads), and its helpers' (the processes of its session:
    p2pd, hivemind's DHT and averagers), sampled every ``period`` seconds from /proc. A helper that exits keeps the
    CPU it was last seen with, so that the helpers' sum never falls."""

    def __init__(self, period: float = 0.1) -> None:
        self.period = period
        self.pids: dict[str, int] = {}
        self.series: dict[str, list[tuple[float, float, float]]] = {}
        self._members: dict[str, list[int]] = {}
        self._helpers: dict[str, dict[tuple[int, str], float]] = {}  # by peer: (pid, start time) -> CPU last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid
        self.series[name] = []

    def _stat(self, pid: int) -> Optional[list[str]]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()
        except OSError:
            return None

    def _seconds(self, fields: list[str]) -> float:
        """User and system CPU seconds from a /proc stat line's fields (after the name)."""
        return (int(fields[11]) + int(fields[12])) / self._tick

    def _cpu(self, pid: int) -> float:
        fields = self._stat(pid)
        return self._seconds(fields) if fields else 0.0

    def _helpers_cpu(self, name: str) -> float:
        seen = self._helpers.setdefault(name, {})
        for pid in self._members.get(name, []):
            fields = self._stat(pid)
            if fields:  # keyed by start time too: a pid taken again by a new process is another helper
                seen[(pid, fields[19])] = self._seconds(fields)
        return sum(seen.values())

    def _refresh_members(self) -> None:
        sessions: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                fields = self._stat(int(entry))
                if fields:
                    sessions.setdefault(int(fields[3]), []).append(int(entry))
        self._members = {name: [p for p in sessions.get(pid, []) if p != pid] for name, pid in self.pids.items()}

    def _run(self) -> None:
        last_refresh = 0.0
        while not self._stop.wait(self.period):
            now = time.monotonic()
            if now - last_refresh > 1.0:
                self._refresh_members()
                last_refresh = now
            for name, pid in list(self.pids.items()):
                self.series[name].append((now, self._cpu(pid), self._helpers_cpu(name)))

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_swarm(
    work: Path,
    d_model: int,
    target: int,
    phases: list[dict],
    calibration: emu.Calibration,
    timeout: float,
    delayed: bool = False,
    latency_ms: float = 0.0,
) -> dict:
    """One swarm: two stage peers, a trainer running ``phases``; returns the timeline's records and the CPU samples.
    ``latency_ms``: added to every message between the peers (module docstring)."""
    run_id = f"proxy{d_model}_{target}"
    path = work / f"{run_id}.timeline"
    emu.Timeline.create(path)
    env = {
        **ONE_THREAD,
        **SWARM,
        "SWARM_PIPELINE": "blocks",
        "SWARM_TARGET_BATCH_SIZE": str(target),
        "SWARM_MICROBATCHES": "auto",
        "SWARM_DELAYED_UPDATES": str(delayed),
        "GPU_PROXY_TIMELINE": str(path),
        "GPU_PROXY_CALIBRATION": calibration.to_env(),
    }
    if latency_ms > 0:
        env["SLOW_LINKS_MESSAGE_LATENCY_MS"] = str(latency_ms)  # peer_main applies it
    batches = sum(p.get("max_warmup", p["warmup"]) + p["batches"] for p in phases) + 5
    args = ["--peer", "--d-model", str(d_model), "--max-steps", str(batches)]
    started = time.monotonic()
    with LocalSwarm([__file__], work / run_id, run_id=run_id, env=env) as local, CpuSampler() as sampler:
        peers = {
            f"stage{k}": (args, {"SWARM_ROLE": "serve", "SWARM_STAGE": str(k), "GPU_PROXY_PROC": str(k)})
            for k in range(STAGES)
        }
        trainer_env = {"SWARM_ROLE": "drive", "GPU_PROXY_PROC": str(emu.TRAINER)}
        peers["trainer"] = ([*args, "--phases", json.dumps(phases)], trainer_env)
        local.start_together(peers)  # stage 0 first, then the others at once (the trainer waits for the stages)
        for name, peer in local.peers.items():
            sampler.watch(name, peer.process.pid)
        ready = time.monotonic()
        code = local.wait("trainer", timeout=timeout)
        if code != 0:
            logs = "".join(f"\n---- {p.name}:\n{p.log()[-3000:]}" for p in local.peers.values())
            raise RuntimeError(f"the trainer of {run_id} exited with {code}; the peers' logs end with:{logs}")
        finished = time.monotonic()
    timeline = emu.Timeline(path)
    records = timeline.records()
    if timeline.dropped:
        raise RuntimeError(f"the timeline of {run_id} was full: {timeline.dropped} records dropped")
    return {
        "records": records,
        "cpu": sampler.series,
        "seconds": {"start": ready - started, "train": finished - ready},
    }


# ---- intervals ----------------------------------------------------------------------------------------------------

Intervals = list[tuple[float, float]]


def union(intervals: Sequence[tuple[float, float]]) -> Intervals:
    merged: Intervals = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def clip(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> Intervals:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Of two sorted, disjoint lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def covered(intervals: Intervals, starts: Sequence[float], lo: float, hi: float) -> float:
    """How much of [lo, hi] the sorted, disjoint ``intervals`` (their ``starts``) cover."""
    out, i = 0.0, max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(intervals) and intervals[i][0] < hi:
        out += max(0.0, min(intervals[i][1], hi) - max(intervals[i][0], lo))
        i += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """``a`` less ``b`` (sorted, disjoint lists)."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def total(intervals: Intervals) -> float:
    return sum(e - s for s, e in intervals)


# ---- analysis -----------------------------------------------------------------------------------------------------


def analyse(run: dict, phases: list[dict], calibration: emu.Calibration, d_model: int, target: int) -> list[dict]:
    """Each phase's figures (see the module docstring), from a swarm's records and CPU samples."""
    r = run["records"]
    kind = r["kind"]
    kernels = r[np_isin(kind, emu.KERNELS)]
    busy_all = union(list(zip(kernels["t0"], kernels["t1"])))
    recomputing = kernels[(kernels["kind"] == emu.BLOCK_FORWARD) & (kernels["extra"] == emu.REQUEST_KINDS["backward"])]
    recompute_all = union(list(zip(recomputing["t0"], recomputing["t1"])))

    # each request's block kernels: (proc, key, request kind) -> first start, last end
    blocks = r[np_isin(kind, emu.BLOCKS)]
    first: dict[tuple, float] = {}
    last: dict[tuple, float] = {}
    for row in blocks:
        k = (int(row["proc"]), int(row["key"]), int(row["extra"]))
        first[k] = min(first.get(k, float("inf")), float(row["t0"]))
        last[k] = max(last.get(k, float("-inf")), float(row["t1"]))

    def events(code: int) -> dict[tuple, Any]:
        rows = r[kind == code]
        return {(int(x["proc"]), int(x["key"]), int(x["extra"])): x for x in rows}

    arrive, submit, serve, answer = events(emu.ARRIVE), events(emu.SUBMIT), events(emu.SERVE), events(emu.ANSWER)
    calls = {(int(x["value"]), int(x["key"]), int(x["extra"])): x for x in r[kind == emu.CALL]}
    checks = {(int(x["value"]), int(x["key"]), int(x["extra"])): x for x in r[kind == emu.CHECK]}
    handovers = {(int(x["proc"]), int(x["key"])): x for x in r[kind == emu.HANDOVER]}
    pending = union([(float(x["t0"]), first[k]) for k, x in arrive.items() if k in first])
    # where the queued requests were: decoding (arrived, not queued yet), in the fair queue, or with the worker
    decoding = union(
        [(float(x["t0"]), float(submit[k]["t0"])) for k, x in arrive.items() if k in first and k in submit]
    )
    waiting = union([(float(x["t0"]), float(serve[k]["t0"])) for k, x in submit.items() if k in first and k in serve])
    starting = union([(float(x["t0"]), first[k]) for k, x in serve.items() if k in first])
    stepping = union([(float(x["t0"]), float(x["t1"])) for x in r[np_isin(kind, (emu.HANDOVER, emu.STEP))]])
    # a batch is in flight while the trainer runs a forward or a backward through the stages (a trailing backward
    # runs beside the next batch's forward)
    in_flight = union(
        [(float(x["t0"]), float(x["t1"])) for x in r[np_isin(kind, (emu.PIPE_FORWARD, emu.PIPE_BACKWARD))]]
    )
    batch_rows = r[kind == emu.BATCH]
    routes = r[kind == emu.ROUTE]

    results = []
    for index, phase in enumerate(phases):
        rows = sorted(batch_rows[batch_rows["extra"] == index], key=lambda x: int(x["key"]))
        timed = [x for x in rows if x["key2"] == 1]
        warm = [x for x in rows if x["key2"] == 0]
        if not timed or not warm:
            raise RuntimeError(f"phase {phase} has {len(warm)} warm-up and {len(timed)} timed batches")
        start, end, n = float(warm[-1]["t1"]), float(timed[-1]["t1"]), len(timed)
        wall = end - start
        busy = clip(busy_all, start, end)
        recompute = total(clip(recompute_all, start, end))  # forwards computed again: busy, but not useful
        idle = subtract([(start, end)], busy)
        idle_step = intersect(idle, stepping)
        rest = subtract(idle, stepping)
        idle_queued = intersect(rest, pending)
        turnaround = subtract(rest, pending)
        idle_flight = intersect(turnaround, in_flight)
        idle_between = subtract(turnaround, in_flight)
        ideal = (total(busy) - recompute) / n
        gaps = [e - s for s, e in idle_queued]
        at_worker = intersect(idle_queued, starting)
        in_queue = intersect(subtract(idle_queued, starting), waiting)
        in_decode = intersect(subtract(subtract(idle_queued, starting), waiting), decoding)

        hops, parts = [], {p: [] for p in HOP_PARTS}
        idle_hops, busy_starts = [], [s for s, _ in busy]  # a hop less the device's other work meanwhile
        for route in routes[(routes["t0"] >= start) & (routes["t0"] <= end)]:
            keys = {0: int(route["key"]), 1: int(route["key2"])}
            for code, (a, b) in ((1, (0, 1)), (2, (1, 0))):  # forward: stage 0 -> 1; backward: 1 -> 0
                src, dst = (a, keys[a], code), (b, keys[b], code)
                if src not in last or dst not in first or not (start <= last[src] and first[dst] <= end):
                    continue
                hop = first[dst] - last[src]
                hops.append(hop)
                idle_hops.append(hop - covered(busy, busy_starts, last[src], first[dst]))
                stamps = _hop_stamps(
                    src, dst, code, last, first, serve, handovers, answer, calls, checks, arrive, submit
                )
                if stamps is not None:
                    for name, (t0, t1) in zip(HOP_PARTS, zip(stamps, stamps[1:])):
                        parts[name].append(t1 - t0)
        cpu = _cpu_per_batch(run, r, start, end, n)
        ends = _pipeline_ends(r, start, end)
        microbatches = phase["microbatches"]
        count = int(timed[-1]["value"]) if microbatches == "auto" else int(microbatches)
        numel = BATCH // max(count, 1) * BLOCK * d_model
        stepped = (r["kind"] == emu.STEP) & (r["extra"] == 0) & (r["t0"] >= start) & (r["t0"] < end)
        results.append(
            {
                "d_model": d_model,
                "target": target,
                "microbatches": microbatches,
                "count": count,
                "batches": n,
                "message_bytes": numel + 4 * -(-numel // 4096),
                "ideal": ideal,
                "actual": wall / n,
                "E": (total(busy) - recompute) / wall,
                "recompute": recompute / n,
                "idle": {
                    "total": total(idle) / n,
                    "queued": total(idle_queued) / n,
                    "step": total(idle_step) / n,
                    "between_batches": total(idle_between) / n,
                    "in_flight": total(idle_flight) / n,
                },
                "queued_gaps": {
                    "count": len(gaps),
                    "median": statistics.median(gaps) if gaps else 0.0,
                    "p90": sorted(gaps)[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
                    # the queued idle time per batch by where the request was: the worker had it (its Python, the
                    # launch), it waited in the queue (the worker busy: a synchronize, a hand-over), or it was being
                    # decoded (host copy, dequantize, the finiteness check's sync, the shape check)
                    "at_worker": total(at_worker) / n,
                    "in_queue": total(in_queue) / n,
                    "decoding": total(in_decode) / n,
                },
                "hops": {
                    "count": len(hops),
                    "p50": statistics.median(hops) if hops else None,
                    # the part of a hop that left the device idle: one device serves both stages here, so a hop
                    # also waits for the other stage's kernels, which a device per stage would not
                    "idle_p50": statistics.median(idle_hops) if idle_hops else None,
                    "parts_p50": {k: statistics.median(v) for k, v in parts.items() if v},
                    "parts_mean": {k: statistics.fmean(v) for k, v in parts.items() if v},
                },
                "cpu": cpu,
                "ends": ends,
                "steps_per_batch": {name: int((stepped & (r["proc"] == p)).sum()) / n for name, p in PROCS.items()},
                "window": [start, end],
            }
        )
    return _plain(results)


def _plain(value: Any) -> Any:
    """``value`` with numpy numbers as Python's (for JSON and printing)."""
    return json.loads(json.dumps(value, default=lambda x: x.item() if hasattr(x, "item") else str(x)))


def np_isin(values: Any, codes: Sequence[int]) -> Any:
    import numpy as np

    return np.isin(values, list(codes))


def _hop_stamps(src, dst, code, last, first, serve, handovers, answer, calls, checks, arrive, submit):
    """The times that split a hop (see ``HOP_PARTS``), or None if one is missing. A hop the sending stage hands on
    itself (chain wiring: the call that brought the request to ``dst`` came from a stage server, not the trainer)
    never passes the trainer: its reply and check parts are 0, and its send runs from that call's start."""
    try:
        answered = float(handovers[src[:2]]["t0"]) if code == 2 and src[:2] in handovers else float(serve[src]["t1"])
        answered = max(answered, last[src])  # a worker that does not wait for the device answers before it is done
        if dst in calls and int(calls[dst]["proc"]) != emu.TRAINER:
            sent = max(float(calls[dst]["t0"]), answered)
            received = [float(x[dst]["t0"]) for x in (arrive, submit, serve)]
            return [last[src], answered, sent, sent, sent, *received, first[dst]]
        return [
            last[src],
            answered,
            float(answer[src]["t1"]),
            float(calls[src]["t1"]),
            float(checks[src]["t1"]),
            float(arrive[dst]["t0"]),
            float(submit[dst]["t0"]),
            float(serve[dst]["t0"]),
            first[dst],
        ]
    except KeyError:
        return None


def _pipeline_ends(r: Any, start: float, end: float) -> dict[str, Optional[float]]:
    """The ends of the pipeline within ``[start, end]``, p50 seconds: from the last stage's last forward kernel to
    the trainer's forward through the stages returning (the output decoded), and from the first stage's last
    backward kernel to the trainer's backward returning (the input gradient decoded)."""
    kind, proc, out = r["kind"], r["proc"], {}
    for name, pipe, block, stage in (
        ("forward", emu.PIPE_FORWARD, emu.BLOCK_FORWARD, STAGES - 1),
        ("backward", emu.PIPE_BACKWARD, emu.BLOCK_BACKWARD, 0),
    ):
        pipes = r[(kind == pipe) & (proc == emu.TRAINER) & (r["t0"] >= start) & (r["t1"] <= end)]
        ends = r["t1"][(kind == block) & (proc == stage)]
        gaps = []
        for p in pipes:
            inside = ends[(ends >= p["t0"]) & (ends <= p["t1"])]
            if len(inside):
                gaps.append(float(p["t1"] - inside.max()))
        out[name] = statistics.median(gaps) if gaps else None
    return out


def _cpu_per_batch(run: dict, r: Any, start: float, end: float, n: int) -> dict:
    """Each process's CPU seconds per batch in [start, end]: framework (its CPU less the emulated launch holds and
    sync spins), the holds, and its helper processes'."""
    out = {}
    inside = (r["t0"] >= start) & (r["t0"] < end)
    for name, number in PROCS.items():
        series = run["cpu"].get(name) or []
        if len(series) < 2:
            continue
        main = _interpolate(series, end, 1) - _interpolate(series, start, 1)
        helpers = _interpolate(series, end, 2) - _interpolate(series, start, 2)
        mine = inside & (r["proc"] == number)
        holds = float(r["value"][mine & np_isin(r["kind"], emu.KERNELS)].sum())
        holds += float(r["value"][mine & (r["kind"] == emu.SYNC)].sum())
        out[name] = {"framework": (main - holds) / n, "holds": holds / n, "helpers": helpers / n}
    return out


def _interpolate(series: list[tuple[float, float, float]], t: float, column: int) -> float:
    for (t0, *v0), (t1, *v1) in zip(series, series[1:]):
        if t0 <= t <= t1:
            w = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
            return v0[column - 1] + w * (v1[column - 1] - v0[column - 1])
    return (series[0] if t < series[0][0] else series[-1])[column]


def run_check(run: dict, calibration: emu.Calibration) -> dict:
    """Whole-run consistency: the device's busy time (the union of its kernels queued in order) against the sum of
    their durations (the timeline runs them one at a time), and how many kernels ran beside them; the samples each
    stage computed forward and backward against the samples the trainer trained; and the blocks' busy time against
    the calibrated time of those samples (each through every stage, forward and backward), plus the forwards a
    backward computed again."""
    r = run["records"]
    kernels = r[np_isin(r["kind"], emu.KERNELS) & (r["key2"] == 0)]
    beside = r[np_isin(r["kind"], emu.KERNELS) & (r["key2"] == 1)]
    blocks = r[np_isin(r["kind"], emu.BLOCKS)]
    samples = int((r["kind"] == emu.BATCH).sum()) * BATCH
    served = r[r["kind"] == emu.SERVE]
    per_stage = {
        f"{kind} samples, stage {k}": int(served["value"][(served["proc"] == k) & (served["extra"] == code)].sum())
        for k in range(STAGES)
        for kind, code in emu.REQUEST_KINDS.items()
    }
    again = {
        (int(x["proc"]), int(x["key"])) for x in blocks[(blocks["kind"] == emu.BLOCK_FORWARD) & (blocks["extra"] == 2)]
    }
    backward = served[served["extra"] == emu.REQUEST_KINDS["backward"]]
    recomputed = int(sum(x["value"] for x in backward if (int(x["proc"]), int(x["key"])) in again))
    return _plain(
        {
            "busy": total(union(list(zip(kernels["t0"], kernels["t1"])))),
            "kernel_sum": float((kernels["t1"] - kernels["t0"]).sum()),
            "kernels_beside": len(beside),
            "block_busy": total(union(list(zip(blocks["t0"], blocks["t1"])))),
            "block_expected": (
                samples * STAGES * (calibration.forward + calibration.backward) + recomputed * calibration.forward
            ),
            "samples": samples,
            "recomputed_samples": recomputed,
            **per_stage,
        }
    )


# ---- calibration --------------------------------------------------------------------------------------------------


def measure_launch() -> tuple[float, float, float]:
    """Host seconds to launch one transformer block's forward and its backward, as eager PyTorch dispatches them:
    examples/gpt.py's Block on a tiny input on this CPU (its compute is negligible, its ~100 op calls are not);
    and seconds per parameter of an AdamW step on one host thread (delayed updates step on the host). One thread, in
    a fresh process; the 10th percentile of many calls, as the machine is shared (other processes' load is in the
    swarm's own figures already)."""
    code = """
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from gpt import Block
torch.set_num_threads(1)
block, x = Block(64, 1), torch.randn(1, 4, 64, requires_grad=True)
g = torch.randn(1, 4, 64)
def timed(fn, n=200):
    for _ in range(20):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 10]
f = timed(lambda: block(x))
fb = timed(lambda: torch.autograd.grad(block(x), [x, *block.parameters()], g))
params = [torch.nn.Parameter(torch.zeros(1_000_000)) for _ in range(4)]
for p in params:
    p.grad = torch.ones_like(p)
adam = torch.optim.AdamW(params, lr=1e-4)
adam.step()
print(f, fb - f, timed(adam.step, 5) / 4e6)
"""
    env = {**os.environ, **ONE_THREAD}
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "examples")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    forward, backward, adam = map(float, done.stdout.split()[-3:])
    return forward, backward, adam


def calibration_for(d_model: int, bf16: bool, measured: tuple[float, float, float]) -> emu.Calibration:
    forward, backward = (H100_BF16 if bf16 else H100)[d_model]
    launch_forward, launch_backward, host_adam = measured
    return emu.Calibration(forward, backward, N_LAYER // STAGES, launch_forward, launch_backward, host_adam=host_adam)


# ---- the report ---------------------------------------------------------------------------------------------------


def targets(rows: list[dict]) -> dict[str, dict]:
    """Each target of issue 25: met or not, and the figures it was judged on."""

    def pick(**conditions: Any) -> list[dict]:
        return [r for r in rows if all(r[k] == v for k, v in conditions.items())]

    out = {}
    for d_model, goal in ((2048, 0.9), (1024, 0.6)):
        chosen = pick(d_model=d_model, microbatches="auto")
        if chosen:
            out[f"E >= {goal} at d_model {d_model} (auto)"] = {
                "met": all(r["E"] >= goal for r in chosen),
                "figures": [round(r["E"], 3) for r in chosen],
            }
    out["median queued gap <= 0.1 ms"] = {
        "met": all(r["queued_gaps"]["median"] <= 1e-4 for r in rows),
        "figures": [round(1e3 * r["queued_gaps"]["median"], 3) for r in rows],
    }
    two = [r for r in rows if abs(r["message_bytes"] / 2**20 - 2) < 0.1 and r["hops"]["p50"] is not None]
    if two:
        out["hop p50 <= 2 ms at 2 MiB"] = {
            "met": all(r["hops"]["p50"] <= 2e-3 for r in two),
            "figures": [round(1e3 * r["hops"]["p50"], 2) for r in two],
        }
    every = [r for r in rows if r["target"] == BATCH]
    if every:
        turn = [(r["idle"]["between_batches"] + r["idle"]["in_flight"]) / r["ideal"] for r in every]
        out["turnarounds <= 5% of ideal (step every batch)"] = {
            "met": all(t <= 0.05 for t in turn),
            "figures": [round(t, 3) for t in turn],
        }
        step = [r["idle"]["step"] / r["ideal"] for r in every]
        out["step stall <= 5% of ideal (step every batch)"] = {
            "met": all(s <= 0.05 for s in step),
            "figures": [round(s, 3) for s in step],
        }
    cpu = [max(c["framework"] for c in r["cpu"].values()) / r["ideal"] for r in rows if r["cpu"]]
    out["framework CPU <= 0.3 x ideal (each process)"] = {
        "met": all(c <= 0.3 for c in cpu),
        "figures": [round(c, 2) for c in cpu],
    }
    return out


def summary_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        idle = r["idle"]
        mb = f"auto ({r['count']})" if r["microbatches"] == "auto" else str(r["microbatches"])
        hop = r["hops"]
        hop_cell = "-" if hop["p50"] is None else f"{1e3 * hop['p50']:.2f} ({r['message_bytes'] / 2**20:.2g} MiB)"
        if hop["idle_p50"] is not None:
            hop_cell += f", {1e3 * hop['idle_p50']:.2f} idle"
        cpu = " / ".join(f"{r['cpu'][n]['framework'] / r['ideal']:.2f}" for n in PROCS if n in r["cpu"])
        out.append(
            [
                str(r["d_model"]),
                str(r["target"]),
                mb,
                f"{r['E']:.3f}",
                f"{1e3 * r['ideal']:.1f}",
                f"{1e3 * r['actual']:.1f}",
                f"{idle['queued'] / r['ideal']:.2f}",
                f"{(idle['between_batches'] + idle['in_flight']) / r['ideal']:.2f}",
                f"{idle['step'] / r['ideal']:.2f}",
                f"{1e3 * r['queued_gaps']['median']:.2f}",
                hop_cell,
                cpu,
            ]
        )
    return out


HEADER = [
    "d_model",
    "target",
    "microbatches",
    "E",
    "ideal ms/batch",
    "actual ms/batch",
    "idle: queued",
    "idle: turnaround",
    "idle: step",
    "queued gap p50 ms",
    "hop p50 ms (message, idle part)",
    "framework CPU / ideal: stage 0 / stage 1 / trainer",
]


def hop_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        parts = r["hops"]["parts_p50"]
        if not parts:
            continue
        mb = f"auto ({r['count']})" if r["microbatches"] == "auto" else str(r["microbatches"])
        out.append([str(r["d_model"]), str(r["target"]), mb] + [f"{1e3 * parts.get(p, 0):.2f}" for p in HOP_PARTS])
    return out


PROFILE = [
    "d_model",
    "target",
    "microbatches",
    "queued: at worker / in queue / decoding",
    "turnaround: between batches / in flight",
    "pipeline ends p50: forward / backward",
    "step",
    "framework CPU: stage 0 / stage 1 / trainer",
    "helpers' CPU",
]


def ends_cell(row: dict) -> str:
    """A row's pipeline ends, forward / backward, in ms."""
    return " / ".join("-" if v is None else f"{1e3 * v:.1f}" for v in row["ends"].values())


def profile_rows(rows: list[dict]) -> list[list[str]]:
    """Where the idle time and the CPU went, ms per batch."""
    out = []
    for r in rows:
        q, idle, cpu = r["queued_gaps"], r["idle"], r["cpu"]
        mb = f"auto ({r['count']})" if r["microbatches"] == "auto" else str(r["microbatches"])
        ms = lambda *values: " / ".join(f"{1e3 * v:.1f}" for v in values)  # noqa: E731
        out.append(
            [str(r["d_model"]), str(r["target"]), mb]
            + [ms(q["at_worker"], q["in_queue"], q["decoding"]), ms(idle["between_batches"], idle["in_flight"])]
            + [ends_cell(r)]
            + [ms(idle["step"]), ms(*(cpu[n]["framework"] for n in PROCS if n in cpu))]
            + [ms(*(cpu[n]["helpers"] for n in PROCS if n in cpu))]
        )
    return out


def print_table(rows: list[dict]) -> None:
    print("\n".join(table(HEADER, summary_rows(rows))))
    print()
    print("\n".join(table(PROFILE, profile_rows(rows))))
    print()
    print("\n".join(table(["d_model", "target", "microbatches", *HOP_PARTS], hop_rows(rows))))
    print()
    for name, verdict in targets(rows).items():
        print(f"{'met   ' if verdict['met'] else 'MISSED'} {name}: {verdict['figures']}")


def write(runs: list[dict], path: Path) -> None:
    """The ``gpu_proxy`` section of the results file: one row of headline figures per run (the oldest first), then
    the latest run's table, hop parts and targets."""
    latest = runs[-1]
    rows = latest["rows"]
    history = []
    for run in runs:
        verdicts = targets(run["rows"])
        history.append(
            [run["date"], run["commit"] or "-", f"{run['label']}, {run['updates']} updates"]
            + [("met: " if v["met"] else "missed: ") + _span(v["figures"]) for v in verdicts.values()]
        )
    names = list(targets(runs[-1]["rows"]))
    cal = latest["calibration"]
    blocks = ", ".join(f"d_model {d}: {1e3 * f:.2f} / {1e3 * b:.2f} ms" for d, (f, b) in latest["block_times"].items())
    load = latest["load_average"]
    lines = [
        "## GPU proxy: the GPU path on an emulated device (issue 25)",
        "",
        f"`{latest['command']}` (see its docstring), {latest['date']}, commit {latest['commit']}: the swarm's real "
        "code in real processes (two serve-only stage peers and a drive-only trainer on this machine), only the "
        "device emulated: one timeline shared by the processes. 8 blocks, batch 8 x 512 tokens, 2 stages, 8-bit "
        f"wire, {latest['updates']} updates. Per sample per stage, forward / backward: {blocks} "
        f"({'bf16-mixed' if latest.get('bf16') else 'fp32'}, the H100). Measured here: launch per block "
        f"{1e3 * cal['launch_forward']:.2f} / {1e3 * cal['launch_backward']:.2f} ms, AdamW on one host thread "
        f"{1e9 * cal['host_adam']:.1f} ns per parameter. Assumed: HBM {cal['hbm'] / 1e12:g} TB/s, copies "
        f"{cal['pinned'] / 1e9:g} GB/s pinned and {cal['pageable'] / 1e9:g} GB/s pageable "
        f"(+{1e6 * cal['copy_latency']:g} us each). The run took {latest['seconds']:.0f} s; load average "
        f"{load['start'][0]:.1f} at its start, {load['end'][0]:.1f} at its end (2 cores, shared).",
        "",
        "### Targets, one row per run (today's code first)",
        "",
        "Figures: E; ms for the gaps and hops; multiples of ideal for turnarounds, step stall and framework CPU (the "
        "process with the most); ranges over the phases judged.",
        "",
        *table(["date", "commit", "run", *names], history),
        "",
        "### Latest run",
        "",
        "E = ideal / actual batch time (ideal: the emulated device time per batch). Idle columns: the device's idle "
        "time per batch as a share of ideal, while a request was queued at a stage (arrived, not yet computing), "
        "the pipeline's turnarounds (nothing queued: between batches, hops in flight) and the optimizer steps "
        "(stage hand-overs, trainer step). Framework CPU: each process's CPU per batch less its emulated launch "
        "holds, over ideal.",
        "",
        *table(HEADER, summary_rows(rows)),
        "",
        "Where it went, ms per batch: the device's idle time while a request was queued, by where the request was "
        "(its stage's worker had it, it waited in the fair queue, it was being decoded), turnarounds, the pipeline's "
        "ends (from the last stage's last forward kernel to the trainer's output, and from the first stage's last "
        "backward kernel to the trainer's input gradient; p50) and steps; "
        "each process's framework CPU and its helper processes' CPU (p2pd, hivemind's DHT and averagers).",
        "",
        *table(PROFILE, profile_rows(rows)),
        "",
        "Hop parts (p50, ms): from one stage's compute ending to the next stage's starting.",
        "",
        *table(["d_model", "target", "microbatches", *HOP_PARTS], hop_rows(rows)),
    ]
    update_section("gpu_proxy", lines, path)


def keep(directory: Path, name: str, run: dict, phases: list[dict]) -> None:
    """A swarm's raw records (numpy), CPU samples and phases, to look into (``load_kept``)."""
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / f"{name}.npy", run["records"])
    (directory / f"{name}.json").write_text(
        json.dumps({"cpu": run["cpu"], "phases": phases, "seconds": run["seconds"]})
    )


def load_kept(directory: Path, name: str) -> tuple[dict, list[dict]]:
    import numpy as np

    extra = json.loads((directory / f"{name}.json").read_text())
    run = {"records": np.load(directory / f"{name}.npy"), "cpu": extra["cpu"], "seconds": extra["seconds"]}
    return run, extra["phases"]


def _span(figures: list[float]) -> str:
    """A target's figures in a cell: all of them if few, else their range and count."""
    if len(figures) <= 2:
        return ", ".join(f"{f:g}" for f in figures)
    return f"{min(figures):g} to {max(figures):g} ({len(figures)} phases)"


def commit() -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- main ---------------------------------------------------------------------------------------------------------


def plan(quick: bool, timed: Optional[int], only: Optional[str] = None) -> list[tuple[int, int, list[dict]]]:
    """(d_model, target, phases) per swarm; ``only``: ``"D,T,M"``, one swarm of one phase."""
    if only is not None:
        d_model, target, microbatches = only.split(",")
        phase = {"microbatches": microbatches if microbatches == "auto" else int(microbatches), "warmup": 4}
        phase |= {"max_warmup": 100} if microbatches == "auto" else {}
        return [(int(d_model), int(target), [{**phase, "batches": timed or 30}])]
    if quick:
        phases = [{"microbatches": m, "warmup": 2, "batches": timed or 3} for m in (2, 4)]
        return [(1024, BATCH, phases)]
    swarms = []
    for d_model in (2048, 1024):
        for target in (BATCH, 128):
            n = timed or (6 if target == BATCH else 16)  # 128: a stage steps once in 16 batches
            phases = [{"microbatches": m, "warmup": 2, "batches": n} for m in (2, 4, 8)]
            phases[0]["warmup"] = 3  # the first batches open connections
            phases.append({"microbatches": "auto", "warmup": 4, "max_warmup": 100, "batches": n})
            swarms.append((d_model, target, phases))
    return swarms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", "--smoke", action="store_true", help="a short smoke run (CI)")
    parser.add_argument("--bf16", action="store_true", help="bf16-mixed block times, as measured on the H100")
    parser.add_argument(
        "--updates",
        choices=["synchronous", "delayed"],
        default="synchronous",
        help="the stages' updates (SWARM_DELAYED_UPDATES; the strategy's default is delayed)",
    )
    parser.add_argument("--batches", type=int, help="timed batches per phase")
    parser.add_argument("--out", help="results file (default: benchmarks/RESULTS.md; --quick: none unless given)")
    parser.add_argument("--label", default="today's code", help="this run's name in the results' table of runs")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds one swarm may take")
    parser.add_argument("--keep", help="save each swarm's timeline records and CPU samples into this folder (.npz)")
    parser.add_argument("--only", help='one swarm of one phase: "D,T,M" (d_model, target, microbatches or auto)')
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added to every message between peers")
    a = parser.parse_args()
    began, load = time.monotonic(), os.getloadavg()
    launch = measure_launch()
    print(
        f"measured here: launch per block forward {1e3 * launch[0]:.3f} ms, backward {1e3 * launch[1]:.3f} ms; "
        f"AdamW on one host thread {1e9 * launch[2]:.2f} ns per parameter",
        flush=True,
    )
    rows, checks = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_proxy_") as tmp:
        for d_model, target, phases in plan(a.quick, a.batches, a.only):
            calibration = calibration_for(d_model, a.bf16, launch)
            delayed = a.updates == "delayed"
            run = run_swarm(Path(tmp), d_model, target, phases, calibration, a.timeout, delayed, a.latency_ms)
            results = analyse(run, phases, calibration, d_model, target)
            if a.keep:
                keep(Path(a.keep), f"{d_model}_{target}_{a.updates}", run, phases)
            check = {"d_model": d_model, "target": target, **run_check(run, calibration), **run["seconds"]}
            checks.append(check)
            rows += results
            for r in results:
                print(
                    f"d_model {d_model} target {target} microbatches {r['microbatches']} ({r['count']}): "
                    f"E {r['E']:.3f}, ideal {1e3 * r['ideal']:.1f} ms, actual {1e3 * r['actual']:.1f} ms, "
                    f"pipeline ends {ends_cell(r)} ms",
                    flush=True,
                )
            print(
                f"  swarm started in {run['seconds']['start']:.0f} s, trained {run['seconds']['train']:.0f} s",
                flush=True,
            )
    seconds = time.monotonic() - began
    print()
    print_table(rows)
    print(f"\nfull run: {seconds:.0f} s")
    command = "python benchmarks/gpu_proxy.py" + (" --quick" if a.quick else "") + (" --bf16" if a.bf16 else "")
    command += " --updates delayed" if a.updates == "delayed" else ""
    command += f" --only {a.only}" if a.only else ""
    command += f" --latency-ms {a.latency_ms:g}" if a.latency_ms else ""
    run_entry = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": commit(),
        "label": a.label,
        "command": command,
        "bf16": a.bf16,
        "updates": a.updates,
        "seconds": seconds,
        "load_average": {"start": load, "end": os.getloadavg()},  # the machine is shared: how busy it was
        "calibration": vars(calibration_for(1024, a.bf16, launch)),
        "block_times": {d: list(times) for d, times in (H100_BF16 if a.bf16 else H100).items()},
        "rows": rows,
        "checks": checks,
        "targets": targets(rows),
    }
    out = Path(a.out) if a.out else (None if a.quick or a.only or a.latency_ms else RESULTS)
    if out is None:
        return
    data = out.parent / "results" / "gpu_proxy.json"
    runs = json.loads(data.read_text())["runs"] if data.exists() else []
    runs = [r for r in runs if (r["commit"], r["label"], r["command"]) != (run_entry["commit"], a.label, command)]
    runs.append(run_entry)
    if out.parent == RESULTS.parent:
        save_data("gpu_proxy", {"runs": runs})
    else:
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    write(runs, out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer"]:
        peer_main(sys.argv[2:])
    else:
        main()
