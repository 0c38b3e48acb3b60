"""``StageHost``: this peer's serving side, as hivemind's ``moe/server/server.py`` and Petals' ``Server`` keep theirs.

The strategy cuts the model and drives batches; the host is the peer's presence in the swarm. It joins a stage
(downloading the stage's state from the peers serving it, or restoring it from the swarm's latest checkpoint), serves
it with a :class:`~lightning_swarm.server.stage_server.StageServer` over libp2p and the direct tensor path
(:mod:`~lightning_swarm.transport`), publishes this peer's record (:mod:`~lightning_swarm.discovery`), follows the
swarm's records for events and metrics, moves to the bottleneck stage when the rebalancer says so
(:mod:`~lightning_swarm.rebalancing`), and leaves gracefully (announcing it, then answering what was already sent).
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_swarm import checkpointing, discovery, partitioning, transport
from lightning_swarm.checkpointing import STAGE_OPTIMIZERS_KEY
from lightning_swarm.discovery import Announcer, PeerRecord, PeerState
from lightning_swarm.errors import StageUnavailableError
from lightning_swarm.events import EventQueue, PeerJoined, PeerLeft, StageChanged
from lightning_swarm.logs import RateLimit
from lightning_swarm.node import SwarmNode
from lightning_swarm.optimizer import SwarmOptimizer
from lightning_swarm.partitioning import Pipeline, StageSpan
from lightning_swarm.rebalancing import JOIN_SETTLE, Move, Plan, Rebalancer, first_mover
from lightning_swarm.server.stage_server import StageServer
from lightning_swarm.settings import SwarmSettings
from lightning_swarm.stage_api import WAIT_LOG_PERIOD, Routes
from lightning_swarm.transport import DirectServer

log = logging.getLogger(__name__)

LEAVE_GRACE = 10.0  # seconds a peer leaving its stage keeps answering the requests already sent to it


@dataclass
class Stage:
    """A stage as this peer holds it: which blocks of the pipeline (``pipeline`` in the LightningModule), on this
    peer's device, and their optimizer (None: this run does not train them)."""

    span: StageSpan
    module: nn.Module
    optimizer: Optional[SwarmOptimizer]
    pipeline: Pipeline

    @property
    def index(self) -> int:
        return self.span.index

    def state_from(self, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This stage's state dict (its own keys), cut from the whole model's."""
        return checkpointing.stage_state(model_state, self.pipeline, self.span, self.module)


class StageHost:
    """Serves this peer's stage in the swarm and publishes the peer's record; moves and leaves.

    Args:
        node: this peer's DHT and libp2p daemon, started.
        settings: the peer's settings.
        layout: the run's stage count and spans (and precision), checked against the swarm's and published.
        device: where the stage computes.
        events: where swarm events go (the strategy hands them to Lightning callbacks).
        stop: set when this peer was told to leave (a signal): joining stops, no move starts.
        build_stage: the blocks of stage ``k`` and their optimizer, for a move (the strategy's cut of the model).
    """

    def __init__(
        self,
        node: SwarmNode,
        settings: SwarmSettings,
        layout: dict,
        device: torch.device,
        events: EventQueue,
        stop: threading.Event,
        build_stage: Callable[[int], Stage],
    ) -> None:
        self.node, self.settings, self.layout, self.device = node, settings, layout, device
        self.events, self.stop_requested, self.build_stage = events, stop, build_stage
        discovery.check_run_meta(node, settings.run_id, layout, ttl=max(60.0, 6 * settings.update_period))
        self.peer_id = str(node.peer_id)
        self.stage: Optional[Stage] = None
        self.server: Optional[StageServer] = None
        self.router: Optional[Routes] = None  # calls this peer's own stage without the network
        self.training = False
        self.rebalances = 0  # stage changes this peer saw (its own included)
        self._joining = False  # serving a stage whose state is still being downloaded
        self._announcer: Optional[Announcer] = None
        self._direct: Optional[DirectServer] = None  # the direct path's listener, started with the first stage served
        self._direct_address = ""  # host:port others dial for it
        self._watcher: Optional[discovery.SwarmWatcher] = None
        self._rebalancer: Optional[Rebalancer] = None
        self._pending_move: Optional[tuple[Move, Plan]] = None
        self._move_lock = threading.Lock()

    # ---- join and serve -------------------------------------------------------------------------------------------

    def announce_driver(self) -> None:
        """Publish this peer as one that only drives (serving peers wait for it while it trains)."""
        self._start_announcer()

    def serve(self, stage: Stage, saved_optimizers: Optional[dict] = None) -> None:
        """Serve ``stage``: take its current state from the swarm (or the swarm's latest checkpoint) while
        announced as joining, then answer requests. ``saved_optimizers``: stage optimizer states of the checkpoint
        given to ``fit(ckpt_path=...)``."""
        self.stage = stage
        self._load_optimizer(saved_optimizers)
        self.server = StageServer(
            self.settings.run_id,
            stage.index,
            stage.module,
            self.device,
            optimizer=stage.optimizer,
            events=self.events,
            idle_period=self.settings.matchmaking_time / 4,
            max_queue=self.settings.max_queue,
            max_request_bytes=self.settings.max_request_bytes,
            max_request_samples=self.settings.max_request_samples,
            max_activation_bytes=self.settings.max_activation_bytes,
            activation_timeout=self.settings.activation_timeout,
            checkpoint_activations=self.settings.checkpoint_activations,
            throttle=self.settings.throttle,
            policy=self.node.policy,
            precision=self.layout["precision"],
        )
        self._joining = True
        self._start_direct_path()
        self._start_announcer()  # the record stays fresh however long the download below takes
        if stage.optimizer is not None:
            self._download_state()
        if self.stop_requested.is_set():
            return  # told to leave while joining: never announced as serving, so nobody routes here
        self.node.run(self.server.add_p2p_handlers(self.node.p2p, namespace=self.settings.run_id))
        self._joining = False
        self._announcer.announce()
        span = stage.span
        log.warning(
            "Serving stage %d of %d (blocks %d..%d)", span.index, self.settings.num_stages, span.start, span.end - 1
        )
        if self.router is not None:
            self.router.local_server = self.server
            self.server.onward.routes = self.router

    def use_router(self, router: Routes) -> None:
        """Let ``router`` call this peer's own stage without the network (and follow this peer's moves), and the
        stage server hand chained requests on through it."""
        self.router = router
        router.local_server = self.server
        if self.server is not None:
            self.server.onward.routes = router

    def _start_announcer(self) -> None:
        self._announcer = Announcer(
            self.node,
            self.settings.run_id,
            lambda: self.record(PeerState.JOINING if self._joining else PeerState.SERVING),
            self.settings.update_period,
            self.layout,
        )
        self._announcer.start()

    def _start_direct_path(self) -> None:
        """Listen for direct requests (once per peer: it answers for whichever stage this peer serves)."""
        settings = self.settings
        if not settings.direct_path or settings.client_mode or self._direct is not None:  # unreachable: libp2p
            return
        host = transport.listen_host(settings.host_maddrs)
        self._direct = DirectServer(
            settings.run_id,
            lambda: None if self._joining else self.server,
            self.node.policy,
            host,
            settings.direct_port,
            settings.max_request_bytes,
        )
        port = self.node.run(self._direct.start(self.node.p2p))
        visible = self.node.visible_maddrs() if not settings.announce_maddrs else []
        announced = transport.announced_host(host, settings.announce_maddrs, visible)
        self._direct_address = f"[{announced}]:{port}" if ":" in announced else f"{announced}:{port}"
        log.info("Direct tensor path on %s:%d, announced as %s", host, port, self._direct_address)

    def _download_state(self) -> None:
        """Before serving, download the stage's state from a peer serving it: this peer's blocks are freshly
        initialised, and must not answer requests for a stage the others have trained. A failed download is
        retried while the stage has serving peers (for at most join_timeout); a stage without any is restored from
        the swarm's latest checkpoint, if there is one, and takes the epoch its dead holders' records still show."""
        stage, optimizer = self.stage.index, self.stage.optimizer
        deadline = time.monotonic() + self.settings.join_timeout
        while True:
            records = discovery.fetch_stage(self.node, self.settings.run_id, stage).values()
            live = [record for record in records if record.state == PeerState.SERVING]
            if not live:
                self._restore_from_latest_checkpoint()
                optimizer.start_as_only_holder()
                return
            log.warning("Stage %d is served by %d peer(s): downloading its current state", stage, len(live))
            with self.server.lock:
                at_swarm_epoch = optimizer.load_state_from_peers()
            if optimizer.downloaded:
                if not at_swarm_epoch:
                    log.warning("Stage %d: the state downloaded is behind the swarm's; serving will catch up", stage)
                return
            if self.stop_requested.is_set():
                return  # leaving: the caller does not serve
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Stage {stage} of run {self.settings.run_id!r}: could not download its state from the "
                    f"{len(live)} peer(s) serving it within join_timeout={self.settings.join_timeout:g}s; refusing to "
                    f"serve untrained blocks"
                )
            time.sleep(1.0)

    def _restore_from_latest_checkpoint(self) -> None:
        """A stage without live peers in a swarm that saved a checkpoint lost its peers: restore it from the
        latest checkpoint the swarm announced, if this machine can read that file."""
        found = checkpointing.find_latest(self.node, self.settings.run_id)
        if found is None:
            return  # the swarm never saved a checkpoint: the stage starts from its initialisation
        path, stage = str(found.get("path")), self.stage.index
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            stage_state = self.stage.state_from(checkpoint["state_dict"])
        except Exception as e:
            log.warning("Stage %d has no live peer and could not be restored from checkpoint %s: %r", stage, path, e)
            return
        self.load_state(stage_state)
        self._load_optimizer(checkpoint.get(STAGE_OPTIMIZERS_KEY))
        log.warning("Stage %d had no live peer: restored from checkpoint %s (step %s)", stage, path, found.get("step"))

    def _load_optimizer(self, saved_optimizers: Optional[dict]) -> None:
        """Seed the stage's optimizer from a checkpoint's stage optimizer states, if they have this stage's."""
        saved = (saved_optimizers or {}).get(self.stage.index)
        if saved is None or self.stage.optimizer is None:
            return
        self.stage.optimizer.load_state_dict(checkpointing.optimizer_state(saved))
        log.warning("Stage %d: optimizer state loaded from the checkpoint", self.stage.index)

    def wait_for_stages(self) -> None:
        """Block until every stage has a serving peer, logging which ones are missing (a driving peer, before it
        trains)."""
        settings = self.settings
        deadline, due = time.monotonic() + settings.join_timeout, RateLimit(WAIT_LOG_PERIOD)
        while True:
            missing = [k for k in range(settings.num_stages) if self.router.choose(k, 1) is None]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise StageUnavailableError(
                    f"Stages {missing} of run {settings.run_id!r} have no live peer after "
                    f"{settings.join_timeout:.0f}s: start peers that serve them (or check initial_peers)"
                )
            if due():
                log.warning("Waiting for peers to serve stage(s) %s", missing)
            for k in missing:
                self.router.refresh(k, force=True)
            self.carry_out_move()  # e.g. from a stage two newcomers took together to one nobody serves
            time.sleep(1.0)

    # ---- the stages' state ----------------------------------------------------------------------------------------

    def _serves(self, stage: int) -> bool:
        return self.server is not None and self.stage.index == stage

    def fetch_state_and_step(self, stage: int) -> tuple[dict[str, torch.Tensor], Optional[int]]:
        """The current state dict of ``stage`` (stage-local keys), from this peer (with the last optimizer step in
        it) or a live peer of the stage, and the optimizer step it is at (None: unknown)."""
        if self._serves(stage):
            return self.server.state_and_step()
        return self.router.fetch_state_and_step(stage)

    def fetch_optimizer_state(self, stage: int) -> dict[str, Any]:
        """The optimizer state dict of ``stage``, from this peer (taken between two requests) or a live peer."""
        if self._serves(stage) and self.stage.optimizer is not None:
            with self.server.lock:
                return checkpointing.copy_state(self.stage.optimizer.state_dict())
        raw = self.router.fetch_state(stage, optimizer=True)["optimizer"]
        return torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=True)

    def load_state(self, stage_state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load the stage's blocks from ``stage_state``, between two requests."""
        with self.server.lock if self.server is not None else contextlib.nullcontext():
            self.stage.module.load_state_dict(stage_state, strict=strict)

    # ---- records, the swarm's view and metrics --------------------------------------------------------------------

    def record(self, state: PeerState, stage: Optional[int] = None) -> PeerRecord:
        """This peer's record: its stage (by default, the one served), state, load, direct address, and whether
        it moves when a rebalancing plan chooses it (only while its rebalancer runs, not paused)."""
        info = self.server.info() if self.server is not None and stage is None else {}
        served = self.stage.index if self.stage is not None else None
        rebalancer = self._rebalancer
        return PeerRecord(
            self.peer_id,
            served if stage is None else stage,
            state,
            info.get("throughput", 0.0),
            info.get("queued_samples", 0),
            self.training,
            self._direct_address if self.server is not None else "",
            movable=rebalancer is not None and not rebalancer.paused.is_set(),
        )

    def set_training(self, training: bool) -> None:
        """Tell the swarm whether this peer still trains: serving peers that finished wait for it."""
        self.training = training
        if not training and self._rebalancer is not None:
            self._rebalancer.paused.set()  # about to leave: a move would only cost the swarm a download
        if self._announcer is not None:
            self._announcer.announce()  # paused first: announced as a peer that no longer moves

    def watch(self, rebalance: bool) -> None:
        """Follow the swarm's records (for events and metrics) and, if asked, rebalance this peer."""
        settings = self.settings
        self._watcher = discovery.SwarmWatcher(
            self.node, settings.run_id, settings.num_stages, settings.update_period, self._on_swarm_change
        )
        self._watcher.start()
        if rebalance:
            self._rebalancer = Rebalancer(
                self.peer_id, settings.rebalance_period, lambda: self._watcher.latest, self._request_move
            )
            self._rebalancer.start()
            if self._announcer is not None:
                self._announcer.announce()  # now a peer that moves: plans may choose it

    def _on_swarm_change(self, kind: str, peer: str, before: Optional[PeerRecord], after: Optional[PeerRecord]) -> None:
        if kind == "joined":
            self.events.emit(PeerJoined(peer, after.stage))
        elif kind == "left":
            self.events.emit(PeerLeft(peer, before.stage, "announced" if after is not None else "record expired"))
        elif peer != self.peer_id and before.stage is not None and after.stage is not None:
            self.rebalances += 1  # this peer's own moves are counted (with their reason) where they happen
            self.events.emit(StageChanged(peer, before.stage, after.stage, "seen in the swarm's records"))

    def metrics(self, local_optimizer: Optional[Any] = None) -> dict[str, float]:
        """The swarm as this peer sees it: its stage, the peers, the step (of its stage, else of its local
        optimizer), its queue, the kept forwards its stage server dropped before their backward came (past
        ``max_activation_bytes`` or ``activation_timeout``: that backward recomputed the forward), its traffic, its
        failed all-reduce rounds (of its stage's optimizer since it serves that stage, and of its local one) with
        their time, and each stage's throughput and peers."""
        view = self._watcher.latest if self._watcher is not None and self._watcher.latest is not None else []
        serving = [[r for r in stage.values() if r.state == PeerState.SERVING] for stage in view]
        peers = {r.peer_id for stage in serving for r in stage} | set(self._watcher.drivers if self._watcher else ())
        optimizer = (self.stage.optimizer if self.stage is not None else None) or local_optimizer
        stats = self.router.stats if self.router is not None else None
        info = self.server.info() if self.server is not None else None
        metrics = {
            "stage": float(-1 if self.stage is None else self.stage.index),
            "peers": float(len(peers)),
            "step": float(getattr(optimizer, "local_epoch", 0)),
            "queue": float(info["queued_samples"] if info is not None else 0),
            "dropped_forwards": float(info["dropped_forwards"] if info is not None else 0),
            "bytes_sent": float(stats.bytes_sent if stats else 0),
            "bytes_received": float(stats.bytes_received if stats else 0),
            "compression_ratio": float(stats.raw_bytes_sent / stats.bytes_sent if stats and stats.bytes_sent else 1),
            "failovers": float(stats.failovers if stats else 0),
            "rebalances": float(self.rebalances),
        }
        optimizers = [o for o in (self.stage.optimizer if self.stage is not None else None, local_optimizer) if o]
        metrics["rounds"] = float(sum(getattr(o, "rounds", 0) for o in optimizers))
        metrics["failed_rounds"] = float(sum(getattr(o, "failed_rounds", 0) for o in optimizers))
        metrics["failed_round_seconds"] = float(sum(getattr(o, "failed_round_seconds", 0.0) for o in optimizers))
        for k, stage in enumerate(serving):
            metrics[f"stage{k}_throughput"] = float(sum(r.throughput for r in stage))
            metrics[f"stage{k}_peers"] = float(len(stage))
        return metrics

    # ---- moving -----------------------------------------------------------------------------------------------------

    def _request_move(self, move: Move, plan: Plan) -> None:
        with self._move_lock:
            self._pending_move = (move, plan)

    @property
    def move_planned(self) -> bool:
        """Whether the rebalancer planned a move that was not carried out yet."""
        return self._pending_move is not None

    def carry_out_move(self) -> None:
        """On the training (or serving) thread, between steps: carry out the move the rebalancer planned, if any."""
        with self._move_lock:
            pending, self._pending_move = self._pending_move, None
        if pending is not None and not self.stop_requested.is_set():
            self._move(*pending)

    def _move(self, move: Move, plan: Plan) -> None:
        """Serve ``move.to_stage`` instead: leave the current stage gracefully, take the new stage's blocks, and
        download its parameters, optimizer state and step from a live peer of it before serving."""
        if self.server is None or self.stage.index != move.from_stage:
            return
        settings = self.settings
        try:  # fresh records: never leave a stage without a peer, nor follow a peer that just left it
            swarm = discovery.fetch_swarm(self.node, settings.run_id, settings.num_stages)
        except Exception as e:
            log.warning("Not moving to stage %d: could not read the swarm's records (%r)", move.to_stage, e)
            return
        records = swarm[move.from_stage].values()
        if not any(r.state == PeerState.SERVING and r.peer_id != self.peer_id for r in records):
            log.warning("Not moving to stage %d: no other peer serves stage %d now", move.to_stage, move.from_stage)
            return
        if not self._rebalancer.confirms(move, plan, swarm):
            log.warning("Not moving to stage %d: the swarm changed since the plan", move.to_stage)
            return
        self._rebalancer.paused.set()
        try:
            if not self._claim(move):
                return
            log.warning(
                "Rebalancing: moving from stage %d to stage %d (swarm throughput %.1f -> %.1f samples/s planned)",
                move.from_stage,
                move.to_stage,
                plan.current,
                plan.planned,
            )
            self.leave()
            partitioning.release(self.stage.module)  # keeps the blocks' shapes and their non-persistent buffers
            self.serve(self.build_stage(move.to_stage))
        finally:
            self._rebalancer.moved()
            self._rebalancer.paused.clear()
        self.rebalances += 1
        reason = f"stage {move.to_stage} is the bottleneck ({plan.current:.1f} samples/s swarm throughput)"
        self.events.emit(StageChanged(self.peer_id, move.from_stage, move.to_stage, reason, plan.gain))

    def _claim(self, move: Move) -> bool:
        """Announce this peer at ``move.to_stage`` (joining: a move, not a departure, so the record lasts until the
        new stage's server announces it), let the claims of peers that confirmed a moment apart arrive, and go only
        if this peer is the first to leave its stage (:func:`~lightning_swarm.rebalancing.first_mover`); otherwise
        withdraw the claim and keep serving."""
        settings = self.settings
        ttl = 2 * settings.update_period + LEAVE_GRACE
        self._announcer.announce(self.record(PeerState.JOINING, stage=move.to_stage), ttl=ttl)
        time.sleep(JOIN_SETTLE)
        try:
            swarm = discovery.fetch_swarm(self.node, settings.run_id, settings.num_stages)
            if first_mover(swarm, self.peer_id, move.from_stage):
                return True
            why = f"another peer leaves stage {move.from_stage} in this round"
        except Exception as e:
            why = f"could not read the swarm's records ({e!r})"
        log.warning("Not moving to stage %d: %s", move.to_stage, why)
        self._announcer.announce(self.record(PeerState.LEAVING, stage=move.to_stage), ttl=ttl)
        self._announcer.announce()
        return False

    # ---- leaving ----------------------------------------------------------------------------------------------------

    def linger(self, still_serving: Callable[[], None]) -> None:
        """Keep serving while other peers are still training, so that finishing first does not strand them (for at
        most ``linger`` seconds); ``still_serving`` runs between two looks at the swarm. It leaves once no other peer
        has shown as training for an update period: a trainer's record, refreshed every period for two, can lapse
        for a moment when a refresh comes late (or a read misses it). Leaving on one such read is the one way the
        peers of a stage could all have left a demo run while its last trainer still trained: they left about when
        they finished, and that trainer waited for their stage until its ``stage_wait_timeout`` and exited 1."""
        settings = self.settings
        deadline, due = time.monotonic() + settings.linger, RateLimit(60.0)
        quiet_since: Optional[float] = None  # since when no other peer has shown as training
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            try:
                others = discovery.training_peers(self.node, settings.run_id, settings.num_stages) - {self.peer_id}
            except Exception as e:
                log.warning("Could not read the swarm while lingering: %r", e)
                others = {"unknown"}
            if not others:
                quiet_since = time.monotonic() if quiet_since is None else quiet_since
                if time.monotonic() - quiet_since >= settings.update_period:
                    return
            else:
                quiet_since = None
                if due():
                    log.warning(
                        "Training done: serving on while %d other peer(s) train (for %.0fs more at most: linger)",
                        len(others),
                        deadline - time.monotonic(),
                    )
            still_serving()
            time.sleep(settings.update_period / 2)

    def leave(self, grace: float = LEAVE_GRACE) -> None:
        """Leave the served stage gracefully: announce it, give routers time to notice while the requests already
        sent are answered (at most ``grace`` seconds), then stop the server and the stage optimizer. With no other
        peer training there is no router to notice (every request starts at a trainer): only the requests already
        sent are answered."""
        if self._announcer is not None:
            self._announcer.stop(final=self.record(PeerState.LEAVING))
            self._announcer = None
        noticed = time.monotonic()
        if self._others_training():
            noticed += min(2.0, self.settings.update_period) + 0.5  # routers re-read records this often
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (time.monotonic() < noticed or self.server.busy()):
            time.sleep(0.1)
        with contextlib.suppress(Exception):
            self.node.run(self.server.remove_p2p_handlers(self.node.p2p, namespace=self.settings.run_id), timeout=5)
        self.server.shutdown()
        self.server = None
        if self.router is not None:
            self.router.local_server = None
        if self.stage.optimizer is not None:
            self.stage.optimizer.shutdown()
            self.stage.optimizer = None

    def _others_training(self) -> bool:
        """Whether another peer announces it is training (True when the records cannot be read)."""
        try:
            return bool(
                discovery.training_peers(self.node, self.settings.run_id, self.settings.num_stages) - {self.peer_id}
            )
        except Exception as e:
            log.warning("Could not read the swarm while leaving: %r", e)
            return True

    def stop_watching(self) -> None:
        for thread in (self._rebalancer, self._watcher):
            if thread is not None:
                thread.stop()
        self._rebalancer = self._watcher = None

    def close(self) -> None:
        """Leave the swarm: stop following it, leave the stage (or announce that this driver leaves), and stop
        the direct path."""
        self.stop_watching()
        if self.server is not None:
            self.leave()
        elif self._announcer is not None:
            self._announcer.stop(final=self.record(PeerState.LEAVING))
            self._announcer = None
        if self._direct is not None:
            with contextlib.suppress(Exception):
                self.node.run(self._direct.stop(self.node.p2p), timeout=5)
            self._direct, self._direct_address = None, ""
