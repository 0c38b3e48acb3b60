"""lightning-swarm: look at a live swarm, plot a run's metrics, start the local demo.

    lightning-swarm status --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3... --run-id gpt
    lightning-swarm status --watch 5            # SWARM_INITIAL_PEERS and SWARM_RUN_ID from the environment
    lightning-swarm plot lightning_logs/ -o run.png
    lightning-swarm demo                        # the same as python examples/demo.py in a checkout
    lightning-swarm arguments                   # every strategy argument and its SWARM_* variable

Exit codes: 0 success, 1 the swarm could not be reached or read (or another error, explained on stderr), 2 bad
usage, 3 the swarm was reached but no peer of the run was found.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import typing
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence

EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND = 1, 2, 3


class CLIError(Exception):
    """An error the user can act on: printed as one line on stderr, no traceback."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


# ---- status -------------------------------------------------------------------------------------------------------


@dataclass
class StageStatus:
    index: int
    peers: dict  # peer id -> discovery.PeerRecord
    step: Optional[int] = None  # the highest optimizer step (hivemind epoch) a peer of the stage reports


@dataclass
class SwarmStatus:
    run_id: str
    num_stages: int
    num_stages_source: str  # "argument", "meta" (published by the peers) or "probed" (guessed from live stages)
    stages: list = field(default_factory=list)  # StageStatus per stage
    drivers: dict = field(default_factory=dict)  # drive-only peers: peer id -> PeerRecord
    local_step: Optional[int] = None  # step of the trainers' local (embeddings, head) optimizer

    @property
    def peer_ids(self) -> set:
        return {peer for stage in self.stages for peer in stage.peers} | set(self.drivers)


