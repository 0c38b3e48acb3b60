"""``SwarmSettings``: every setting of a swarm peer, in one frozen dataclass (as torchtitan configures its trainer).

:class:`~lightning_swarm.strategy.SwarmStrategy` takes the same names as arguments (LightningCLI reads its
signature) and builds its settings with :meth:`SwarmSettings.from_env`: a value given wins over the environment
variable ``SWARM_<NAME>``, which wins over the default. Each field's docstring is the argument's documentation: the
strategy's docstring, ``lightning-swarm arguments`` and docs/arguments.md are made from them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import textwrap
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, Optional, Union

from lightning_swarm.client.microbatch_tuning import Microbatches, check_microbatches
from lightning_swarm.compression import Codec, check_codec
from lightning_swarm.node import LOOPBACK_MADDRS
from lightning_swarm.server.out_of_core import OutOfCore, check_out_of_core

Role = Literal["both", "serve", "drive"]
Wiring = Literal["chain", "star"]
ENV_PREFIX = "SWARM_"
CAST = "cast"  # field metadata: turns a given value, or an environment variable's text, into the field's type


def as_list(value: Union[str, list[str]]) -> list[str]:
    """A list as given, or from comma (or space) separated text."""
    if isinstance(value, str):
        return [item.strip() for item in value.replace(" ", ",").split(",") if item.strip()]
    return list(value)


def bytes_or_auto(value: Union[int, str]) -> Optional[int]:
    """A byte count, or None for ``"auto"`` (the component picks it)."""
    return None if str(value).strip().lower() == "auto" else int(value)


def check_wiring(wiring: str) -> str:
    """``wiring`` if it is ``"chain"`` or ``"star"``, else a ``ValueError`` naming the choices."""
    if wiring not in ("chain", "star"):
        raise ValueError(f"Unknown wiring {wiring!r}: choose 'chain' or 'star'")
    return wiring


def flag(value: Union[bool, str]) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SwarmSettings:
    """How a peer joins, serves and trains in a swarm (see each field)."""

    run_id: str = field(default="swarm", metadata={CAST: str})
    """name of the swarm; peers with the same ``run_id`` train together (letters, digits, ``_``, ``-``)."""
    num_stages: int = field(default=2, metadata={CAST: int})
    """number of pipeline stages. Every peer of a run must use the same value."""
    initial_peers: list[str] = field(default_factory=list, metadata={CAST: as_list})
    """multiaddrs of any live peers (``/ip4/.../tcp/.../p2p/...``). None or empty: start a new swarm and log the
    address others join with."""
    pipeline: Optional[str] = field(default=None, metadata={CAST: str})
    """dotted path of the container of blocks to cut into stages (an ``nn.Sequential``, ``nn.ModuleList`` or
    ``nn.ModuleDict``, e.g. ``"model.model.layers"``). None: found automatically, the container whose repeated
    blocks hold the most parameters."""
    role: Role = field(default="both", metadata={CAST: str})
    """``"both"`` serves a stage and trains on this process's data; ``"serve"`` only serves (``fit`` serves
    until the process receives SIGTERM or SIGINT); ``"drive"`` only sends its batches through the swarm."""
    stage: Optional[int] = field(default=None, metadata={CAST: int})
    """the stage to serve. None: the bottleneck when this peer joins, the stage with the lowest capacity (its
    peers' summed throughput, a peer not measured yet counting as the median one; so while none is measured, the
    stage with the fewest peers), a stage without peers first."""
    target_batch_size: Optional[int] = field(default=None, metadata={CAST: int})
    """samples (summed over the swarm) after which a stage, and the local parameters, take an optimizer step.
    None: this peer's batch size, from ``datamodule.batch_size`` or else the train DataLoader's ``batch_size``."""
    compression: Codec = field(default="8bit", metadata={CAST: check_codec})
    """codec for activations and their gradients between stages: ``"8bit"`` (blockwise), ``"float16"`` or
    ``"none"``."""
    wiring: Wiring = field(default="chain", metadata={CAST: check_wiring})
    """how a microbatch crosses the stages: ``"chain"``: the trainer sends it to a peer of the first stage, each
    stage's peer sends its output on to a peer of the next (chosen as the trainer chooses: load-aware, at random;
    the last stage's is chosen by the trainer, which waits there for the output) and the trainer fetches the last
    stage's output from its peer; backward goes back the same way. The trainer's link carries one transfer each
    way per microbatch instead of one per stage. A stage's peer that cannot hand a microbatch on (it knows no live
    peer of the next stage, or cannot reach them) stops its chain: the trainer relays that microbatch, and all of
    its microbatches for ``ban_timeout`` seconds, doubled while it recurs (up to 4 times). ``"star"``: the trainer
    relays every stage boundary itself. Default ``"chain"``: across emulated hosts at 50 Mbit/s it trained at
    1.90x star's samples/s with 0.34x the bytes on the trainer's link (``benchmarks/wiring.py``)."""
    delayed_updates: Optional[bool] = field(default=None, metadata={CAST: flag})
    """a stage's all-reduce and optimizer step run in the background while its peer keeps serving with the
    previous parameters; the new ones serve from the first forward after the step finished (one step of
    staleness at most, only for work done during the step). Default: on where the stage computes on the CPU, off on
    a GPU, where the background step runs on the host and cost more than it hid (an H100, d_model 2048: 4.0
    samples/s against 6.7 with synchronous steps, measured 2026-11-23 with ``benchmarks/gpu.py``)."""
    microbatches: Microbatches = field(default="auto", metadata={CAST: check_microbatches})
    """a training batch is split into this many microbatches that travel through the stages concurrently, so
    that one trainer keeps several stages busy and transfers overlap compute (loss and gradients equal the
    unsplit batch's). Uses the largest divisor of the batch size not above it. Default ``"auto"``: measured:
    starts at two per stage (``2 * num_stages``) and climbs to the neighbouring divisor of the batch size while
    that is at least 5% faster over a few batches (where batches overlap, ``overlap_batches``, over runs of six
    batches of each count, the first two of each run not timed: a change of count unsettles the pipeline)."""
    overlap_batches: bool = field(default=True, metadata={CAST: flag})
    """when no optimizer step can follow a batch (the target batch spans more of the swarm's batches), its backward
    through the stages runs on while the next batch's forward starts, instead of the trainer waiting for it, so that
    the stages are not left idle while the trainer ends one batch and begins the next. The input gradient it brings
    back reaches the modules before the pipeline (the embedding) once the next batch's backward has left in turn,
    before that batch's optimizer call, so ``on_after_backward`` does not see those modules' gradients of a batch
    that trailed (the sums stepped on are unchanged). Only under automatic optimization, without gradient clipping
    and without ``16-mixed``'s loss scaling. The next batch's microbatches start as the backward's end where this
    peer sends both directions to one stage's queue (star wiring, one stage), so that it keeps its fair share of
    that queue. Default True: on the GPU proxy at target 128 it raised the share of the device's time spent
    computing from 0.85-0.86 to 0.89-0.92 at d_model 2048 and from 0.56-0.63 to 0.70-0.77 at 1024
    (``benchmarks/RESULTS.md``). Not yet measured on a GPU with a fitting microbatch count: on an H200 "auto"
    microbatches climbed to 8 before a fix (0.19 of plain training in ``bf16-mixed`` at d_model 2048, 0.34 with this
    off)."""
    checkpoint_activations: bool = field(default=False, metadata={CAST: flag})
    """a stage server keeps only each block's input from a training forward and recomputes the block in backward
    (activation checkpointing): memory stays flat with many microbatches in flight, for about one more forward
    of compute. Default False."""
    max_activation_bytes: Optional[int] = field(default=None, metadata={CAST: bytes_or_auto})
    """memory a stage server spends on keeping training forwards' activations until their backward arrives, so
    that backward computes no forward again (what autograd saved, counted as it saves it). Beyond it (or after
    ``activation_timeout`` seconds) the oldest are dropped and their backward recomputes: past the bound, first
    those of a caller that keeps forwards without sending their backward, then those of the caller holding the
    most. None or ``"auto"``:
    half of the GPU's free memory once the stage is loaded (peers sharing a GPU should set it), 1 GiB on the
    CPU."""
    activation_timeout: float = field(default=120.0, metadata={CAST: float})
    """seconds a stage server keeps a forward's activations. Default 120."""
    out_of_core: OutOfCore = field(default="auto", metadata={CAST: check_out_of_core})
    """serve the stage with its parameters in host memory, each block copied onto the device just before it runs
    (overlapping the previous block's compute), activations recomputed in backward and the optimizer stepping on
    the host, so that a stage larger than the device's memory can be served (see
    :mod:`~lightning_swarm.server.out_of_core`). ``"auto"``: only a stage whose parameters and gradients do not
    fit in ``device_memory_budget``. Default ``"auto"``."""
    device_memory_budget: Optional[int] = field(default=None, metadata={CAST: bytes_or_auto})
    """bytes of device memory the served stage's parameters and gradients may take; an out-of-core stage plans
    which blocks stay on the device within it. None or ``"auto"``: the GPU's free memory when the stage is
    loaded, less 20%; no limit on the CPU."""
    host_maddrs: list[str] = field(default_factory=lambda: list(LOOPBACK_MADDRS), metadata={CAST: as_list})
    """multiaddrs to listen on. Default: loopback only; use ``/ip4/0.0.0.0/tcp/<port>`` to accept peers from
    other machines."""
    announce_maddrs: list[str] = field(default_factory=list, metadata={CAST: as_list})
    """multiaddrs other peers should dial (e.g. a public IP), when they differ from host_maddrs."""
    direct_path: bool = field(default=True, metadata={CAST: flag})
    """activations and gradients travel on a direct TCP connection (ZeroMQ) between a trainer and a stage server
    instead of through libp2p's daemon: 8.6-11x libp2p's transfer rate on loopback (4-64 MiB), and end to end
    0.58-1.39x its samples per second on a shared 2-core CPU machine (the gain shows where moving activations costs
    more than computing them; benchmarks/RESULTS.md). Every connection first proves the swarm's membership over
    libp2p. Payloads are not encrypted on it: see docs/multi_machine.md. A peer whose direct
    address cannot be reached is called over libp2p. Default True."""
    direct_port: int = field(default=0, metadata={CAST: int})
    """TCP port of this peer's direct path, on the IP of ``host_maddrs`` (advertised with the IP of
    ``announce_maddrs`` when given). Default 0: any free port."""
    client_mode: bool = field(default=False, metadata={CAST: flag})
    """this peer cannot be reached by others (behind NAT or a firewall): its DHT and averagers run in hivemind's
    client mode (they only open connections) and it advertises no direct path, so that its stage is called over
    libp2p, on connections it opened. See docs/multi_machine.md. Default False."""
    identity_path: Optional[str] = field(default=None, metadata={CAST: str})
    """file holding this peer's private key, for a stable peer id (created if missing)."""
    allowed_peers: Optional[list[str]] = field(default=None, metadata={CAST: as_list})
    """peer ids (or files listing one per line) of the only peers this peer talks to: the stage servers, the DHT
    and the averagers of this peer refuse every other caller. Needs ``identity_path``, whose peer id must be on
    the list (``lightning_swarm.security.create_identity(path)`` returns it). See docs/private_swarm.md. None:
    anyone who can reach the swarm may join."""
    secret: Optional[str] = field(default=None, metadata={CAST: str})
    """a secret shared by the swarm's peers: DHT records and stage requests must carry an HMAC under it. Prefer
    ``secret_path`` (a secret given as an argument may end up in logs or configs)."""
    secret_path: Optional[str] = field(default=None, metadata={CAST: str})
    """file holding the swarm's secret (its bytes, surrounding whitespace stripped)."""
    address_file: Optional[str] = field(default=None, metadata={CAST: str})
    """if set, this peer writes its multiaddrs there (one per line) once it is reachable."""
    matchmaking_time: float = field(default=5.0, metadata={CAST: float})
    """seconds peers spend forming an all-reduce group before a step; a round without a group by then (and one
    request's timeout, at most 1 s) fails, and the peer steps with its own gradients. Default 5."""
    averaging_timeout: float = field(default=30.0, metadata={CAST: float})
    """seconds after which an all-reduce whose group formed gives up and the peer steps with its own gradients
    (also the patience of a state download). Default 30."""
    request_timeout: float = field(default=60.0, metadata={CAST: float})
    """seconds to wait for a stage's reply before trying another peer of the stage. Default 60."""
    max_retries: int = field(default=5, metadata={CAST: int})
    """attempts on other peers before a microbatch's stage is reported unavailable. Default 5."""
    stage_wait_timeout: float = field(default=300.0, metadata={CAST: float})
    """seconds a trainer waits, during training, for a stage that has no live peer at all (all left or died) to
    be served again, logging which stage it waits for, before it stops with ``StageUnavailableError``. Default
    300."""
    ban_timeout: float = field(default=15.0, metadata={CAST: float})
    """seconds a peer that failed a call is not chosen again (doubling with each failure in a row, up to 4 times
    this). Default 15."""
    update_period: float = field(default=10.0, metadata={CAST: float})
    """seconds between refreshes of this peer's DHT record. Default 10."""
    join_timeout: float = field(default=300.0, metadata={CAST: float})
    """seconds a driving peer waits for every stage to have a live peer before training. Default 300."""
    linger: float = field(default=300.0, metadata={CAST: float})
    """longest time, in seconds, a serving peer that finished training keeps serving while other peers are still
    training (so that finishing first does not strand them). Default 300."""
    max_queue: int = field(default=64, metadata={CAST: int})
    """requests a stage server keeps waiting, shared fairly between callers; beyond that it answers "busy" (held
    0.25 s for a caller already refused that second). Default 64."""
    max_request_bytes: int = field(default=256 * 2**20, metadata={CAST: int})
    """largest request a stage server accepts. Default 256 MiB."""
    max_request_samples: int = field(default=4096, metadata={CAST: int})
    """most samples a request to a stage server may claim (its first dimension); also the most samples of several
    callers' inference forwards a stage server runs together in one pass. Default 4096."""
    leave_timeout: float = field(default=60.0, metadata={CAST: float})
    """after SIGTERM or SIGINT, the longest time in seconds this peer takes to leave: it finishes the current
    step, announces it is leaving, answers the requests already sent to it and stops its helper processes; past
    this time it kills them (p2pd included) and exits with code 1. Default 60."""
    rebalance_period: float = field(default=60.0, metadata={CAST: float})
    """seconds between two rebalancing rounds, in which a serving peer may move from a stage with spare capacity
    to the bottleneck stage (see :mod:`~lightning_swarm.rebalancing`); 0 turns rebalancing off. ``stage`` is
    then only where a peer starts. Default 60."""
    throttle: float = field(default=1.0, metadata={CAST: float})
    """slow this peer's stage server down by this factor on purpose (e.g. 3: a third of its speed), to show or
    test a swarm of unequal peers on one machine. Default 1."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.run_id):
            raise ValueError(f"run_id={self.run_id!r}: use only letters, digits, '_' and '-'")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")
        if self.role not in ("both", "serve", "drive"):
            raise ValueError(f"role={self.role!r}: choose 'both', 'serve' or 'drive'")
        if self.stage is not None and not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage={self.stage} is not one of the {self.num_stages} stages")
        if not 0 <= self.direct_port < 2**16:
            raise ValueError(f"direct_port must be a TCP port (0: any free port), got {self.direct_port}")
        if self.rebalance_period < 0:
            raise ValueError(f"rebalance_period must be positive (or 0: off), got {self.rebalance_period}")
        if self.throttle < 1:
            raise ValueError(f"throttle must be at least 1 (a slowdown factor), got {self.throttle}")

    @classmethod
    def from_env(cls, **given: Any) -> SwarmSettings:
        """The settings from the values given (None: not given), else the environment variables ``SWARM_<NAME>``,
        else the defaults."""
        unknown = given.keys() - names()
        if unknown:
            raise TypeError(f"Unknown settings: {sorted(unknown)}")
        values = {}
        for f in dataclasses.fields(cls):
            value = given.get(f.name)
            if value is None:
                value = os.environ.get(ENV_PREFIX + f.name.upper()) or None
            if value is not None:
                values[f.name] = f.metadata[CAST](value)
        return cls(**values)


def names() -> set[str]:
    return {f.name for f in dataclasses.fields(SwarmSettings)}


def default(name: str) -> Any:
    """The default of setting ``name``."""
    found = next(f for f in dataclasses.fields(SwarmSettings) if f.name == name)
    return found.default_factory() if found.default is dataclasses.MISSING else found.default


@cache
def descriptions() -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), on one line."""
    body = ast.parse(textwrap.dedent(inspect.getsource(SwarmSettings))).body[0].body
    found = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            found[node.target.id] = " ".join(str(after.value.value).split())
    return found


def args_section(indent: str = "    ") -> str:
    """A Google-style ``Args:`` section documenting every setting, for the strategy's docstring (LightningCLI's
    help reads it)."""
    lines = [f"{indent}Args:"]
    for name, text in descriptions().items():
        lines += textwrap.wrap(
            f"{name}: {text}",
            width=116,
            initial_indent=indent * 2,
            subsequent_indent=indent * 3,
            break_on_hyphens=False,
        )
    return "\n".join(lines) + "\n"
