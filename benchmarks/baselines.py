"""The swarm against the usual alternatives, side by side in one run: plain single-process training (the ideal),
a GPipe pipeline (torch.distributed.pipelining over gloo) and hivemind data-parallel training (what
lightning-hivemind does), on the same model, data and batch.

Every configuration trains examples/gpt.py's GPT (4 blocks) on this machine, each process with one torch thread:

- plain: one process, examples/gpt.py --single;
- GPipe: 2 stage processes (rank 0: embeddings and the first half of the blocks; rank 1: the second half, final
  norm, head and loss; the swarm's split), ``ScheduleGPipe`` with the same microbatches, AdamW on each stage;
- hivemind: 2 peers each holding the whole model, AdamW wrapped in ``hivemind.Optimizer`` with a target batch of
  both peers' batches (an all-reduce every step), the swarm's matchmaking and averaging timeouts;
- swarm: 2 serve-only stage peers and a drive-only trainer (benchmarks/swarm_throughput.py), same microbatches.

Throughput is measured over the second half of the steps (after start-up and warm-up); for hivemind, over the
second half of both peers' steps merged into one stream (samples of both peers together). Everything listens on
loopback only.

    python benchmarks/baselines.py                          # writes benchmarks/RESULTS.md, results/baselines.json
    python benchmarks/baselines.py --smoke --out /tmp/r.md  # a minute-long check that the script works
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hivemind.dht import DHT
from hivemind.optim import Optimizer
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpt import GPT, CharDataModule  # noqa: E402
from harness import ONE_THREAD, STAGES, SWARM, model_args, plain, script_parser, steady_throughput, swarm  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

from lightning_swarm.optimizer import hivemind_tuning  # noqa: E402

WORKER_ENV = {
    **ONE_THREAD,
    "GLOO_SOCKET_IFNAME": "lo",  # otherwise gloo listens on the address the host name resolves to
    "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
    "PYTHONUNBUFFERED": "1",
}
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PEERS = 2  # processes of the GPipe and hivemind baselines
MATCHMAKING_TIME = float(SWARM["SWARM_MATCHMAKING_TIME"])
AVERAGING_TIMEOUT = float(SWARM["SWARM_AVERAGING_TIMEOUT"])
TIMEOUT = 900.0  # seconds, for one baseline's processes and for every wait inside them
METHODS = [  # (key, column label)
    ("gpipe", "GPipe, 2 stages"),
    ("hivemind", "hivemind data-parallel, 2 peers"),
    ("swarm", "swarm, 2 stages"),
]


class FirstStage(nn.Module):
    """Rank 0 of the GPipe pipeline: token and position embeddings, then the first blocks."""

    def __init__(self, gpt: GPT, blocks: nn.Sequential) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.blocks = gpt.tok_emb, gpt.pos_emb, blocks

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.blocks(self.tok_emb(idx) + self.pos_emb(pos))


class LastStage(nn.Module):
    """Rank 1 of the GPipe pipeline: the last blocks, final norm and head (the loss is the schedule's)."""

    def __init__(self, gpt: GPT, blocks: nn.Sequential) -> None:
        super().__init__()
        self.blocks, self.ln_f, self.head = blocks, gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(x)))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT.loss's loss, from the logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Poll ``condition`` until it holds; every wait in this benchmark ends."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f}s")
        time.sleep(0.1)


def barrier(directory: Path, name: str, rank: int) -> None:
    """Wait until every peer reached this point: hivemind peers start and leave together."""
    (directory / f"{name}.{rank}").touch()
    wait_until(lambda: all((directory / f"{name}.{r}").exists() for r in range(PEERS)), f"barrier {name}")


def gpipe(a: argparse.Namespace, model: GPT, batches: list, record: Callable[[float, int], None]) -> dict:
    """Train one stage of a 2-stage GPipe pipeline; rank 1 computes the loss."""
    dist.init_process_group(
        "gloo", init_method=a.rendezvous, rank=a.rank, world_size=PEERS, timeout=timedelta(seconds=TIMEOUT)
    )
    try:
        half = len(model.blocks) // 2
        last = a.rank == PEERS - 1
        part = LastStage(model, model.blocks[half:]) if last else FirstStage(model, model.blocks[:half])
        stage = PipelineStage(part, a.rank, PEERS, torch.device("cpu"))
        # every rank needs the loss_fn: without it, a schedule runs forward only (and rank 1 waits forever)
        schedule = ScheduleGPipe(stage, a.microbatches, loss_fn=cross_entropy)
        # gpt.py's optimizer over the whole model: the other stage's parameters get no gradient, AdamW skips them
        optimizer = model.configure_optimizers()
        for x, y in batches:
            optimizer.zero_grad()
            losses: list[torch.Tensor] = []
            if last:
                schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                schedule.step(x)
            optimizer.step()
            record(float(torch.stack(losses).mean()) if losses else float("nan"), len(x))
    finally:
        dist.destroy_process_group()
    return {"optimizer_steps": len(batches)}


