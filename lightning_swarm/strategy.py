"""``SwarmStrategy``: SWARM parallelism as a Lightning strategy.

This file is the table of contents. Each step of SWARM lives in its own module:

- :mod:`~lightning_swarm.node`: the peer's DHT and libp2p daemon;
- :mod:`~lightning_swarm.partitioning`: cutting the pipeline into stages;
- :mod:`~lightning_swarm.discovery`: who serves which stage (DHT records);
- :mod:`~lightning_swarm.server.stage_server`: serving a stage's forward and backward;
- :mod:`~lightning_swarm.optimizer`: per-stage and local optimizers that all-reduce at the target batch size;
- :mod:`~lightning_swarm.client.routing`: stochastic wiring with failover;
- :mod:`~lightning_swarm.client.remote_pipeline`: the module that replaces the pipeline in ``training_step``;
- :mod:`~lightning_swarm.compression`: 8-bit activations and gradients on the wire;
- :mod:`~lightning_swarm.rebalancing`: peers move from stages with spare capacity to the bottleneck;
- :mod:`~lightning_swarm.events` and :mod:`~lightning_swarm.callbacks`: swarm events for Lightning callbacks;
- :mod:`~lightning_swarm.checkpointing`: complete checkpoints (stage optimizers, one writer, the latest one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import random
import threading
import time
from functools import partial
from typing import Any, Callable, Generator, Literal, Optional, TypeVar, Union

import torch
from lightning.fabric.utilities.init import _materialize_meta_tensors
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_swarm import checkpointing, discovery, partitioning, rebalancing, security, settings
from lightning_swarm.callbacks import dispatch
from lightning_swarm.checkpointing import STAGE_OPTIMIZERS_KEY, SwarmCheckpointIO
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.client.routing import StageRouter
from lightning_swarm.compression import Codec
from lightning_swarm.errors import StageUnavailableError
from lightning_swarm.events import EventQueue
from lightning_swarm.node import SwarmNode
from lightning_swarm.optimizer import SwarmOptimizer, restrict_to, swarm_optimizer
from lightning_swarm.precision import check_precision
from lightning_swarm.server.stage_host import Stage, StageHost
from lightning_swarm.settings import Role, SwarmSettings
from lightning_swarm.signals import SignalGuard

log = logging.getLogger(__name__)
T = TypeVar("T")


class SwarmStrategy(Strategy):
    """Train a LightningModule across a swarm of unreliable peers with SWARM parallelism.

    Every process started with this strategy joins the swarm named ``run_id``. The LightningModule's pipeline (an
    ``nn.Sequential`` of blocks) is cut into ``num_stages`` stages of balanced parameter count; each peer serves
    one stage and, by default, also drives its own batches through the swarm. Modules outside the pipeline stay
    local and are trained data-parallel across the driving peers.

    Every argument is a :class:`~lightning_swarm.settings.SwarmSettings` field (``self.settings``); one left as
    ``None`` is read from the environment variable ``SWARM_<ARGUMENT>`` in upper case (``SWARM_RUN_ID``,
    ``SWARM_INITIAL_PEERS``, ``SWARM_NUM_STAGES``, ``SWARM_ROLE``, ...), so that ``Trainer(strategy="swarm")`` can
    be configured from the shell. Lists are comma separated.

    """

    strategy_name = "swarm"

    def __init__(
        self,
        run_id: Optional[str] = None,
        num_stages: Optional[int] = None,
        initial_peers: Optional[Union[str, list[str]]] = None,
        pipeline: Optional[str] = None,
        role: Optional[Role] = None,
        stage: Optional[int] = None,
        target_batch_size: Optional[int] = None,
        compression: Optional[Codec] = None,
        delayed_updates: Optional[bool] = None,
        microbatches: Optional[Union[int, Literal["auto"]]] = None,
        checkpoint_activations: Optional[bool] = None,
        max_activation_bytes: Optional[Union[int, Literal["auto"]]] = None,
        activation_timeout: Optional[float] = None,
        host_maddrs: Optional[Union[str, list[str]]] = None,
        announce_maddrs: Optional[Union[str, list[str]]] = None,
        direct_path: Optional[bool] = None,
        direct_port: Optional[int] = None,
        identity_path: Optional[str] = None,
        allowed_peers: Optional[Union[str, list[str]]] = None,
        secret: Optional[str] = None,
        secret_path: Optional[str] = None,
        address_file: Optional[str] = None,
        matchmaking_time: Optional[float] = None,
        averaging_timeout: Optional[float] = None,
        request_timeout: Optional[float] = None,
        max_retries: Optional[int] = None,
        stage_wait_timeout: Optional[float] = None,
        ban_timeout: Optional[float] = None,
        update_period: Optional[float] = None,
        join_timeout: Optional[float] = None,
        linger: Optional[float] = None,
        max_queue: Optional[int] = None,
        max_request_bytes: Optional[int] = None,
        leave_timeout: Optional[float] = None,
        rebalance_period: Optional[float] = None,
        throttle: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.settings = SwarmSettings.from_env(**{k: v for k, v in locals().items() if k in settings.names()})
        self.parallel_devices: Optional[list[torch.device]] = None  # filled in by Lightning's connector

        self.node: Optional[SwarmNode] = None
        self.router: Optional[StageRouter] = None
        self.host: Optional[StageHost] = None  # the serving side, from setup to teardown
        self.events = EventQueue()
        self._stage: Optional[Stage] = None  # the blocks this peer serves, kept across runs
        self._spans: list[partitioning.StageSpan] = []
        self._pipeline_name: Optional[str] = None
        self._blueprint: Optional[nn.Sequential] = None  # the whole pipeline, blocks of other stages on meta
        self._batch_size: Optional[int] = None
        self._checkpoint_stage_optimizers: Optional[dict] = None  # from fit(ckpt_path=...), for the stage served
        self._stop_requested = threading.Event()  # set by a signal: finish the step, then leave
        self._signals = SignalGuard(self._stop_requested, self.leave_timeout)

    def __getattr__(self, name: str) -> Any:
        """The settings read as the strategy's attributes (``strategy.run_id``)."""
        found = self.__dict__.get("settings")
        if found is not None and name in settings.names():
            return getattr(found, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="SWARM parallelism over a swarm of unreliable peers"
        )

    # ---- what Lightning asks of every strategy ----------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return 0  # every peer is an independent trainer

    @property
    def is_global_zero(self) -> bool:
        return True

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # accumulation towards target_batch_size happens in the swarm optimizers

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def barrier(self, name: Optional[str] = None) -> None:
        pass

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    # ---- lifecycle ------------------------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        super().setup_environment()
        self._signals.install()
        policy = security.peer_policy(self.allowed_peers, self.secret, self.secret_path, self.identity_path)
        self.node = SwarmNode(
            self.initial_peers, self.host_maddrs, self.announce_maddrs, self.identity_path, policy=policy
        ).start()
        self._signals.daemon_pid = self.node.daemon_pid
        if not isinstance(self.checkpoint_io, SwarmCheckpointIO):  # Lightning's default, or the user's plugin
            self.checkpoint_io = SwarmCheckpointIO(self.checkpoint_io, self._complete_checkpoint)
        self.checkpoint_io.join(self.node, self.run_id, settle=min(1.0, self.update_period))
        addresses = self.node.visible_maddrs()
        if self.address_file:
            with open(self.address_file + ".tmp", "w") as f:
                f.write("\n".join(addresses) + "\n")
            os.replace(self.address_file + ".tmp", self.address_file)
        joined = "joined" if self.initial_peers else "started"
        log.warning(
            "Swarm %r %s. Other peers join with:\n  SWARM_INITIAL_PEERS=%s", self.run_id, joined, ",".join(addresses)
        )

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds the model on the meta device: the peer then allocates only
        the stage it serves and the local modules, initialised by their ``reset_parameters()`` (a peer joining a live
        swarm downloads its stage's trained state). Otherwise tensors are created on this peer's device."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Blocks created in ``configure_model`` start on the meta device: a peer allocates only its own stage."""
        if is_overridden("configure_model", self.lightning_module):
            with torch.device("meta"):
                yield
        else:
            yield

    def setup(self, trainer: Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "SwarmStrategy accumulates gradients towards target_batch_size: leave accumulate_grad_batches=1"
            )
        check_precision(self.precision_plugin.precision)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._partition_and_serve(trainer, fitting)
        super().setup(trainer)
        if fitting and self.role != "serve":
            self._wrap_local_optimizer(trainer)
        if self.role == "drive":
            self.host.announce_driver()
        if self.role != "serve":
            self._wait_for_stages()
        if fitting and self.role == "serve":
            self._serve_until_stopped(trainer)

    @property
    def served_stage(self) -> Optional[int]:
        """The stage this peer serves (None: it only drives)."""
        return None if self._stage is None else self._stage.index

    def on_train_start(self) -> None:
        self.host.set_training(True)

    def on_train_end(self) -> None:
        self._service()
        self.host.set_training(False)

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_size = extract_batch_size(batch)
        self._service()
        if self._stop_requested.is_set():
            self.lightning_module.trainer.should_stop = True

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return super().optimizer_step(optimizer, closure, model, batch_size=self._batch_size, **kwargs)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load a checkpoint (``fit(ckpt_path=...)``): every stage this peer serves is seeded from it.

        Lightning restores the checkpoint before ``setup``, while the whole pipeline is still in place: the served
        stage is then cut from the checkpoint's weights. Blocks built on the meta device (``configure_model``) take
        the checkpoint's tensors. A peer that joins a live swarm still downloads its stage's current state from the
        peers serving it, which wins over the checkpoint. After a first ``fit`` (the pipeline already cut), the
        local modules and the served stage are loaded from the checkpoint's keys.
        """
        state = checkpoint["state_dict"]
        module = self.lightning_module
        self._checkpoint_stage_optimizers = checkpoint.get(STAGE_OPTIMIZERS_KEY)  # loaded once the stage's is built
        if self._pipeline_name is None:
            tensors = [*module.parameters(), *module.buffers()]
            module.load_state_dict(state, strict=strict, assign=any(t.is_meta for t in tensors))
            return
        prefix = self._pipeline_name + "."
        module.load_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)}, strict=False)
        if self._stage is not None:
            stage_state = self._stage.state_from(state)
            if self.host is not None:
                self.host.load_state(stage_state, strict)
            else:
                self._stage.module.load_state_dict(stage_state, strict=strict)

    def _gather_stage_optimizers(self) -> dict[int, dict]:
        """The optimizer state dict of every stage, from this peer or a live peer of the stage (stages whose state
        cannot be had are left out, with a warning: their optimizers restart on resume)."""
        states = {}
        for span in self._spans:
            try:
                if self.host is not None and self.host.serves(span.index) and self.host.stage.optimizer is not None:
                    state = self.host.optimizer_state()
                else:
                    raw = self.router.fetch_state(span.index, optimizer=True)["optimizer"]
                    state = torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=True)
            except Exception as e:
                log.warning("Checkpoint without the optimizer state of stage %d: %r", span.index, e)
                continue
            states[span.index] = checkpointing.optimizer_state(state)
        return states

    def _complete_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add every stage's current state, and with the optimizers' states each stage optimizer's, gathered from
        this peer and live peers, to a checkpoint this peer writes (Lightning's state dict holds the local modules)."""
        if self._pipeline_name is None:
            return  # the pipeline was not cut yet: the state dict holds the whole model
        if self.router is None:
            raise RuntimeError(
                "The complete model is gathered from the swarm: save checkpoints while this peer is in it (during "
                "fit, e.g. with ModelCheckpoint or in on_train_end), not after fit/validate/test returned"
            )
        state = checkpoint["state_dict"]
        for span in self._spans:
            for key, tensor in self.fetch_stage_state(span.index).items():
                state[partitioning.stage_state_key(self._pipeline_name, span, key)] = tensor
        if "optimizer_states" in checkpoint:
            checkpoint[STAGE_OPTIMIZERS_KEY] = self._gather_stage_optimizers()

    def claim_checkpoint(self, filepath: str, ttl: float = 60.0) -> bool:
        """Whether this peer writes ``filepath`` (:func:`lightning_swarm.checkpointing.claim`): the others skip it.
        Peers that want copies of their own save to different paths (even on separate disks, the same absolute
        path is written by one peer)."""
        return checkpointing.claim(self.node, self.run_id, filepath, ttl, settle=min(1.0, self.update_period))

    def fetch_stage_state(self, stage: int) -> dict[str, torch.Tensor]:
        """The current state dict of ``stage`` (stage-local keys), from this peer or a live peer of the stage."""
        if self.host is not None and self.host.serves(stage):
            return self.host.stage_state()
        return self.router.fetch_state(stage)

    def teardown(self) -> None:
        if self.host is not None:
            if self.host.server is not None and self.role != "serve":
                self.host.linger(self._service)
            self.host.close()
            self.host = None
        for opt in self.optimizers:
            shutdown = getattr(opt, "shutdown", None)
            if shutdown is not None:
                shutdown()
        self.optimizers = []
        pipeline = getattr(self.lightning_module, self._pipeline_name or "", None)
        if isinstance(pipeline, RemotePipeline):
            pipeline.close()
        if self.router is not None:
            self.router.close()
        self.router = None
        if self.node is not None:
            self.checkpoint_io.leave()
            self.node.shutdown()
            self.node = None
        self._signals.restore()
        super().teardown()

    # ---- the steps ------------------------------------------------------------------------------------------------

    def _partition_and_serve(self, trainer: Trainer, fitting: bool) -> None:
        """Cut the pipeline, serve this peer's stage, and put the remote pipeline in the LightningModule's place.

        The cut is made once per strategy: a later ``validate``/``test``/``predict`` (or another ``fit``) with the
        same Trainer rejoins the swarm with the same stage, whose blocks this peer kept.
        """
        module = self.lightning_module
        if self._pipeline_name is None:
            self._partition(module)
        layout = {"num_stages": self.num_stages, "spans": [[s.start, s.end] for s in self._spans]}
        layout["precision"] = self.precision_plugin.precision  # peers computing in another precision are refused
        self.host = StageHost(
            self.node,
            self.settings,
            layout,
            self.root_device,
            self.events,
            self._stop_requested,
            build_stage=partial(self._build_stage, train=True),  # moves happen while fitting
        )
        if self._stage is not None:
            if fitting:
                self._stage.optimizer = self._stage_optimizer(self._stage.module, self._stage.index)
            self.host.serve(self._stage, self._checkpoint_stage_optimizers)

        self.router = StageRouter(
            self.node,
            self.run_id,
            self.num_stages,
            self.request_timeout,
            self.max_retries,
            self.ban_timeout,
            refresh_period=min(2.0, self.update_period),
            stage_wait_timeout=self.stage_wait_timeout,
            stop=self._stop_requested,
            direct=self.direct_path,
        )
        self.host.use_router(self.router)
        self.router.on_event = self.events.emit
        remote = RemotePipeline(self.router, self.compression, self.microbatches, loss_scale=self._loss_scale)
        setattr(module, self._pipeline_name, remote)
        self.host.watch(rebalance=fitting and self.host.server is not None and self.rebalance_period > 0)

    def _partition(self, module: LightningModule) -> None:
        """Balance the stages, keep this peer's stage and drop the other blocks (never allocated on meta)."""
        if any(isinstance(child, RemotePipeline) for child in module.children()):
            raise ValueError(
                f"This {type(module).__name__} already had its pipeline handed to a swarm by another Trainer: "
                f"build the model anew, or reuse the same Trainer for validate/test/predict"
            )
        self._pipeline_name = partitioning.find_pipeline(module, self.pipeline)
        self._blueprint = getattr(module, self._pipeline_name)
        self._spans = partitioning.balance_by_parameters(list(self._blueprint), self.num_stages)
        served = self._choose_stage() if self.role != "drive" else None
        for span in self._spans:
            if span.index != served:
                partitioning.stage_module(self._blueprint, span).to("meta")  # keeps their shapes, frees their memory
        if served is not None:
            self._build_stage(served, train=False)
        setattr(module, self._pipeline_name, nn.Identity())  # placeholder until the RemotePipeline takes its place
        _materialize_meta_tensors(module, self.root_device)  # the local modules, if built on the meta device

    def _build_stage(self, stage: int, train: bool) -> Stage:
        """The blocks of ``stage`` on this peer's device (freshly initialised if they were on the meta device), in
        the dtype of the Trainer's precision (``-true``), as Lightning converts the whole model in plain training;
        with their optimizer if ``train``. This peer serves it from now on."""
        blocks = partitioning.stage_module(self._blueprint, self._spans[stage])
        _materialize_meta_tensors(blocks, self.root_device)
        module = self.precision_plugin.convert_module(blocks).to(self.root_device)
        optimizer = self._stage_optimizer(module, stage) if train else None
        self._stage = Stage(self._spans[stage], module, optimizer, self._pipeline_name)
        return self._stage

    def _loss_scale(self) -> Optional[float]:
        """The current scale of the Trainer's GradScaler (``16-mixed``), sent with gradients to stage servers."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return None if scaler is None else scaler.get_scale()

    def _choose_stage(self) -> int:
        """The given stage, else a bottleneck stage: the lowest summed throughput (a stage without peers first)."""
        if self.stage is not None:
            return self.stage
        lowest = rebalancing.bottleneck(discovery.fetch_swarm(self.node, self.run_id, self.num_stages))
        return random.Random().choice(lowest)  # OS-seeded

    def _stage_optimizer(self, stage_module: nn.Module, stage: int) -> SwarmOptimizer:
        """The user's optimizer (class and per-group hyper-parameters) over this stage's parameters.

        ``configure_optimizers`` runs with the stage in the pipeline's place, so that ``self.parameters()``
        covers exactly the local modules and this stage.
        """
        module, pipeline = self.lightning_module, getattr(self.lightning_module, self._pipeline_name)
        setattr(module, self._pipeline_name, stage_module)
        try:
            optimizers, _ = _init_optimizers_and_lr_schedulers(module)
        finally:
            setattr(module, self._pipeline_name, pipeline)
        if len(optimizers) != 1:
            raise ValueError(f"SwarmStrategy supports one optimizer; configure_optimizers returned {len(optimizers)}")
        stage_optimizer = restrict_to(optimizers[0], stage_module.parameters())
        return swarm_optimizer(
            self.node.dht,
            f"{self.run_id}_stage{stage}",
            stage_optimizer,
            self._resolve_target_batch_size(self.lightning_module.trainer),
            self.matchmaking_time,
            self.averaging_timeout,
            delayed=self.delayed_updates,
        )

    def _service(self) -> None:
        """On the training (or serving) thread, between steps: carry out a planned move, then hand the queued
        swarm events to the callbacks."""
        if self.host is not None:
            self.host.carry_out_move()
        dispatch(self.lightning_module.trainer, self.events.drain())

    def swarm_metrics(self) -> dict[str, float]:
        """The swarm as this peer sees it, for :class:`~lightning_swarm.callbacks.SwarmMonitor`."""
        metrics = self.host.metrics() if self.host is not None else {"stage": float(-1), "peers": 0.0, "queue": 0.0}
        stage_optimizer = self._stage.optimizer if self._stage is not None else None
        optimizer = stage_optimizer or (self.optimizers[0] if self.optimizers else None)
        stats = self.router.stats if self.router is not None else None
        return {
            **metrics,
            "step": float(getattr(optimizer, "local_epoch", 0)),
            "bytes_sent": float(stats.bytes_sent if stats else 0),
            "bytes_received": float(stats.bytes_received if stats else 0),
            "compression_ratio": float(stats.raw_bytes_sent / stats.bytes_sent if stats and stats.bytes_sent else 1),
            "failovers": float(stats.failovers if stats else 0),
        }

    def _wrap_local_optimizer(self, trainer: Trainer) -> None:
        if not self.optimizers:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"SwarmStrategy supports one optimizer; configure_optimizers returned {len(self.optimizers)}"
            )
        local = swarm_optimizer(
            self.node.dht,
            f"{self.run_id}_local",
            self.optimizers[0],
            self._resolve_target_batch_size(trainer),
            self.matchmaking_time,
            self.averaging_timeout,
        )
        local.load_state_from_peers()
        self.optimizers = [local]

    def setup_optimizers(self, trainer: Trainer) -> None:
        has_local_params = any(p.requires_grad for p in self.lightning_module.parameters())
        if self.role == "serve" or not has_local_params:
            self.optimizers, self.lr_scheduler_configs = [], []
            return
        super().setup_optimizers(trainer)

    def _resolve_target_batch_size(self, trainer: Trainer) -> int:
        if self.target_batch_size is None:
            batch_size = getattr(trainer.datamodule, "batch_size", None)
            if not isinstance(batch_size, int):
                raise ValueError(
                    "Set target_batch_size (or SWARM_TARGET_BATCH_SIZE): the samples, summed over the swarm, "
                    "after which the swarm takes an optimizer step"
                )
            self.settings = dataclasses.replace(self.settings, target_batch_size=batch_size)
        return self.target_batch_size

    def _wait_for_stages(self) -> None:
        """Block until every stage has a serving peer, logging which ones are missing."""
        deadline = time.monotonic() + self.join_timeout
        while True:
            missing = [k for k in range(self.num_stages) if self.router.choose(k, 1) is None]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise StageUnavailableError(
                    f"Stages {missing} of run {self.run_id!r} have no live peer after {self.join_timeout:.0f}s: "
                    f"start peers that serve them (or check initial_peers)"
                )
            log.warning("Waiting for peers to serve stage(s) %s", missing)
            for k in missing:
                self.router.refresh(k, force=True)
            time.sleep(1.0)

    def _serve_until_stopped(self, trainer: Trainer) -> None:
        log.warning("Serving until this process receives SIGTERM or SIGINT")
        while not self._stop_requested.wait(0.5):
            self._service()
        trainer.should_stop = True


SwarmStrategy.__doc__ += "\n" + settings.args_section()  # the settings' docstrings, for LightningCLI's help
