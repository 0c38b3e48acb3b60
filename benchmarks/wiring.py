"""Chain against star wiring, measured across emulated hosts (issue 26): every peer on a host of its own (a Linux
network namespace, tests/helpers/emulated_hosts.py; needs root), its link shaped with ``tbf`` both ways.

Three parts, each a set of runs that alternate, so that every ratio compares runs close in time on this shared
2-core machine; a run that fails is reported as failed and the others go on:

- ``chain``: 3 stages, one serve-only peer per stage and a drive-only trainer, each on a 50 Mbit/s host, trained
  with ``SWARM_WIRING=star`` (the trainer relays every stage boundary) and ``chain`` (each stage's peer sends its
  output on to the next stage's), in pairs. Per run: the trainer's samples/s and the bytes on its link (sent and
  received, from its interface's counters) per sample, both over the steps after the warm-up. The model is chosen
  so that the links, not the 2 cores, set the pace: a GPT of 3 blocks (one per stage) only 64 wide, on sequences of
  256 tokens, activations sent uncompressed (fp32: no codec work on the CPU). A block costs about 12*d^2 + T*d/2
  multiply-adds per token against 4*d bytes on the wire, so a narrow block with a moderate sequence sends the most
  per unit of compute; a batch of 32 in 8 microbatches of 4 samples is 256 KiB per boundary, 42 ms at 50 Mbit/s,
  and enough microbatches in flight to keep the 4 hops of a chain busy. With star the trainer's link carries 2
  transfers per stage each way (12 per microbatch over 3 stages), with chain 2 each way whatever the number of
  stages, the same as every stage peer's link: the ideal ratios are 3x the throughput and 1/3 of the bytes.
- ``8bit``: 2 stages, 8-bit activations, a GPT of 4 blocks 512 and 1024 wide (batch 16 of 64 tokens, as
  slow_links.py), every link shaped to 200 Mbit/s against unshaped links.
- ``nat``: the ``chain`` part's swarm with stage 1 served from behind a NAT router (in client mode: it dials the
  others, who reach it over the connections it opened), against the same server on a public host.

Parts ``8bit`` and ``nat`` use the last of ``--wirings`` (chain by default).

    python benchmarks/wiring.py                  # writes the wiring section of benchmarks/RESULTS.md
    python benchmarks/wiring.py --parts chain    # only some parts (chain, 8bit, nat)
    python benchmarks/wiring.py --smoke          # one short star/chain pair of a tiny model; prints its figures
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from harness import GPT, ONE_THREAD, SWARM, model_args, script_parser, steady_throughput  # noqa: E402
from helpers.emulated_hosts import EmulatedHosts, Host, HostSwarm, Peer  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

PARTS = ("chain", "8bit", "nat")
WIRINGS = ("star", "chain")
HISTORY_EVERY = 5  # examples/gpt.py writes its history every 5 steps
TARGETS = {"throughput": 1.8, "bytes": 0.55, "8bit": 0.8}  # chain/star at least, chain/star at most, shaped/unshaped


@dataclass(frozen=True)
class Swarm:
    """One swarm run's peers and links."""

    wiring: str  # SWARM_WIRING
    stages: int
    d_model: int
    codec: str  # SWARM_COMPRESSION
    rate_mbit: Optional[float]  # every host's link, each way; None: unshaped
    nat: bool = False  # stage 1 served from behind a NAT router, in client mode


@dataclass(frozen=True)
class Workload:
    """What the trainer trains, and which of its steps are measured."""

    n_layer: int
    batch: int
    block: int
    microbatches: int
    steps: int
    warmup: int  # steps before the measured window: a multiple of HISTORY_EVERY


@dataclass(frozen=True)
class Run:
    part: str
    pair: int  # runs of one pair follow one another; ratios compare the runs of a pair
    swarm: Swarm
    load: Workload


def plan(a: argparse.Namespace) -> list[Run]:
    """The runs, in the order they run."""
    chain_load = Workload(3, a.batch_size, a.block_size, a.microbatches, a.steps, a.warmup)
    if a.smoke:
        tiny = Workload(3, 8, 64, 2, 10, 5)
        return [Run("chain", 0, Swarm(wiring, 3, 32, "none", a.rate), tiny) for wiring in a.wirings]
    wiring, runs = a.wirings[-1], []
    for pair in range(a.pairs):
        if "chain" in a.parts:
            runs += [Run("chain", pair, Swarm(w, 3, a.d_model, "none", a.rate), chain_load) for w in a.wirings]
        if "8bit" in a.parts:
            sized = Workload(4, 16, 64, 4, a.steps_8bit, HISTORY_EVERY)
            for d_model in a.sizes:
                runs += [Run("8bit", pair, Swarm(wiring, 2, d_model, "8bit", r), sized) for r in (None, a.fast_rate)]
        if "nat" in a.parts:
            runs += [
                Run("nat", pair, Swarm(wiring, 3, a.d_model, "none", a.rate, nat), chain_load) for nat in (False, True)
            ]
    return runs


