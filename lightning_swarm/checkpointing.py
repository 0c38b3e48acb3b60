"""Complete checkpoints of a swarm: what they hold beyond Lightning's, which peer writes them, and where a stage
that lost all its peers finds the latest one.

A swarm checkpoint is an ordinary Lightning checkpoint of the whole model (the local modules and every stage,
gathered from live peers) plus, under ``STAGE_OPTIMIZERS_KEY``, each stage optimizer's state dict. One peer writes
a given path (a claim in the DHT), and each checkpoint written is announced in the DHT: Lightning writes through
:class:`SwarmCheckpointIO`, which gathers the stages only on the peer that writes.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from typing import Any, Callable, Optional, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO

from lightning_swarm import discovery, partitioning
from lightning_swarm.node import SwarmNode

log = logging.getLogger(__name__)

STAGE_OPTIMIZERS_KEY = "swarm_stage_optimizers"  # checkpoint entry: stage -> its optimizer's state dict
STAGE_STEPS_KEY = "swarm_stage_steps"  # checkpoint entry: stage -> the optimizer step its gathered state is at
CONSISTENT_KEY = "swarm_consistent_cut"  # checkpoint entry: whether every stage was gathered at the same step
LATEST_CHECKPOINT_TTL = 7 * 24 * 3600.0  # how long the swarm remembers where its latest checkpoint is


def claim(node: SwarmNode, run_id: str, filepath: str, ttl: float = 60.0, settle: float = 1.0) -> bool:
    """Whether this peer writes ``filepath``: one writer per absolute path at a time.

    The peer claims the path in the DHT (``<run_id>_checkpoints``, for ``ttl`` seconds), waits ``settle`` seconds
    for concurrent claims to land, and writes only if no peer with a smaller peer id claimed the same path within
    ``ttl``. If the DHT cannot be read, the peer writes.
    """
    key = discovery.checkpoint_claims_key(run_id)
    path_id = hashlib.sha256(os.path.abspath(filepath).encode()).hexdigest()[:16]
    me = str(node.peer_id)
    try:
        node.dht_store(key, f"{path_id}:{me}", time.time(), ttl=ttl)
        time.sleep(settle)
        claims = node.dht_get(key) or {}
    except Exception as e:
        log.warning("Could not claim checkpoint %s in the swarm (%r): writing it", filepath, e)
        return True
    claimants = sorted({str(sub).split(":", 1)[1] for sub in claims if str(sub).startswith(path_id + ":")} | {me})
    if claimants[0] != me:
        log.warning("Checkpoint %s is written by peer %s: this peer skips it", filepath, claimants[0])
        return False
    return True


def announce(node: SwarmNode, run_id: str, filepath: str, step: Optional[int]) -> None:
    """Tell the swarm where its latest checkpoint is (a stage that loses all its peers is restored from it)."""
    latest = dict(path=os.path.abspath(filepath), step=step, time=time.time())
    try:
        node.dht_store(discovery.latest_checkpoint_key(run_id), "latest", latest, ttl=LATEST_CHECKPOINT_TTL)
    except Exception as e:
        log.warning("Could not announce checkpoint %s to the swarm: %r", filepath, e)


def find_latest(node: SwarmNode, run_id: str) -> Optional[dict]:
    """The latest checkpoint the swarm announced (``path``, ``step``, ``time``), or None."""
    try:
        found = (node.dht_get(discovery.latest_checkpoint_key(run_id)) or {}).get("latest")
    except Exception as e:
        log.warning("The swarm's latest checkpoint could not be read: %r", e)
        return None
    return found if isinstance(found, dict) else None


def stage_state(
    state_dict: dict[str, torch.Tensor],
    pipeline: partitioning.Pipeline,
    span: partitioning.StageSpan,
    stage: torch.nn.Module,
) -> dict[str, torch.Tensor]:
    """The state dict of ``stage`` (its own keys) cut from the whole model's."""
    return {k: state_dict[pipeline.state_key(span, k)] for k in stage.state_dict()}


def optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """A stage optimizer's state dict without the swarm's epoch counter, which hivemind keeps in it."""
    return {**state, "state": {k: v for k, v in state["state"].items() if k != "local_epoch"}}


