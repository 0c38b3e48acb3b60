"""Swarm throughput over slow links: the 2-stage swarm of swarm_throughput.py with the bandwidth capped or latency
added, for fp32, fp16 and 8-bit activations on the wire, as a ratio of the same codec's uncapped run.

Each swarm run gets a network namespace of its own (``unshare -n``, needs root): the script starts itself there,
brings loopback up, caps it with a token bucket (``tc qdisc ... tbf``) and runs the swarm inside. Every peer of a
run talks over that one loopback, so the cap is shared by all their traffic together. The runs of one codec follow
one another (uncapped first), so that each ratio compares runs close in time on this shared machine; a run that
fails is reported as failed and the others go on. Plain single-process
training, which uses no network, runs once per size outside. netem is not available here, so latency is added in
software: with ``added_latency/`` on ``PYTHONPATH``, each stage request the trainer sends waits that long first
(see ``added_latency/sitecustomize.py``).

    python benchmarks/slow_links.py            # writes the slow_links section of benchmarks/RESULTS.md
    python benchmarks/slow_links.py --smoke    # a short check that the script works (one capped setting)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import STAGES, model_args, plain, script_parser, steady_throughput, swarm  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

CODECS = {"fp32": "none", "fp16": "float16", "8-bit": "8bit"}  # label -> SWARM_COMPRESSION
LATENCY_HOOK = Path(__file__).resolve().parent / "added_latency"
TBF = ["burst", "256kb", "latency", "50ms"]  # a burst below loopback's 64 KiB MTU would drop every packet
TARGET = 0.8  # 8-bit at 200 Mbit/s against 8-bit uncapped, at the largest size


@dataclass(frozen=True)
class Link:
    rate_mbit: int = 0  # tbf cap on the namespace's loopback; 0: none
    latency_ms: float = 0.0  # added before each stage request

    @property
    def label(self) -> str:
        cap = f"{self.rate_mbit} Mbit/s" if self.rate_mbit else "uncapped"
        return f"{cap} + {self.latency_ms:g} ms" if self.latency_ms else cap


@dataclass(frozen=True)
class Plan:
    links: dict[Link, list[str]]  # link setting -> codecs to run over it
    sizes: list[int]
    steps: int


def plan(a: argparse.Namespace) -> Plan:
    """What to run. Latency costs the same whatever the codec, so that setting runs 8-bit only. The smoke run: one
    capped setting with latency (to exercise both), 8-bit, a tiny model."""
    if a.smoke:
        return Plan({Link(a.rates[0], a.latency): ["8-bit"]}, [32], 6)
    links = {Link(): list(CODECS), Link(latency_ms=a.latency): ["8-bit"]}
    return Plan(links | {Link(rate): list(CODECS) for rate in a.rates}, a.sizes, a.steps)


def shape(link: Link) -> None:
    """Inside a fresh namespace: loopback up, capped to the link's rate, and the latency hook for the peers."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    if link.rate_mbit:
        tbf = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{link.rate_mbit}mbit", *TBF]
        subprocess.run(tbf, check=True)
    if link.latency_ms:  # LocalSwarm starts its peers with os.environ
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LATENCY_HOOK), os.environ.get("PYTHONPATH")]))
        os.environ["SLOW_LINKS_LATENCY_MS"] = str(link.latency_ms)


def measure(link: Link, codec: str, d_model: int, p: Plan, a: argparse.Namespace) -> dict:
    """Inside a fresh namespace: one swarm run over ``link``; its throughput and the bytes the trainer sent."""
    shape(link)
    os.environ["SWARM_COMPRESSION"] = CODECS[codec]  # swarm() passes os.environ on to its peers
    args = model_args(d_model, p.steps, a.batch_size, a.block_size)
    with tempfile.TemporaryDirectory(prefix="slow_links_") as tmp:
        history = swarm(args, Path(tmp), f"slow{d_model}_{CODECS[codec]}", a.delayed, a.microbatches)
    sent = history["bytes_sent"] / history["steps"]
    setup = {"steps": history["steps"], "batch_size": a.batch_size, "block_size": a.block_size}
    setup["microbatches"] = a.microbatches
    return {"swarm": steady_throughput(history), "sent": sent, "failovers": history["failovers"], "setup": setup}


def in_namespace(link: Link, codec: str, d_model: int, timeout: float = 1800) -> dict:
    """Run this script for one swarm run in a new network namespace, in its own process group; its row."""
    row = {**asdict(link), "d_model": d_model, "codec": codec, "swarm": None, "sent": None}
    with tempfile.TemporaryDirectory(prefix="slow_links_") as tmp:
        out = Path(tmp) / "row.json"
        inner = [*sys.argv[1:], "--run", str(link.rate_mbit), str(link.latency_ms), codec, str(d_model)]
        command = ["unshare", "-n", sys.executable, __file__, *inner, "--row", str(out)]
        process = subprocess.Popen(command, start_new_session=True)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop(process)
        if out.exists():
            row.update(json.loads(out.read_text()))
    speed = "failed" if row["swarm"] is None else f"{row['swarm']:6.1f} samples/s"
    print(f"{link.label:22s} | d_model {d_model:4d} | {codec:5s} | {speed}", flush=True)
    return row