def measure(run: Run, work: Path, timeout: float) -> dict:
    """One swarm run on emulated hosts: the trainer's steady samples/s and the bytes on its link per sample, over
    the steps after the warm-up."""
    s, w = run.swarm, run.load
    args = model_args(s.d_model, w.steps, w.batch, w.block, w.n_layer)
    env = {**ONE_THREAD, **SWARM, "SWARM_NUM_STAGES": str(s.stages), "SWARM_REBALANCE_PERIOD": "0"}
    env |= {"SWARM_WIRING": s.wiring, "SWARM_COMPRESSION": s.codec, "SWARM_MICROBATCHES": str(w.microbatches)}
    record, deadline = work / "trainer.json", time.monotonic() + timeout
    with EmulatedHosts() as hosts, HostSwarm(hosts, [GPT], work, f"wiring{os.getpid()}", env) as peers:
        serve = {f"stage{k}": (args, {"SWARM_ROLE": "serve", "SWARM_STAGE": str(k)}) for k in range(s.stages)}
        nated = {"stage1"} if s.nat else set()
        for name in serve:
            if name in nated:
                hosts.add_nat(name, rate_mbit=s.rate_mbit)
            else:
                hosts.add_host(name, s.rate_mbit)
        trainer = hosts.add_host("trainer", s.rate_mbit)
        peers.start_together({name: serve[name] for name in serve if name not in nated})
        for name in nated:  # in client mode it dials the peers already there: start it once they are
            peers.start(name, serve[name][0], {**serve[name][1], "SWARM_CLIENT_MODE": "1"})
        peers.start("trainer", [*args, "--history", str(record)], {"SWARM_ROLE": "drive"})
        counts = LinkCounts(trainer)
        first = history_at(record, peers.peers["trainer"], w.warmup, deadline, counts)
        last = history_at(record, peers.peers["trainer"], w.steps, deadline, counts)
        start, end = (counts.at(last["times"][n - 1]) for n in (first["steps"], last["steps"]))
        if code := peers.wait("trainer", max(1.0, deadline - time.monotonic())):
            raise RuntimeError(f"the trainer exited with {code}:\n{peers.peers['trainer'].log()[-3000:]}")
    window = (last["steps"] - first["steps"]) * w.batch
    losses = last["losses"]
    return {
        "samples_per_s": steady_throughput(last, start=first["steps"] - 1),
        "trainer_bytes_per_sample": (end - start) / window,
        "steps": last["steps"],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "failovers": last["failovers"],
        "direct_calls": last["direct_calls"],
        "p2p_calls": last["p2p_calls"],
    }