def copy_state(state: dict) -> dict:
    """A deep copy of an optimizer state dict (its tensors keep changing in the stage worker)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def record_stage_steps(checkpoint: dict, steps: dict[int, Optional[int]]) -> None:
    """Record in ``checkpoint`` the step each stage's gathered state is at, and whether they are all the same: stages
    step on their own, so a checkpoint gathered while the swarm trains may cut it between two steps of one stage.
    Such a checkpoint is marked and warned about; it still loads, each stage at its own step."""
    checkpoint[STAGE_STEPS_KEY] = dict(steps)
    known = {step for step in steps.values() if step is not None}
    checkpoint[CONSISTENT_KEY] = len(known) <= 1
    if len(known) > 1:
        log.warning(
            "Checkpoint of step %s: the stages were gathered at different steps (%s): a cut between steps, recorded "
            "in the checkpoint as %s=False. Save when training ends (or when the stages are idle) for a consistent one",
            checkpoint.get("global_step"),
            ", ".join(f"stage {k}: {step}" for k, step in sorted(steps.items())),
            CONSISTENT_KEY,
        )


class StageStates(Protocol):
    """Where the stages' current states come from (:class:`~lightning_swarm.server.stage_host.StageHost`)."""

    def fetch_state_and_step(self, stage: int) -> tuple[dict[str, torch.Tensor], Optional[int]]: ...

    def fetch_optimizer_state(self, stage: int) -> dict[str, Any]: ...


def add_stages(
    checkpoint: dict[str, Any],
    pipeline: partitioning.Pipeline,
    spans: list[partitioning.StageSpan],
    source: Optional[StageStates],
) -> None:
    """Complete a checkpoint whose state dict holds the local modules: add every stage's current state and, if it
    holds optimizer states, each stage optimizer's (stages whose optimizer state cannot be had are left out, with a
    warning: their optimizers restart on resume), and the step each stage's state is at (:func:`record_stage_steps`).
    ``source`` None: this peer is not in the swarm."""
    if source is None:
        raise RuntimeError(
            "The complete model is gathered from the swarm: save checkpoints while this peer is in it (during "
            "fit, e.g. with ModelCheckpoint or in on_train_end), not after fit/validate/test returned"
        )
    state, steps = checkpoint["state_dict"], {}
    for span in spans:
        stage_state, steps[span.index] = source.fetch_state_and_step(span.index)
        for key, tensor in stage_state.items():
            state[pipeline.state_key(span, key)] = tensor
    record_stage_steps(checkpoint, steps)
    if "optimizer_states" not in checkpoint:
        return
    optimizers = checkpoint[STAGE_OPTIMIZERS_KEY] = {}
    for span in spans:
        try:
            optimizers[span.index] = optimizer_state(source.fetch_optimizer_state(span.index))
        except Exception as e:
            log.warning("Checkpoint without the optimizer state of stage %d: %r", span.index, e)


class SwarmCheckpointIO(CheckpointIO):
    """Lightning's checkpoint writing for a swarm peer: every peer's ``ModelCheckpoint`` saves the complete model,
    one of them is enough.

    A path is written only by the peer that claims it (:func:`claim`; without a swarm, always), which then
    ``complete``s the checkpoint (gathers every stage, and their optimizers, from live peers: the others never
    gather), writes it with ``checkpoint_io`` and announces it (a stage that loses all its peers is restored from
    the latest). A peer removes only the checkpoints it wrote: another peer's ``ModelCheckpoint`` must not delete
    them.
    """

    def __init__(self, checkpoint_io: CheckpointIO, complete: Callable[[dict[str, Any]], None]) -> None:
        self.checkpoint_io, self.complete = checkpoint_io, complete
        self.node: Optional[SwarmNode] = None
        self.run_id, self.settle = "", 1.0
        self.written: set[str] = set()

    def join(self, node: SwarmNode, run_id: str, settle: float) -> None:
        """Claim and announce paths in this swarm from now on."""
        self.node, self.run_id, self.settle = node, run_id, settle

    def leave(self) -> None:
        self.node = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if self.node is not None and not claim(self.node, self.run_id, str(path), settle=self.settle):
            return
        self.complete(checkpoint)
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
        self.written.add(os.path.abspath(str(path)))
        if self.node is not None:
            announce(self.node, self.run_id, str(path), checkpoint.get("global_step"))

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, **kwargs: Any) -> dict[str, Any]:
        return self.checkpoint_io.load_checkpoint(path, map_location, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        if os.path.abspath(str(path)) in self.written:
            self.written.discard(os.path.abspath(str(path)))
            self.checkpoint_io.remove_checkpoint(path)

    def teardown(self) -> None:
        self.checkpoint_io.teardown()
