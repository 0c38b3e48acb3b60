"""``lightning-swarm status``: the live swarm's stages, their step, and every peer with its throughput, queue and
state (read from the DHT records :mod:`~lightning_swarm.discovery` names and reads)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_swarm.cli.common import EXIT_NOT_FOUND, EXIT_USAGE, CLIError


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
    from hivemind.dht.crypto import RSASignatureValidator

    from lightning_swarm.errors import JoinError
    from lightning_swarm.node import SwarmNode

    if not initial_peers:
        raise CLIError("no initial peers: pass --initial-peers ADDRESS (or set SWARM_INITIAL_PEERS)", EXIT_USAGE)
    from lightning_swarm.security import AccessPolicy, read_secret

    try:
        secret = read_secret(secret_path) if secret_path else os.environ.get("SWARM_SECRET") or None
    except (OSError, ValueError) as e:
        raise CLIError(f"cannot read the secret: {e}", EXIT_USAGE) from None
    policy = AccessPolicy.create(None, secret)
    # hivemind's optimizers sign their progress records: without this validator they cannot be decoded
    validators = [RSASignatureValidator()]
    node = SwarmNode(
        list(initial_peers), identity_path=identity_path, timeout=timeout, policy=policy, record_validators=validators
    )
    try:
        node.start(attempts=1)
    except JoinError as e:
        node.shutdown()
        hint = "" if secret else " (if it is a private swarm, pass --secret-path)"  # its peers refuse to bootstrap us
        raise CLIError(f"cannot reach the swarm through {', '.join(initial_peers)}: {e.reason}{hint}") from None
    except Exception as e:
        node.shutdown()
        raise CLIError(f"cannot join the swarm through {', '.join(initial_peers)}: {e!r}") from None
    except BaseException:  # Ctrl-C while joining
        node.shutdown()
        raise
    return node


def read_status(node: Any, run_id: str, num_stages: Optional[int] = None) -> SwarmStatus:
    from lightning_swarm import discovery

    source = "argument"
    if num_stages is None:
        num_stages, source = discovery.read_num_stages(node, run_id), "meta"
    if num_stages is None:
        num_stages, source = discovery.probe_num_stages(node, run_id), "probed"
    status = SwarmStatus(run_id, num_stages, source)
    for k, peers in enumerate(discovery.fetch_swarm(node, run_id, num_stages)):
        status.stages.append(StageStatus(k, peers, discovery.read_step(node, discovery.optimizer_prefix(run_id, k))))
    status.drivers = discovery.fetch_stage(node, run_id, None)
    status.local_step = discovery.read_step(node, discovery.optimizer_prefix(run_id, None))
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
            nat = "" if r.reachable else "  behind NAT: called over connections it opened, not the direct path"
            lines.append(
                f"{peer_name(r.peer_id):<{width}}  {served:>5}  {state:<8}  {throughput:>9}  {queue:>5}  "
                f"{'yes' if r.training else 'no':<8}{nat}".rstrip()
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


def add_parser(commands: Any) -> None:
    """Add this command to ``lightning-swarm``'s subcommands."""
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