class LinkCounts:
    """A host's link counters (:meth:`Host.link_bytes`), read on every poll, each read stamped with the time halfway
    through it. Read only once a step's end was seen, they would also count the steps that ran while the poll slept
    and the read itself took (a CI run lost more than one step of five so)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.reads: list[tuple[float, int]] = []

    def read(self) -> None:
        before = time.time()
        count = self.host.link_bytes()
        self.reads.append(((before + time.time()) / 2, count))

    def at(self, moment: float) -> float:
        """The bytes the link had carried at ``moment`` (wall-clock time), linearly between the reads around it."""
        before = [r for r in self.reads if r[0] <= moment]
        after = [r for r in self.reads if r[0] >= moment]
        if not before or not after:
            raise ValueError(f"no link count read on both sides of {moment}")
        (t0, b0), (t1, b1) = before[-1], after[0]
        return b0 if t1 == t0 else b0 + (b1 - b0) * (moment - t0) / (t1 - t0)


def history_at(path: Path, trainer: Peer, steps: int, deadline: float, counts: LinkCounts) -> dict:
    """The trainer's history once it recorded ``steps`` steps, reading the link's ``counts`` meanwhile (and once
    after, so that the end of each step recorded lies between two reads)."""
    while True:
        counts.read()
        if path.exists():
            history = json.loads(path.read_text())  # written whole, by a rename
            if history["steps"] >= steps:
                counts.read()
                return history
        if not trainer.alive():
            raise RuntimeError(f"the trainer exited with {trainer.process.returncode}:\n{trainer.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer did not reach step {steps} in time:\n{trainer.log()[-3000:]}")
        time.sleep(0.1)


def run_all(runs: list[Run], timeout: float) -> list[dict]:
    """Every run, one after another: its row (figures None and an error when it failed)."""
    rows = []
    for run in runs:
        row = {"part": run.part, "pair": run.pair, **asdict(run.swarm), "load": asdict(run.load)}
        with tempfile.TemporaryDirectory(prefix="wiring_") as tmp:
            try:
                row |= measure(run, Path(tmp), timeout)
            except Exception:  # a failed run is reported as failed; the others go on
                row |= {"samples_per_s": None, "error": traceback.format_exc()[-4000:]}
                print(row["error"], file=sys.stderr, flush=True)
        row["load_average"] = os.getloadavg()[0]
        rows.append(row)
        print(f"{describe(row)}: {figures(row)}", flush=True)
    return rows


def describe(row: dict) -> str:
    link = f"{row['rate_mbit']:g} Mbit/s" if row["rate_mbit"] else "unshaped"
    where = ", stage 1 behind NAT" if row["nat"] else ""
    return f"{row['part']} #{row['pair']}: {row['wiring']}, d_model {row['d_model']}, {row['codec']}, {link}{where}"


def figures(row: dict) -> str:
    if row["samples_per_s"] is None:
        return "failed"
    kib = row["trainer_bytes_per_sample"] / 1024
    return (
        f"{row['samples_per_s']:.2f} samples/s, {kib:.1f} KiB/sample on the trainer's link, loss {row['last_loss']:.3f}"
    )


def ratios(rows: list[dict], key: str, varies: str, base: object, other: object) -> list[Optional[float]]:
    """Per pair (and per d_model): ``key`` of the run with ``varies == other`` over the one with ``base``."""
    found = []
    for pair, d_model in sorted({(r["pair"], r["d_model"]) for r in rows}):
        of = {r[varies]: r.get(key) for r in rows if (r["pair"], r["d_model"]) == (pair, d_model)}
        found.append(of[other] / of[base] if of.get(base) and of.get(other) is not None else None)
    return found


def summary(values: list[Optional[float]]) -> str:
    """Each pair's ratio, and their median."""
    measured = [v for v in values if v is not None]
    each = ", ".join("failed" if v is None else f"{v:.2f}" for v in values)
    return f"{statistics.median(measured):.2f} (pairs: {each})" if measured else "none measured"


def verdict(values: list[Optional[float]], target: float, at_least: bool) -> str:
    measured = [v for v in values if v is not None]
    if not measured:
        return "not measured"
    median = statistics.median(measured)
    return "met" if (median >= target if at_least else median <= target) else "missed"


def cells(row: dict) -> list[str]:
    """A row's figures as table cells."""
    if row["samples_per_s"] is None:
        return ["failed", "-", "-", f"{row['load_average']:.1f}"]
    kib = f"{row['trainer_bytes_per_sample'] / 1024:.1f}"
    return [
        f"{row['samples_per_s']:.2f}",
        kib,
        f"{row['first_loss']:.2f} -> {row['last_loss']:.2f}",
        f"{row['load_average']:.1f}",
    ]


FIGURES = ["samples/s", "trainer link KiB/sample", "loss", "load"]


def write(rows: list[dict], a: argparse.Namespace, command: str, loads: tuple[float, float]) -> list[str]:
    """The section's lines (and the raw rows beside the results)."""
    lines = [
        "## Wiring: chain against star, across emulated hosts",
        "",
        f"`{command}`, {machine()}, load average {loads[0]:.1f} at the start and {loads[1]:.1f} at the end. Every "
        "peer on an emulated host of its own (a network namespace, its link shaped with tbf both ways), serve-only "
        "stage peers and a drive-only trainer, one torch thread per process, no rebalancing. Throughput and bytes "
        "over the trainer's steps after the warm-up; bytes: sent and received on the trainer's interface "
        "(activations, gradients, DHT and all). Ratios compare the runs of one pair, which ran one after the other; "
        "the figure is their median. `load` is the 1-minute load average after each run.",
    ]
    for part in PARTS:
        done = [r for r in rows if r["part"] == part]
        if done:
            lines += ["", *PART_WRITERS[part](done)]
    out = Path(a.out)
    update_section("wiring", lines, out)
    save_data("wiring", rows, out.parent / "results")
    return lines


