"""Lightning callbacks for swarm events, and :class:`SwarmMonitor`, which logs the swarm through the Trainer's loggers.

Subclass :class:`SwarmCallback` and override the hooks you need. Each receives the Trainer, the LightningModule
and one event from :mod:`lightning_swarm.events`. Hooks run on the training thread, between training steps (on a
serve-only peer: while it waits), whatever thread the event was raised on. Callbacks that are not
``SwarmCallback`` instances (``ModelCheckpoint``, ``EarlyStopping``, ...) never see these hooks.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from torchmetrics.aggregation import RunningMean

from lightning_swarm.events import Failover, PeerJoined, PeerLeft, StageChanged, StageStep, SwarmEvent


class SwarmCallback(Callback):
    """Base class for callbacks that react to swarm events."""

    def on_swarm_peer_joined(self, trainer: Trainer, pl_module: LightningModule, event: PeerJoined) -> None:
        """A peer appeared at a stage (still downloading it, maybe) or, with ``event.stage`` None, to drive batches."""

    def on_swarm_peer_left(self, trainer: Trainer, pl_module: LightningModule, event: PeerLeft) -> None:
        """A peer left the swarm: it said so, or its record expired."""

    def on_swarm_stage_changed(self, trainer: Trainer, pl_module: LightningModule, event: StageChanged) -> None:
        """A peer (this one or another) moved between stages: who, from, to, why and the predicted gain."""

    def on_swarm_stage_step(self, trainer: Trainer, pl_module: LightningModule, event: StageStep) -> None:
        """The stage this peer serves took an optimizer step."""

    def on_swarm_failover(self, trainer: Trainer, pl_module: LightningModule, event: Failover) -> None:
        """A call of this peer failed and its microbatch was retried on another peer of the stage."""


def dispatch(trainer: Trainer, events: list[SwarmEvent]) -> None:
    """Call each event's hook on every callback that has it."""
    for event in events:
        for callback in trainer.callbacks:
            hook = getattr(callback, event.hook, None)
            if callable(hook):
                hook(trainer, trainer.lightning_module, event)


class SwarmMonitor(SwarmCallback):
    """Logs the swarm's state under ``swarm/`` through the Trainer's loggers, and shows this peer's stage, the
    number of peers and the stage's step in the progress bar.

    Logged: ``swarm/stage`` (this peer's stage, -1 if it serves none), ``swarm/peers``, ``swarm/step``,
    ``swarm/stage<k>_throughput`` (samples/s summed over the stage's peers) and ``swarm/stage<k>_peers``,
    ``swarm/queue``, ``swarm/dropped_forwards`` (kept forwards this peer's stage server dropped before their
    backward, which then recomputed them), ``swarm/bytes_sent``, ``swarm/bytes_received``,
    ``swarm/compression_ratio`` (uncompressed over sent bytes), ``swarm/failovers``, ``swarm/rebalances`` (stage
    changes seen) and ``swarm/samples_per_second`` (this trainer's, a running mean over ``window`` steps).
    A peer that only serves logs at each step of its stage instead of each training batch.
    """

    PROGRESS_BAR = ("stage", "peers", "step")

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self._rate = RunningMean(window=window)
        self._last_batch_end: float = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_batch_end = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        samples = extract_batch_size(batch)
        self._rate.update(samples / max(now - self._last_batch_end, 1e-9))
        self._last_batch_end = now
        metrics = self._metrics(trainer)
        metrics["samples_per_second"] = float(self._rate.compute())
        for name, value in metrics.items():
            pl_module.log(f"swarm/{name}", value, on_step=True, on_epoch=False, prog_bar=name in self.PROGRESS_BAR)

    def on_swarm_stage_step(self, trainer: Trainer, pl_module: LightningModule, event: StageStep) -> None:
        if getattr(trainer.strategy, "role", None) != "serve":
            return  # trainers log at every batch
        metrics = {f"swarm/{name}": value for name, value in self._metrics(trainer).items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=event.epoch)

    def _metrics(self, trainer: Trainer) -> dict[str, float]:
        swarm_metrics = getattr(trainer.strategy, "swarm_metrics", None)
        if swarm_metrics is None:
            raise RuntimeError("SwarmMonitor needs Trainer(strategy='swarm')")
        return swarm_metrics()
