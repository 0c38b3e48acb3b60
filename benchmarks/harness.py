"""What the benchmark scripts share: their command line, and training examples/gpt.py in one process or on a local
swarm of real peers, with the throughput and memory read from what the peers recorded. ``report.py`` beside it
writes the results.

Importing this module puts ``examples/`` on ``sys.path`` (the scripts import the GPT from there)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
sys.path.insert(0, str(ROOT / "examples"))

from lightning_swarm.launch import LocalSwarm  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HIVEMIND_LOGLEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
STAGES = 2
SWARM = {
    "SWARM_NUM_STAGES": str(STAGES),
    "SWARM_MATCHMAKING_TIME": "1.0",
    "SWARM_AVERAGING_TIMEOUT": "5.0",
    "SWARM_UPDATE_PERIOD": "2.0",
    "SWARM_LINGER": "0",
    "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
}


def model_args(d_model: int, steps: int, batch: int, block: int, n_layer: int = 4) -> list[str]:
    heads = max(1, d_model // 64)
    return [*("--d-model", str(d_model), "--n-layer", str(n_layer), "--n-head", str(heads))] + [
        *("--block-size", str(block), "--batch-size", str(batch), "--max-steps", str(steps))
    ]


def steady_throughput(history: dict, start: Optional[int] = None) -> float:
    """Samples per second from the end of step ``start`` (counted from 0; default: half way) to the last step."""
    times = history["times"]
    half = len(times) // 2 if start is None else start
    return (len(times) - 1 - half) * history["samples"] / len(times) / (times[-1] - times[half])


def steady_call_seconds(history: dict, start: Optional[int] = None) -> list[float]:
    """Seconds per step the trainer spent in calls to each stage, from the end of step ``start`` (default: half
    way) to the last step."""
    calls = history["call_seconds"]
    half = len(calls) // 2 if start is None else start
    return [(calls[-1].get(str(k), 0) - calls[half].get(str(k), 0)) / (len(calls) - 1 - half) for k in range(STAGES)]


def plain(args: list[str], work: Path, timeout: float = 900.0) -> dict:
    """Train examples/gpt.py (``args``) in one process, without the swarm; its history."""
    out = work / "plain.json"
    command = [sys.executable, GPT, "--single", *args, "--history", str(out)]
    subprocess.run(command, check=True, timeout=timeout, env={**os.environ, **ONE_THREAD}, capture_output=True)
    return json.loads(out.read_text())


def train_on_swarm(
    args: list[str],
    work: Path,
    run_id: str,
    env: dict,
    trainers: Sequence[Sequence[str]] = ((),),
    per_stage: int = 1,
    timeout: float = 1800.0,
) -> tuple[list[dict], list[int]]:
    """Train examples/gpt.py (``args``) on a 2-stage swarm configured by ``SWARM`` and ``env``: ``per_stage``
    serve-only peers per stage, then one drive-only trainer per entry of ``trainers`` (its extra arguments), started
    one after the other, as users would. Returns each trainer's history, and each serve peer's peak RSS."""
    paths = [work / f"{run_id}_trainer{i}.json" for i in range(len(trainers))]
    serve = {f"stage{stage}_{k}": stage for stage in range(STAGES) for k in range(per_stage)}
    with LocalSwarm([GPT], work / run_id, run_id=run_id, env={**ONE_THREAD, **SWARM, **env}) as local:
        for name, stage in serve.items():
            local.start(name, args, env={"SWARM_ROLE": "serve", "SWARM_STAGE": str(stage)})
        for i, (extra, path) in enumerate(zip(trainers, paths)):
            local.start(f"trainer{i}", [*args, *extra, "--history", str(path)], env={"SWARM_ROLE": "drive"})
        for i in range(len(trainers)):
            if (code := local.wait(f"trainer{i}", timeout=timeout)) != 0:
                logs = "".join(f"\n---- {peer.name}:\n{peer.log()[-2000:]}" for peer in local.peers.values())
                raise RuntimeError(f"trainer{i} of {run_id} exited with {code}; the peers' logs end with:{logs}")
        peaks = [peak_rss(local.peers[name].process.pid) for name in serve]
    return [json.loads(path.read_text()) for path in paths], peaks


def swarm(args: list[str], work: Path, run_id: str, delayed: bool, microbatches: Union[int, str]) -> dict:
    """Train with one serve-only peer per stage and one trainer; its history, plus the stage peers' peak RSS
    (``stage_peak_rss``)."""
    env = {"SWARM_DELAYED_UPDATES": str(delayed), "SWARM_MICROBATCHES": str(microbatches)}
    (history,), peaks = train_on_swarm(args, work, run_id, env)
    return {**history, "stage_peak_rss": peaks}


def peak_rss(pid: int) -> Optional[int]:
    """A process's peak resident memory in bytes (Linux: VmHWM), or None once it exited: a zombie has no memory
    figures left, a reaped process no entry in /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) * 1024 if found else None


def script_parser(doc: str, smoke: str) -> argparse.ArgumentParser:
    """A script's argument parser: its docstring as the help, and ``--smoke`` (a short check that the script works,
    described by ``smoke``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=smoke)
    return parser