def open_node(
    initial_peers: Sequence[str],
    timeout: float,
    identity_path: Optional[str] = None,
    secret_path: Optional[str] = None,
) -> Any:
    """A DHT node joined to the swarm through ``initial_peers``, able to read signed progress records.

    A private swarm's records carry an HMAC under its secret (``secret_path``); one with an allow-list admits only
    listed identities (``identity_path``, a key file whose peer id is on the list)."""
    from hivemind.dht import DHT
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import P2PDaemonError

    from lightning_swarm.node import SwarmNode

    if not initial_peers:
        raise CLIError("no initial peers: pass --initial-peers ADDRESS (or set SWARM_INITIAL_PEERS)", EXIT_USAGE)
    policy, secret = None, os.environ.get("SWARM_SECRET") or None
    if secret_path:
        try:
            with open(secret_path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise CLIError(f"cannot read the secret: {e}", EXIT_USAGE) from None
        if not secret:
            raise CLIError(f"the secret file {secret_path} is empty", EXIT_USAGE)
    if secret:
        from lightning_swarm.security import AccessPolicy

        policy = AccessPolicy.create(None, secret)
    node = SwarmNode(list(initial_peers), identity_path=identity_path, timeout=timeout, policy=policy)
    try:
        node.start(attempts=1)
        # hivemind's optimizers sign their progress records: without this validator they cannot be decoded
        add = partial(DHT._add_validators, record_validators=[RSASignatureValidator()])
        node.dht.run_coroutine(add, return_future=True).result(timeout=timeout)
    except P2PDaemonError as e:
        node.shutdown()
        reason = str(e).split(": ", 1)[-1]
        reason = re.sub(r"^(Daemon failed to start: )?\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", reason)
        raise CLIError(f"cannot reach the swarm through {', '.join(initial_peers)}: {reason}") from None
    except Exception as e:
        node.shutdown()
        raise CLIError(f"cannot join the swarm through {', '.join(initial_peers)}: {e!r}") from None
    except BaseException:  # Ctrl-C while joining
        node.shutdown()
        raise
    return node


def read_num_stages(node: Any, run_id: str) -> Optional[int]:
    """The stage count the run's peers published (the most common one, should they disagree)."""
    from lightning_swarm import discovery

    found = node.dht_get(discovery.meta_key(run_id)) or {}
    counts = Counter(
        meta["num_stages"]
        for meta in found.values()
        if isinstance(meta, dict) and isinstance(meta.get("num_stages"), int) and meta["num_stages"] > 0
    )
    return counts.most_common(1)[0][0] if counts else None


def probe_num_stages(node: Any, run_id: str, gap: int = 4, limit: int = 256) -> int:
    """Without published metadata: one more than the highest stage with a live peer (0 when none has)."""
    from lightning_swarm import discovery

    last, k = -1, 0
    while k < limit and k - last <= gap:
        if discovery.fetch_stage(node, run_id, k):
            last = k
        k += 1
    return last + 1


def read_step(node: Any, prefix: str) -> Optional[int]:
    """The highest epoch (optimizer step) any peer reports in hivemind's progress records under ``prefix``."""
    found = node.dht_get(f"{prefix}_progress") or {}
    epochs = [
        value["epoch"]
        for value in found.values()
        if isinstance(value, dict) and isinstance(value.get("epoch"), int) and not isinstance(value["epoch"], bool)
    ]
    return max(epochs) if epochs else None


def read_status(node: Any, run_id: str, num_stages: Optional[int] = None) -> SwarmStatus:
    from lightning_swarm import discovery

    source = "argument"
    if num_stages is None:
        num_stages, source = read_num_stages(node, run_id), "meta"
    if num_stages is None:
        num_stages, source = probe_num_stages(node, run_id), "probed"
    status = SwarmStatus(run_id, num_stages, source)
    for k, peers in enumerate(discovery.fetch_swarm(node, run_id, num_stages)):
        status.stages.append(StageStatus(k, peers, read_step(node, f"{run_id}_stage{k}")))
    status.drivers = discovery.fetch_stage(node, run_id, None)
    status.local_step = read_step(node, f"{run_id}_local")
    return status


def record_dict(record: Any) -> dict:
    """Every field of a PeerRecord (by name, so that fields added later appear too), JSON-friendly."""
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        out[f.name] = value.name.lower() if hasattr(value, "name") and hasattr(value, "value") else value
    return out


def status_dict(status: SwarmStatus) -> dict:
    return {
        "run_id": status.run_id,
        "num_stages": status.num_stages,
        "num_stages_source": status.num_stages_source,
        "local_step": status.local_step,
        "stages": [
            {"stage": s.index, "step": s.step, "peers": [record_dict(r) for r in s.peers.values()]}
            for s in status.stages
        ],
        "drivers": [record_dict(r) for r in status.drivers.values()],
    }


def _serving(record: Any) -> bool:
    from lightning_swarm.discovery import PeerState

    return record.state == PeerState.SERVING


def format_status(status: SwarmStatus, full_ids: bool = False) -> str:
    """The swarm as two tables: one line per stage, then one line per peer."""
    from lightning_swarm.discovery import PeerState

    def peer_name(peer_id: str) -> str:
        return peer_id if full_ids or len(peer_id) <= 20 else f"{peer_id[:8]}...{peer_id[-8:]}"

    def number(value: Optional[float], fmt: str = "{:.1f}") -> str:
        return "-" if value is None else fmt.format(value)

    # a peer moving between stages is briefly listed at both (joining the new one): count it once
    peers = len({r.peer_id for s in status.stages for r in s.peers.values() if r.state != PeerState.LEAVING})
    serving = len({r.peer_id for s in status.stages for r in s.peers.values() if _serving(r)})
    training = sum(r.training for s in status.stages for r in s.peers.values()) + sum(
        r.training for r in status.drivers.values()
    )
    stages_note = {"meta": "", "argument": "", "probed": " (guessed from live stages; pass --num-stages)"}
    lines = [
        f"run {status.run_id!r}: {_plural(status.num_stages, 'stage')}{stages_note[status.num_stages_source]}, "
        f"{_plural(peers, 'stage peer')} ({serving} serving), {len(status.drivers)} drive-only, {training} training, "
        f"trainers' step {number(status.local_step, '{}')}   ({time.strftime('%Y-%m-%d %H:%M:%S')})",
        "",
        f"{'STAGE':>5}  {'STEP':>6}  {'PEERS':>5}  {'SAMPLES/S':>9}  {'QUEUE':>5}",
    ]
    for s in status.stages:
        serving = [r for r in s.peers.values() if _serving(r)]
        throughput = sum(r.throughput for r in serving)
        queue = sum(r.queue for r in s.peers.values())
        warning = "  <- no serving peer" if not serving else ""
        lines.append(
            f"{s.index:>5}  {number(s.step, '{}'):>6}  {len(s.peers):>5}  {throughput:>9.1f}  {queue:>5}{warning}"
        )
    rows = [(s.index, r) for s in status.stages for r in sorted(s.peers.values(), key=lambda r: r.peer_id)]
    rows += [(None, r) for r in sorted(status.drivers.values(), key=lambda r: r.peer_id)]
    if rows:
        width = max(len("PEER"), *(len(peer_name(r.peer_id)) for _, r in rows))
        lines += ["", f"{'PEER':<{width}}  {'STAGE':>5}  {'STATE':<8}  {'SAMPLES/S':>9}  {'QUEUE':>5}  TRAINING"]
        for stage, r in rows:
            state = "driving" if stage is None and r.state == PeerState.SERVING else r.state.name.lower()
            served = "-" if stage is None else str(stage)
            throughput, queue = ("-", "-") if stage is None else (f"{r.throughput:.1f}", str(r.queue))
            lines.append(
                f"{peer_name(r.peer_id):<{width}}  {served:>5}  {state:<8}  {throughput:>9}  {queue:>5}  "
                f"{'yes' if r.training else 'no'}"
            )
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def cmd_status(args: argparse.Namespace) -> int:
    import json

    initial_peers = [p for item in args.initial_peers for p in re.split(r"[,\s]+", item) if p]
    if args.num_stages is not None and args.num_stages < 1:
        raise CLIError(f"--num-stages must be at least 1, got {args.num_stages}", EXIT_USAGE)
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.run_id):
        raise CLIError(f"--run-id {args.run_id!r}: use only letters, digits, '_' and '-'", EXIT_USAGE)
    node = open_node(initial_peers, args.timeout, args.identity_path, args.secret_path)
    # --watch ends with Ctrl-C after the read in progress: a KeyboardInterrupt raised wherever the main thread is
    # (inside hivemind's futures, say) can leave a lock held, and then the exit hangs
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set()) if args.watch else None
    try:
        shown = False
        while not interrupted.is_set():
            try:
                status = _read_or_explain(node, args)
            except CLIError as e:
                if not (args.watch and shown):
                    raise
                print(f"lightning-swarm: {e} (trying again in {args.watch:g}s)", file=sys.stderr, flush=True)
            else:
                text = json.dumps(status_dict(status), indent=2) if args.json else format_status(status, args.full_ids)
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\033[H\033[2J")  # clear the terminal, as watch(1) does
                print(text, flush=True)
                shown = True
                if not args.watch:
                    if not status.peer_ids:
                        message = f"no peer of run {args.run_id!r} found (is the run id right?)"
                        print(f"lightning-swarm: {message}", file=sys.stderr)
                        return EXIT_NOT_FOUND
                    return 0
            if interrupted.wait(args.watch):
                break
            if not sys.stdout.isatty():
                print(flush=True)
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        node.shutdown()


def _read_or_explain(node: Any, args: argparse.Namespace) -> SwarmStatus:
    private = args.secret_path or os.environ.get("SWARM_SECRET")
    try:
        return read_status(node, args.run_id, args.num_stages)
    except TimeoutError:
        hint = "" if private else " (if it is a private swarm, pass --secret-path)"
        raise CLIError(f"the swarm did not answer within {args.timeout:g}s{hint}") from None
    except Exception as e:  # e.g. records that do not decode: a private swarm read without its secret
        hint = "" if private else " (a private swarm? pass --secret-path)"
        raise CLIError(f"cannot read the swarm's records: {e!r}{hint}") from None


# ---- plot ---------------------------------------------------------------------------------------------------------

THROUGHPUT = re.compile(r"^swarm/stage(\d+)_throughput$")
STAGE_PEERS = re.compile(r"^swarm/stage(\d+)_peers$")
TIME_COLUMNS = ("time", "wall_time", "swarm/time", "timestamp")
EVENTS = {  # counter column: (label, colour, line style)
    "swarm/failovers": ("failover", "tab:red", "--"),
    "swarm/rebalances": ("rebalance", "tab:green", ":"),
}


def find_metrics(paths: Sequence[str]) -> list:
    """metrics.csv files: the paths given, and every metrics.csv under the directories given."""
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            inside = sorted(path.rglob("metrics.csv"))
            if not inside:
                raise CLIError(f"no metrics.csv under {path} (a Lightning CSVLogger writes one per run)")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise CLIError(f"{path}: no such file or directory")
    return found


def load_metrics(path: Path) -> dict:
    """Columns of a CSVLogger metrics.csv as lists of floats (NaN where a row has no value)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CLIError(f"cannot read {path}: {e}") from None
    if not rows:
        raise CLIError(f"{path}: no rows (is it a metrics.csv written by Lightning's CSVLogger?)")

    def number(text: Optional[str]) -> float:
        try:
            return float(text)
        except (TypeError, ValueError):
            return math.nan

    return {column: [number(row.get(column)) for row in rows] for column in rows[0] if column}


def series(columns: dict, x: list, name: str) -> tuple:
    """The (x, y) points where column ``name`` has a value."""
    pairs = [(a, b) for a, b in zip(x, columns.get(name, [])) if not (math.isnan(a) or math.isnan(b))]
    return [a for a, _ in pairs], [b for _, b in pairs]


def event_points(columns: dict, x: list, name: str) -> list:
    """x where a cumulative counter rises above every value before it."""
    xs, ys = series(columns, x, name)
    points, highest = [], None
    for a, b in zip(xs, ys):
        if highest is not None and b > highest:
            points.append(a)
        highest = b if highest is None else max(highest, b)
    return points


def stage_changes(columns: dict, x: list) -> list:
    """x where this peer's stage (``swarm/stage``) changed: a rebalance, when no rebalance counter was logged."""
    xs, ys = series(columns, x, "swarm/stage")
    return [xs[i] for i in range(1, len(ys)) if ys[i] != ys[i - 1]]


def x_axis(columns: dict, path: Path, mode: str) -> tuple:
    if mode == "step":
        if "step" not in columns:
            raise CLIError(f"{path}: no 'step' column (is it a metrics.csv written by Lightning's CSVLogger?)")
        return columns["step"], "step"
    for name in TIME_COLUMNS:
        values = [v for v in columns.get(name, []) if not math.isnan(v)]
        if values:
            start = min(values)
            return [v - start for v in columns[name]], "seconds"
    raise CLIError(f"{path}: no wall-time column ({', '.join(TIME_COLUMNS)}); use --x step")


def plot_metrics(files: Sequence[Path], out: Path, mode: str = "step") -> list:
    """Draw loss, per-stage throughput and peer counts against step (or time), events marked; returns warnings."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError("plot needs matplotlib: pip install 'lightning_swarm[plot]'") from None

    from matplotlib.ticker import MaxNLocator

    runs = [(path, load_metrics(path)) for path in files]
    labels = _run_labels(files)
    fig, (ax_loss, ax_thr, ax_peers) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    drawn = {ax_loss: False, ax_thr: False, ax_peers: False}
    styles = ("-", "--", ":", "-.")  # one per run; swarm-wide series keep one colour per stage across runs
    stage_colour = plt.get_cmap("tab10")
    events: dict = {name: [] for name in EVENTS}
    xlabel = "step"
    for i, ((path, columns), run) in enumerate(zip(runs, labels)):
        x, xlabel = x_axis(columns, path, mode)
        prefix, style = (f"{run}: " if len(runs) > 1 else ""), styles[i % len(styles)]
        for name in sorted(c for c in columns if "loss" in c and not c.startswith("swarm/")):
            xs, ys = series(columns, x, name)
            if xs:
                ax_loss.plot(xs, ys, label=prefix + name, marker="." if len(xs) < 30 else None)
                drawn[ax_loss] = True
        for pattern, ax in ((THROUGHPUT, ax_thr), (STAGE_PEERS, ax_peers)):
            stages = sorted((int(m.group(1)), c) for c in columns if (m := pattern.match(c)))
            for k, name in stages:
                xs, ys = series(columns, x, name)
                if xs:
                    ax.plot(
                        xs,
                        ys,
                        label=f"{prefix}stage {k}",
                        color=stage_colour(k % 10),
                        linestyle=style,
                        drawstyle="steps-post",
                    )
                    drawn[ax] = True
        xs, ys = series(columns, x, "swarm/peers")
        if xs:
            ax_peers.plot(
                xs, ys, label=prefix + "all peers", color="black", linestyle=style, linewidth=1, drawstyle="steps-post"
            )
            drawn[ax_peers] = True
        for name in EVENTS:
            events[name] += event_points(columns, x, name)
        if "swarm/rebalances" not in columns:
            events["swarm/rebalances"] += stage_changes(columns, x)
    for name, points in events.items():  # drawn last, so that their legend entries come last
        label, colour, style = EVENTS[name]
        for j, a in enumerate(sorted(set(points))):
            for ax in (ax_loss, ax_thr, ax_peers):
                ax.axvline(
                    a,
                    color=colour,
                    linestyle=style,
                    linewidth=1,
                    alpha=0.8,
                    label=label if ax is ax_loss and j == 0 else None,
                )
    marked = any(events.values())
    ax_peers.yaxis.set_major_locator(MaxNLocator(integer=True))

    warnings = []
    for ax, title, ylabel in (
        (ax_loss, "loss", "loss"),
        (ax_thr, "throughput per stage", "samples/s"),
        (ax_peers, "peers per stage", "peers"),
    ):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn[ax] or (ax is ax_loss and marked):
            ax.legend(loc="best", fontsize="small")
        if not drawn[ax]:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
            warnings.append(f"no {title} in the metrics")
    ax_peers.set_xlabel(xlabel)
    fig.suptitle(", ".join(labels) if len(labels) <= 3 else f"{len(labels)} runs")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return warnings


def _run_labels(files: Sequence[Path]) -> list:
    """Short names for runs: each metrics.csv's directory, relative to their common ancestor."""
    parents = [f.resolve().parent for f in files]
    if len(parents) == 1:
        return [parents[0].name or str(parents[0])]
    common = Path(os.path.commonpath(parents))
    return [str(p.relative_to(common)) if p != common else p.name for p in parents]


def cmd_plot(args: argparse.Namespace) -> int:
    files = find_metrics(args.paths)
    out = Path(args.output)
    for warning in plot_metrics(files, out, args.x):
        print(f"lightning-swarm: {warning}", file=sys.stderr)
    print(f"wrote {out} from {len(files)} metrics file(s)")
    return 0


# ---- demo ---------------------------------------------------------------------------------------------------------


def demo_candidates() -> list:
    """Where examples/demo.py may be: the checkout this package was installed from, then the current directory."""
    package = Path(__file__).resolve().parent
    return [package.parent / "examples" / "demo.py", Path.cwd() / "examples" / "demo.py"]


def cmd_demo(args: argparse.Namespace) -> int:
    found = [path for path in demo_candidates() if path.is_file()]
    if not found:
        looked = ", ".join(str(p) for p in demo_candidates())
        raise CLIError(
            "the demo runs examples/demo.py (and examples/gpt.py) from a checkout of the lightning_swarm repository; "
            f"not found (looked at {looked}): clone the repository and run lightning-swarm demo inside it"
        )
    command = [sys.executable, str(found[0]), *args.demo_args]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the demo, which stops its peers
    try:
        return subprocess.call(command)
    finally:
        signal.signal(signal.SIGINT, previous)


# ---- arguments ----------------------------------------------------------------------------------------------------


def strategy_arguments() -> list:
    """Every ``SwarmStrategy`` argument (a :class:`~lightning_swarm.settings.SwarmSettings` field): name,
    environment variable, type (as the strategy takes it), default and description."""
    from lightning_swarm import settings
    from lightning_swarm.strategy import SwarmStrategy

    try:
        hints = typing.get_type_hints(SwarmStrategy.__init__)
    except Exception:  # an annotation that does not resolve: show the field's
        hints = {}
    described = settings.descriptions()
    out = []
    for f in dataclasses.fields(settings.SwarmSettings):
        value = settings.default(f.name)
        if isinstance(value, (list, tuple, set, frozenset)):
            value = ",".join(map(str, value)) or "(empty)"
        out.append(
            {
                "name": f.name,
                "env": settings.ENV_PREFIX + f.name.upper(),
                "type": _type_name(hints.get(f.name, f.type)),
                "default": "-" if value is None else str(value),
                "description": described.get(f.name, ""),
            }
        )
    return out


def _type_name(annotation: Any) -> str:
    """``Optional[Literal['a', 'b']]`` -> ``'a' | 'b'``; ``Optional[Union[str, list[str]]]`` -> ``str | list[str]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if isinstance(annotation, type) and not args:
        return annotation.__name__
    return str(annotation).replace("typing.", "")


MARKDOWN_HEADER = """# SwarmStrategy's arguments

Every argument of `SwarmStrategy` left unset (None) is read from the environment variable `SWARM_<ARGUMENT>`,
then takes the default below. Lists (multiaddrs, peer ids) are comma separated in the environment. The same
arguments are the `init_args` of `trainer.strategy` in a LightningCLI config (see
[command_line.md](command_line.md)).

Generated from the fields of `lightning_swarm.settings.SwarmSettings` (their docstrings and defaults) by
`lightning-swarm arguments --markdown > docs/arguments.md` (run it again after changing them).
`lightning-swarm arguments` prints the same list in a terminal, and
`python examples/gpt_cli.py fit --trainer.strategy.help SwarmStrategy` shows them as LightningCLI flags.
"""


def cmd_arguments(args: argparse.Namespace) -> int:
    arguments = strategy_arguments()
    if args.markdown:
        print(MARKDOWN_HEADER)
        print("| argument | environment variable | default | meaning |")
        print("| --- | --- | --- | --- |")
        for a in arguments:
            cells = [f"`{a['name']}` ({a['type']})", f"`{a['env']}`", f"`{a['default']}`", a["description"]]
            print("| " + " | ".join(c.replace("|", "\\|").replace("``", "`") for c in cells) + " |")
        return 0
    import textwrap

    for a in arguments:
        print(f"{a['name']} ({a['type']}, default {a['default']}), env {a['env']}")
        text = a["description"].replace("``", "`")
        print(textwrap.fill(text, width=100, initial_indent="    ", subsequent_indent="    "))
    return 0


# ---- entry point ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-swarm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    status = commands.add_parser(
        "status",
        help="show the live swarm: stages, their step, and every peer with its throughput, queue and state",
        description="Join the swarm's DHT through an initial peer and print its stages and peers.",
    )
    status.add_argument(
        "--initial-peers",
        nargs="+",
        default=[os.environ["SWARM_INITIAL_PEERS"]] if os.environ.get("SWARM_INITIAL_PEERS") else [],
        metavar="MULTIADDR",
        help="multiaddrs of any live peers (space or comma separated); default: $SWARM_INITIAL_PEERS",
    )
    status.add_argument(
        "--run-id",
        default=os.environ.get("SWARM_RUN_ID") or "swarm",
        help="the swarm's run id; default: $SWARM_RUN_ID, else 'swarm'",
    )
    status.add_argument(
        "--num-stages",
        type=int,
        default=int(os.environ["SWARM_NUM_STAGES"]) if os.environ.get("SWARM_NUM_STAGES", "").isdigit() else None,
        help="stage count; default: $SWARM_NUM_STAGES, else what the run's peers published",
    )
    status.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=5.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 5) until Ctrl-C",
    )
    status.add_argument(
        "--identity-path",
        default=os.environ.get("SWARM_IDENTITY_PATH") or None,
        help="key file of an identity on a private swarm's allow-list; default: $SWARM_IDENTITY_PATH",
    )
    status.add_argument(
        "--secret-path",
        default=os.environ.get("SWARM_SECRET_PATH") or None,
        help="a private swarm's shared secret file; default: $SWARM_SECRET_PATH (or the secret in $SWARM_SECRET)",
    )
    status.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the swarm (default 15)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--full-ids", action="store_true", help="print peer ids in full")
    status.set_defaults(handler=cmd_status)

    plot = commands.add_parser(
        "plot",
        help="draw a run's loss, per-stage throughput and peers (from CSVLogger metrics.csv) to a PNG",
        description="Plot CSVLogger metrics.csv files (one per peer) with failovers and rebalances marked.",
    )
    plot.add_argument("paths", nargs="+", metavar="PATH", help="metrics.csv files, or log directories holding them")
    plot.add_argument("-o", "--output", default="swarm.png", help="the PNG to write (default swarm.png)")
    plot.add_argument("--x", choices=["step", "time"], default="step", help="x axis: step (default) or wall time")
    plot.set_defaults(handler=cmd_plot)

    demo = commands.add_parser(
        "demo",
        help="run the local demo swarm (examples/demo.py of a checkout); arguments go to the demo",
        description="Run examples/demo.py of a lightning_swarm checkout; every argument after 'demo' is passed on "
        "(lightning-swarm demo --help shows the demo's own options).",
        add_help=False,
    )
    demo.set_defaults(handler=cmd_demo, demo_args=[])

    arguments = commands.add_parser(
        "arguments",
        help="list every SwarmStrategy argument with its SWARM_* environment variable, default and meaning",
        description="Every SwarmStrategy argument; each is also read from its environment variable when not given.",
    )
    arguments.add_argument("--markdown", action="store_true", help="print a Markdown table (docs/arguments.md)")
    arguments.set_defaults(handler=cmd_arguments)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lightning_swarm")
    except Exception:
        return "unknown"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = [i for i, arg in enumerate(argv) if not arg.startswith("-")]
    demo_args = []
    if commands and argv[commands[0]] == "demo":  # everything after "demo" belongs to the demo, --help included
        argv, demo_args = argv[: commands[0] + 1], argv[commands[0] + 1 :]
    args = parser.parse_args(argv)
    if args.command == "demo":
        args.demo_args = demo_args
    # the CLI reports failures itself, in one line; the DHT process (forked later) inherits these levels
    quiet = [logging.getLogger("hivemind"), logging.getLogger("asyncio")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        return args.handler(args)
    except CLIError as e:
        print(f"lightning-swarm: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head
        return 0
    finally:
        for logger, level in zip(quiet, levels):  # main() may run inside another program (tests)
            logger.setLevel(level)


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