def hivemind_peer(a: argparse.Namespace, model: GPT, batches: list, record: Callable[[float, int], None]) -> dict:
    """Train the whole model on this peer's data; hivemind.Optimizer all-reduces once both peers' batches are in.
    Returns the number of optimizer steps taken (several local batches per step if peers miss each other)."""
    directory = Path(a.rendezvous)
    maddrs = directory / "maddrs"
    if a.rank == 0:
        dht = DHT(start=True, host_maddrs=LOOPBACK)
        (directory / "maddrs.tmp").write_text("\n".join(str(m) for m in dht.get_visible_maddrs()))
        (directory / "maddrs.tmp").replace(maddrs)
    else:
        wait_until(maddrs.exists, "DHT address of peer 0")
        dht = DHT(initial_peers=maddrs.read_text().split(), start=True, host_maddrs=LOOPBACK)
    # hivemind.Optimizer's state averager, a process, cannot be pickled as forkserver (Python 3.14's default start
    # method on Linux) needs to start it; the swarm's own averagers start by fork (lightning_swarm/optimizer.py)
    multiprocessing.set_start_method("fork", force=True)
    optimizer = Optimizer(
        dht=dht,
        run_id="baseline",
        target_batch_size=PEERS * a.batch_size,
        batch_size_per_step=a.batch_size,
        optimizer=model.configure_optimizers(),
        **hivemind_tuning(MATCHMAKING_TIME, AVERAGING_TIMEOUT),  # as the swarm's stage optimizers
    )
    barrier(directory, "start", a.rank)
    for x, y in batches:
        loss = model.loss((x, y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record(float(loss), len(x))
    barrier(directory, "end", a.rank)  # nobody leaves while the other may still average with it
    steps = optimizer.local_epoch
    optimizer.shutdown()
    dht.shutdown()
    return {"optimizer_steps": steps}


def worker(argv: list[str]) -> None:
    """One process of a baseline: builds gpt.py's model and data as plain training does, trains, writes its history."""
    parser = argparse.ArgumentParser(prog="baselines.py worker")
    parser.add_argument("--kind", choices=["gpipe", "hivemind"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--rendezvous", required=True, help="gpipe: init_method URL; hivemind: a shared directory")
    parser.add_argument("--history", required=True)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--d-model", type=int, required=True)
    parser.add_argument("--n-layer", type=int, required=True)
    parser.add_argument("--n-head", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    a = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the initialisation of plain training and of every swarm peer
    data_seed = a.rank if a.kind == "hivemind" else 0  # data-parallel peers read different batches
    dm = CharDataModule(block_size=a.block_size, batch_size=a.batch_size, seed=data_seed)
    model = GPT(dm.vocab_size, a.block_size, a.d_model, a.n_layer, a.n_head)
    batches = list(itertools.islice(dm.train_dataloader(), a.max_steps))
    history: dict = {"times": [], "losses": [], "samples": 0}

    def record(loss: float, samples: int) -> None:
        history["times"].append(time.time())
        history["losses"].append(loss)
        history["samples"] += samples

    history.update((gpipe if a.kind == "gpipe" else hivemind_peer)(a, model, batches, record))
    Path(a.history).write_text(json.dumps(history))


def run_workers(kind: str, args: list[str], work: Path, microbatches: int) -> list[dict]:
    """Run the baseline's processes, each in its own process group (stopped at the end whatever happens)."""
    if kind == "gpipe":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rendezvous = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    else:
        rendezvous = tempfile.mkdtemp(prefix=kind, dir=work)
    paths = [work / f"{kind}{rank}.json" for rank in range(PEERS)]
    logs = [work / f"{kind}{rank}.log" for rank in range(PEERS)]
    processes: list[subprocess.Popen] = []
    try:
        for rank in range(PEERS):
            command = [sys.executable, __file__, "worker", "--kind", kind, "--rank", str(rank)]
            command += ["--rendezvous", rendezvous, "--history", str(paths[rank]), "--microbatches", str(microbatches)]
            with open(logs[rank], "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [*command, *args],
                        env={**os.environ, **WORKER_ENV},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )

        def finished() -> bool:
            for rank, process in enumerate(processes):
                if process.poll() not in (None, 0):
                    tail = logs[rank].read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{kind} rank {rank} exited with {process.returncode}:\n{tail}")
            return all(process.returncode == 0 for process in processes)

        wait_until(finished, f"end of the {kind} run")
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # also its DHT, averager and p2pd processes
            except ProcessLookupError:
                pass
            process.wait(timeout=30)
    return [json.loads(path.read_text()) for path in paths]


def merge(histories: list[dict]) -> dict:
    """The peers' steps as one stream, whose steady_throughput is that of all peers together; peer 0's losses and
    optimizer steps (several local batches per step when peers miss each other)."""
    times = sorted(t for history in histories for t in history["times"])
    samples = sum(history["samples"] for history in histories)
    return {**histories[0], "times": times, "samples": samples}


def train(method: str, args: list[str], work: Path, a: argparse.Namespace, run_id: str) -> dict:
    """Train with one method; its history (GPipe: the last stage's, which has the loss; hivemind: both peers')."""
    if method == "plain":
        return plain(args, work)
    if method == "gpipe":
        return run_workers("gpipe", args, work, a.microbatches)[-1]
    if method == "hivemind":
        return merge(run_workers("hivemind", args, work, a.microbatches))
    return swarm(args, work, run_id, delayed=a.delayed, microbatches=a.microbatches)


def main() -> None:
    parser = script_parser(__doc__, "tiny sizes and a few steps, to check the script")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512], help="hidden sizes (d_model)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4, help="for GPipe and the swarm")
    parser.add_argument("--delayed", action="store_true", help="the swarm with delayed updates (GPipe has none)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file; the JSON goes to results/ beside it")
    a = parser.parse_args()
    if a.smoke and a.out == RESULTS:
        parser.error("--smoke needs --out: smoke figures never replace benchmarks/RESULTS.md")
    sizes, steps = ([32], 6) if a.smoke else (a.sizes, a.steps)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the finally clauses stop every process group

    rows = []
    with tempfile.TemporaryDirectory(prefix="baselines_") as tmp:
        work = Path(tmp)
        for d_model in sizes:
            args = model_args(d_model, steps, a.batch_size, a.block_size)
            row: dict = {"d_model": d_model, "final loss": {}}  # final losses: every method trains the model alike
            for key in ["plain", *(key for key, _ in METHODS)]:
                history = train(key, args, work, a, f"baselines{d_model}")
                row[key] = steady_throughput(history)
                row["final loss"][key] = history["losses"][-1]
                if "optimizer_steps" in history:
                    row[f"{key} optimizer steps"] = history["optimizer_steps"]
                print(
                    f"d_model {d_model:4d} | {key:8s} | {row[key]:7.1f} samples/s, "
                    f"ratio to plain {row[key] / row['plain']:.3f}, final loss {history['losses'][-1]:.3f}",
                    flush=True,
                )
            rows.append(row)
    write(rows, a, steps)
    save_data("baselines", rows, a.out.parent / "results")


def write(rows: list[dict], a: argparse.Namespace, steps: int) -> None:
    """The results section: throughput of each method as a ratio of plain training measured in the same run."""
    swarm_setting = f"{'delayed' if a.delayed else 'synchronous'} updates, {a.microbatches} microbatches"
    lines = [
        "## Baselines",
        "",
        f"`python benchmarks/baselines.py{' --smoke' if a.smoke else ''}{' --delayed' if a.delayed else ''}`, "
        f"{machine()}; GPT with 4 blocks, batch {a.batch_size}, block {a.block_size}, {steps} steps, AdamW, one "
        f"torch thread per process, all processes on this machine (loopback). GPipe: {PEERS} stage processes over "
        f"gloo, {a.microbatches} microbatches. hivemind: {PEERS} data-parallel peers, target batch "
        f"{PEERS * a.batch_size}, uncompressed all-reduce of gradients (and parameters, in the background: hivemind's "
        f"defaults). Swarm: {STAGES} serve-only stage peers and a drive-only "
        f"trainer (3 processes), 8-bit compression, {swarm_setting}.",
        "",
        *table(
            ["d_model", "plain (samples/s)", *(label for _, label in METHODS)],
            [
                [str(row["d_model"]), f"{row['plain']:.1f}"]
                + [f"{row[key] / row['plain']:.3f} ({row[key]:.1f}/s)" for key, _ in METHODS]
                for row in rows
            ],
        ),
    ]
    update_section("baselines", lines, a.out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        main()