def stop(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the process group (the inner run then stops its peers), SIGKILL after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            return
        os.killpg(process.pid, sig)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass


def with_ratios(rows: list[dict], plain_speed: dict[int, float]) -> list[dict]:
    """Add each row's plain throughput, its ratio to it, and its ratio to the uncapped run of the same codec."""
    uncapped = {(r["d_model"], r["codec"]): r["swarm"] for r in rows if r["rate_mbit"] == 0 and r["latency_ms"] == 0}
    for r in rows:
        reference = uncapped.get((r["d_model"], r["codec"]))
        r["plain"] = plain_speed[r["d_model"]]
        r["to_plain"] = None if r["swarm"] is None else r["swarm"] / r["plain"]
        r["to_uncapped"] = None if r["swarm"] is None or reference is None else r["swarm"] / reference
    return rows


def figures(row: dict) -> list[str]:
    """A row's samples/s, ratios and MiB sent per batch, as table cells."""
    if row["swarm"] is None:
        return ["failed", "-", "-", "-"]
    to_uncapped = "-" if row["to_uncapped"] is None else f"{row['to_uncapped']:.3f}"
    return [f"{row['swarm']:.1f}", to_uncapped, f"{row['to_plain']:.3f}", f"{row['sent'] / 2**20:.2f}"]


def write(rows: list[dict], p: Plan, a: argparse.Namespace) -> None:
    variant = f"{'delayed' if a.delayed else 'synchronous'} updates, {a.microbatches} microbatches in flight"
    lines = [
        "## Slow links",
        "",
        f"`python benchmarks/slow_links.py`{' --smoke' if a.smoke else ''}, {machine()}; GPT with 4 blocks, "
        f"batch {a.batch_size}, block {a.block_size}, {p.steps} steps, {STAGES} stages (one serve-only peer each, "
        f"a drive-only trainer), {variant}, one torch thread per process. Throughput over the second half of the "
        "trainer's steps, as a ratio of the uncapped run with the same codec and of plain single-process training "
        "(measured once per size in the same run).",
        "",
        "Each swarm run has a network namespace of its own (`unshare -n`); the runs of one codec follow one another, "
        "uncapped first. A bandwidth cap is a token bucket on that namespace's loopback "
        f"(`tc qdisc add dev lo root tbf rate <R>mbit {' '.join(TBF)}`), which all "
        "processes of the run share: requests, replies and DHT traffic of all peers together stay within R, a "
        "tighter limit than a link of R per peer. Latency is added in software: each stage request the trainer "
        "sends waits that long before it goes out (a one-way delay, once per request; each microbatch makes 4 "
        "requests one after another, forward and backward through 2 stages); that setting runs 8-bit only, as "
        "its cost does not depend on the bytes sent. The last column counts the trainer's requests, not the replies.",
    ]
    for d_model in p.sizes:
        sized = [r for r in rows if r["d_model"] == d_model]
        lines += [
            "",
            f"### d_model {d_model} (plain training: {sized[0]['plain']:.1f} samples/s)",
            "",
            *table(
                ["link", "on the wire", "samples/s", "/ uncapped", "/ plain", "trainer sends (MiB/batch)"],
                [[Link(r["rate_mbit"], r["latency_ms"]).label, r["codec"], *figures(r)] for r in sized],
            ),
        ]
    capped = [r for r in rows if (r["rate_mbit"], r["latency_ms"], r["codec"]) == (200, 0, "8-bit")]
    target = max(capped, key=lambda r: r["d_model"], default=None)
    if target is not None and target["to_uncapped"] is not None:
        ratio = target["to_uncapped"]
        verdict = "met" if ratio >= TARGET else f"missed by {TARGET - ratio:.3f}"
        goal = f"8-bit at 200 Mbit/s within {TARGET} of uncapped at d_model {target['d_model']}"
        lines += ["", f"Target: {goal}: {ratio:.3f}, {verdict}."]
    out = Path(a.out)
    update_section("slow_links", lines, out)
    save_data("slow_links", rows, out.parent / "results")


def main() -> None:
    parser = script_parser(__doc__, "tiny model, few steps, one capped setting, 8-bit")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512], help="hidden sizes (d_model)")
    parser.add_argument("--rates", type=int, nargs="+", default=[200, 50], help="bandwidth caps (Mbit/s)")
    parser.add_argument("--latency", type=float, default=50.0, help="latency added per stage request (ms)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--delayed", action="store_true", help="delayed stage updates")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--run", nargs=4, help=argparse.SUPPRESS)  # inner run: rate (Mbit/s), latency, codec, d_model
    parser.add_argument("--row", help=argparse.SUPPRESS)  # inner run: where to write its figures
    a = parser.parse_args()
    p = plan(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the runs inside stop their peers
    if a.run:  # inside the namespace
        rate, latency, codec, d_model = a.run
        Path(a.row).write_text(json.dumps(measure(Link(int(rate), float(latency)), codec, int(d_model), p, a)))
        return
    rows, plain_speed = [], {}
    for d_model in p.sizes:
        with tempfile.TemporaryDirectory(prefix="slow_links_") as tmp:
            args = model_args(d_model, p.steps, a.batch_size, a.block_size)
            plain_speed[d_model] = steady_throughput(plain(args, Path(tmp)))
        print(f"plain training, d_model {d_model}: {plain_speed[d_model]:.1f} samples/s", flush=True)
        for codec in CODECS:
            rows += [in_namespace(link, codec, d_model) for link, codecs in p.links.items() if codec in codecs]
    write(with_ratios(rows, plain_speed), p, a)


if __name__ == "__main__":
    main()