def write_chain(rows: list[dict]) -> list[str]:
    load = rows[0]["load"]
    speed = ratios(rows, "samples_per_s", "wiring", "star", "chain")
    sent = ratios(rows, "trainer_bytes_per_sample", "wiring", "star", "chain")
    return [
        f"### Chain against star: {rows[0]['stages']} stages, {rows[0]['rate_mbit']:g} Mbit/s hosts, "
        f"{rows[0]['codec']} on the wire",
        "",
        f"GPT of {load['n_layer']} blocks, d_model {rows[0]['d_model']}, batch {load['batch']} of {load['block']} "
        f"tokens in {load['microbatches']} microbatches, {load['steps']} steps, the first {load['warmup']} not "
        "measured.",
        "",
        *table(["pair", "wiring", *FIGURES], [[str(r["pair"]), r["wiring"], *cells(r)] for r in rows]),
        "",
        f"- throughput, chain / star: {summary(speed)}; target at least {TARGETS['throughput']}: "
        f"{verdict(speed, TARGETS['throughput'], True)}",
        f"- bytes on the trainer's link per sample, chain / star: {summary(sent)}; target at most "
        f"{TARGETS['bytes']}: {verdict(sent, TARGETS['bytes'], False)}",
    ]


def write_8bit(rows: list[dict]) -> list[str]:
    load, rate = rows[0]["load"], max(r["rate_mbit"] or 0 for r in rows)
    lines = [
        f"### 8-bit at {rate:g} Mbit/s against unshaped links: 2 stages, {rows[0]['wiring']} wiring",
        "",
        f"GPT of {load['n_layer']} blocks, batch {load['batch']} of {load['block']} tokens in {load['microbatches']} "
        f"microbatches, {load['steps']} steps, the first {load['warmup']} not measured.",
        "",
        *table(
            ["pair", "d_model", "links", *FIGURES],
            [
                [
                    str(r["pair"]),
                    str(r["d_model"]),
                    f"{r['rate_mbit']:g} Mbit/s" if r["rate_mbit"] else "unshaped",
                    *cells(r),
                ]
                for r in rows
            ],
        ),
        "",
    ]
    for d_model in sorted({r["d_model"] for r in rows}):
        sized = ratios([r for r in rows if r["d_model"] == d_model], "samples_per_s", "rate_mbit", None, rate)
        lines.append(
            f"- d_model {d_model}, shaped / unshaped: {summary(sized)}; target at least {TARGETS['8bit']}: "
            f"{verdict(sized, TARGETS['8bit'], True)}"
        )
    return lines


def write_nat(rows: list[dict]) -> list[str]:
    nat = ratios(rows, "samples_per_s", "nat", False, True)
    return [
        f"### Stage 1 behind NAT: the chain part's swarm, {rows[0]['wiring']} wiring",
        "",
        "The server of stage 1 on a private host behind a masquerading router (its link to the others shaped as "
        "theirs), in client mode: it dials the peers, which reach it only over the connections it opened.",
        "",
        *table(
            ["pair", "stage 1", *FIGURES],
            [[str(r["pair"]), "behind NAT" if r["nat"] else "public", *cells(r)] for r in rows],
        ),
        "",
        f"- throughput, behind NAT / public: {summary(nat)}",
    ]


PART_WRITERS = {"chain": write_chain, "8bit": write_8bit, "nat": write_nat}


def main() -> None:
    parser = script_parser(__doc__, "one short star/chain pair of a tiny model; prints its figures")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: chain, 8bit, nat")
    parser.add_argument("--wirings", nargs="+", choices=WIRINGS, default=list(WIRINGS), help="the chain part's")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each setting, alternating")
    parser.add_argument("--rate", type=float, default=50, help="links of the chain and nat parts (Mbit/s)")
    parser.add_argument("--fast-rate", type=float, default=200, help="shaped links of the 8bit part (Mbit/s)")
    parser.add_argument("--d-model", type=int, default=64, help="of the chain and nat parts")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10, help=f"steps not measured (a multiple of {HISTORY_EVERY})")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="d_model of the 8bit part")
    parser.add_argument("--steps-8bit", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    parser.add_argument("--out", default=str(RESULTS))
    a = parser.parse_args()
    a.parts = a.parts.split(",")
    if a.warmup % HISTORY_EVERY or a.steps <= a.warmup or set(a.parts) - set(PARTS):
        parser.error(f"--warmup: a multiple of {HISTORY_EVERY} below --steps; --parts among {', '.join(PARTS)}")
    command = " ".join(["python", "benchmarks/wiring.py", *sys.argv[1:]])
    start = os.getloadavg()[0]
    rows = run_all(plan(a), a.timeout)
    print("\n".join(write(rows, a, command, (start, os.getloadavg()[0]))))


if __name__ == "__main__":
    main()
