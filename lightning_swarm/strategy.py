"""``SwarmStrategy``: SWARM parallelism as a Lightning strategy, and the table of contents of the package.

The strategy answers Lightning's hooks, cuts the model (:mod:`~lightning_swarm.partitioning`), puts the remote
pipeline (:mod:`~lightning_swarm.client`) in the pipeline's place, wraps the local optimizer
(:mod:`~lightning_swarm.optimizer`) and hands swarm events to callbacks (:mod:`~lightning_swarm.callbacks`).
It hands the serving side to one object, :class:`~lightning_swarm.server.stage_host.StageHost` (join, serve, move,
leave, records and metrics; its :mod:`~lightning_swarm.server.stage_server` steps the stage's optimizer). Settings
are :class:`~lightning_swarm.settings.SwarmSettings`; checkpoints are written by
:class:`~lightning_swarm.checkpointing.SwarmCheckpointIO`; signals are handled by
:class:`~lightning_swarm.signals.SignalGuard`. The wire: :mod:`~lightning_swarm.protocol`,
:mod:`~lightning_swarm.compression`, :mod:`~lightning_swarm.transport`; the swarm: :mod:`~lightning_swarm.node`,
:mod:`~lightning_swarm.discovery`, :mod:`~lightning_swarm.rebalancing`, :mod:`~lightning_swarm.security`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import textwrap
import threading
from functools import partial
from typing import Any, Callable, Generator, Literal, Optional, TypeVar, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer

from lightning_swarm import checkpointing, discovery, partitioning, rebalancing, security, settings
from lightning_swarm.block_calls import MetaBlocks
from lightning_swarm.callbacks import dispatch
from lightning_swarm.checkpointing import STAGE_OPTIMIZERS_KEY, SwarmCheckpointIO
from lightning_swarm.client import remote_blocks
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.client.routing import RouterStats, StageRouter
from lightning_swarm.compression import Codec
from lightning_swarm.errors import failure_line
from lightning_swarm.events import EventQueue
from lightning_swarm.node import SwarmNode
from lightning_swarm.optimizer import PerTrainerBatch, SwarmOptimizer, swarm_optimizer, target_batch_size
from lightning_swarm.precision import check_precision
from lightning_swarm.server.out_of_core import prepare_stage
from lightning_swarm.server.stage_host import LEAVE_GRACE, Stage, StageHost
from lightning_swarm.settings import Role, SwarmSettings, Wiring
from lightning_swarm.signals import SignalGuard

log = logging.getLogger(__name__)
T = TypeVar("T")


class SwarmStrategy(Strategy):
    """Train a LightningModule across a swarm of unreliable peers with SWARM parallelism.

    Every process started with this strategy joins the swarm named ``run_id``. The LightningModule's pipeline (its
    ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict`` of blocks, at any depth: ``pipeline``, or found
    automatically) is cut into ``num_stages`` stages of balanced parameter count; each peer serves one stage and, by
    default, also drives its own batches through the swarm, the model calling its blocks as it always does. Modules
    outside the pipeline stay local and are trained data-parallel across the driving peers.

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
        wiring: Optional[Wiring] = None,
        delayed_updates: Optional[bool] = None,
        microbatches: Optional[Union[int, Literal["auto"]]] = None,
        overlap_batches: Optional[bool] = None,
        checkpoint_activations: Optional[bool] = None,
        max_activation_bytes: Optional[Union[int, Literal["auto"]]] = None,
        activation_timeout: Optional[float] = None,
        out_of_core: Optional[Union[bool, Literal["auto"]]] = None,
        device_memory_budget: Optional[Union[int, Literal["auto"]]] = None,
        host_maddrs: Optional[Union[str, list[str]]] = None,
        announce_maddrs: Optional[Union[str, list[str]]] = None,
        direct_path: Optional[bool] = None,
        direct_port: Optional[int] = None,
        client_mode: Optional[bool] = None,
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
        max_request_samples: Optional[int] = None,
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
        self._pipeline: Optional[partitioning.Pipeline] = None  # where the blocks are, and their names
        self._blueprint: Optional[nn.Sequential] = None  # the whole pipeline, blocks of other stages on meta
        self._container: Optional[nn.Module] = None  # the model's own container of the blocks
        self._meta: Optional[MetaBlocks] = None  # the blocks on the meta device, in the Trainer's precision
        self._remote: Optional[RemotePipeline] = None
        self._batch_size: Optional[int] = None
        self._trailing_batch_size: Optional[int] = None  # the batch whose backward runs behind this one's forward
        self._checkpoint_stage_optimizers: Optional[dict] = None  # from fit(ckpt_path=...), for the stage served
        self._stop_requested = threading.Event()  # set by a signal: finish the step, then leave
        self._failure: Optional[BaseException] = None  # what made training raise (see on_exception)
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
            self.initial_peers,
            self.host_maddrs,
            self.announce_maddrs,
            self.identity_path,
            policy=policy,
            client_mode=self.client_mode,
        ).start()
        self._signals.daemon_pid = self.node.daemon_pid
        if not isinstance(self.checkpoint_io, SwarmCheckpointIO):  # Lightning's default, or the user's plugin
            self.checkpoint_io = SwarmCheckpointIO(self.checkpoint_io, self._complete_checkpoint)
        self.checkpoint_io.join(self.node, self.run_id, settle=min(1.0, self.update_period))
        addresses = self.node.publish_addresses(self.address_file)
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
        with (
            torch.device("meta")
            if is_overridden("configure_model", self.lightning_module)
            else contextlib.nullcontext()
        ):
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
            self._wrap_local_optimizer()
        if self.role == "drive":
            self.host.announce_driver()
        if self.role != "serve":
            self.host.set_training(fitting)  # about to train: peers that finished serve on for it (linger)
            self.host.wait_for_stages()
        if fitting and self.role == "serve":
            self._serve_until_stopped(trainer)

    @property
    def served_stage(self) -> Optional[int]:
        """The stage this peer serves (None: it only drives)."""
        return None if self._stage is None else self._stage.index

    def on_train_start(self) -> None:
        self.host.set_training(True)

    def on_train_end(self) -> None:
        self._finish_backward()
        self._service()
        self.host.set_training(False)
        for optimizer in self.optimizers:  # the trainers' rounds go on without this peer, which may linger
            if hasattr(optimizer, "leave_rounds"):  # the SwarmOptimizer, once wrapped
                optimizer.leave_rounds()

    def on_exception(self, exception: BaseException) -> None:
        """Training raised: say why now and tell the swarm, so that nobody lingers for this peer nor it for others."""
        self._failure = exception
        log.error(failure_line(exception))
        if self.host is not None:
            self.host.set_training(False)

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_size = extract_batch_size(batch)
        self._service()
        if self._stop_requested.is_set():
            self.lightning_module.trainer.should_stop = True
        if self._remote is not None:
            self._remote.trail_backward = self._may_trail_backward()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        trails = self._remote is not None and self._remote.trail_backward
        self._finish_backward(but_latest=trails)  # this batch's backward left first: its sends waited for nothing
        if trails:
            self._trailing_batch_size = self._batch_size

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return super().optimizer_step(optimizer, closure, model, batch_size=self._batch_size, **kwargs)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load a checkpoint (``fit(ckpt_path=...)``). Lightning restores it before ``setup``, the whole pipeline
        still in place: the served stage is cut from its weights (meta blocks take its tensors); a peer joining a
        live swarm then downloads its stage's current state, which wins. After a first ``fit``, the local modules
        and the served stage are loaded from the checkpoint's keys."""
        state = checkpoint["state_dict"]
        module = self.lightning_module
        self._checkpoint_stage_optimizers = checkpoint.get(STAGE_OPTIMIZERS_KEY)  # loaded once the stage's is built
        if self._pipeline is None:
            tensors = [*module.parameters(), *module.buffers()]
            module.load_state_dict(state, strict=strict, assign=any(t.is_meta for t in tensors))
            return
        prefix = self._pipeline.path + "."
        module.load_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)}, strict=False)
        if self._stage is not None:
            stage_state = self._stage.state_from(state)
            if self.host is not None:
                self.host.load_state(stage_state, strict)
            else:
                self._stage.module.load_state_dict(stage_state, strict=strict)

    def _complete_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add every stage's current state, and with the optimizers' states each stage optimizer's, gathered from
        this peer and live peers, to a checkpoint this peer writes (Lightning's state dict holds the local modules)."""
        if self._pipeline is not None:  # else the pipeline was not cut yet: the state dict holds the whole model
            checkpointing.add_stages(checkpoint, self._pipeline, self._spans, self.host)

    def teardown(self) -> None:
        if self.host is not None:
            if self.host.server is not None and self.role != "serve" and self._failure is None:
                self.host.linger(self._service)
            self.host.close()
            self.host = None
        for opt in self.optimizers:
            if hasattr(opt, "shutdown"):  # the SwarmOptimizer, once wrapped
                opt.shutdown()
        self.optimizers = []
        if self._remote is not None:
            self._remote.close()
            self._remote = None
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
        if self._pipeline is None:
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
            self.host.serve(self._build_stage(self._stage.index, train=fitting), self._checkpoint_stage_optimizers)

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
        spans = [(span.start, span.end) for span in self._spans]
        exact_dtype = not self.precision_plugin.precision.endswith("-mixed")  # under autocast the stage decides
        self._remote = RemotePipeline(
            self.router, self.compression, self.microbatches, self._loss_scale, spans, exact_dtype, wiring=self.wiring
        )
        blocks = remote_blocks.stand_in(self._container, list(self._pipeline.names), self._remote, self._meta)
        partitioning.replace_pipeline(module, self._pipeline.path, blocks)
        self.host.watch(rebalance=fitting and self.host.server is not None and self.rebalance_period > 0)

    def _partition(self, module: LightningModule) -> None:
        """Balance the stages, keep this peer's stage and drop the other blocks (never allocated on meta)."""
        if any(isinstance(child, remote_blocks.RemoteBlock) for child in module.modules()):
            raise ValueError(
                f"This {type(module).__name__} already had its pipeline handed to a swarm by another Trainer: "
                f"build the model anew, or reuse the same Trainer for validate/test/predict"
            )
        path = partitioning.find_pipeline(module, self.pipeline)
        self._container = module.get_submodule(path)
        self._pipeline = partitioning.Pipeline(path, tuple(partitioning.block_names(self._container)))
        self._blueprint = nn.Sequential(*partitioning.blocks_of(self._container))
        self._meta = MetaBlocks(list(self._blueprint), self.precision_plugin.convert_module)
        self._spans = partitioning.balance_by_parameters(list(self._blueprint), self.num_stages)
        served = None if self.role == "drive" else self.stage
        if served is None and self.role != "drive":
            served = rebalancing.join_stage(
                self.node, self.run_id, self.num_stages, 2 * self.update_period + LEAVE_GRACE
            )
        for span in self._spans:
            if span.index != served:
                partitioning.release(partitioning.stage_module(self._blueprint, span))  # keeps their shapes
        if served is not None:
            self._build_stage(served, train=False)
        # a placeholder until the blocks' stand-ins take its place
        partitioning.replace_pipeline(module, path, type(self._container)())
        # the local modules, if built on the meta device
        partitioning.materialize(module, self.root_device, partitioning.initializer(module, path))

    def _build_stage(self, stage: int, train: bool) -> Stage:
        """The blocks of ``stage`` on this peer's device, or out of core (freshly initialised if they were on the meta
        device), in
        the dtype of the Trainer's precision (``-true``), as Lightning converts the whole model in plain training;
        if ``train``, with the user's optimizer over them. This peer serves them from now on."""
        if self._stage is None or self._stage.index != stage:
            blocks = partitioning.stage_module(self._blueprint, self._spans[stage])
            convert, precision = self.precision_plugin.convert_module, self.precision_plugin.precision
            module = prepare_stage(
                blocks, self.root_device, convert, precision, self.out_of_core, self.device_memory_budget, self._init
            )
            self._stage = Stage(self._spans[stage], module, None, self._pipeline)
        if train:
            user = partitioning.stage_optimizer(self.lightning_module, self._pipeline.path, self._stage.module)
            delayed = self.delayed_updates if self.delayed_updates is not None else self.root_device.type == "cpu"
            self._stage.optimizer = self._swarm_optimizer(user, stage, delayed)
        return self._stage

    def _init(self, blocks: nn.Module) -> None:
        """Initialise freshly allocated blocks the way the model initialises them (a peer joining a live stage then
        downloads its state)."""
        partitioning.initializer(self.lightning_module, self._pipeline.path)(blocks)

    def _may_trail_backward(self) -> bool:
        """Whether this batch's backward may run on behind the next batch's forward (``overlap_batches``): no step
        of the swarm's optimizers can follow this batch (:meth:`CountingProgressTracker.epoch_goes_on_after`),
        nothing reads the local gradients per batch (automatic optimization, no clipping, no loss scale), and no
        move to another stage waits (it waits for nothing trailing)."""
        module = self.lightning_module
        optimizer = self.optimizers[0] if self.optimizers else None
        return (
            self.overlap_batches
            and isinstance(optimizer, SwarmOptimizer)
            and module.automatic_optimization
            and not module.trainer.gradient_clip_val
            and self._loss_scale() is None
            and not self.host.move_planned  # the stage this peer serves may be on the way back
            and optimizer.tracker.epoch_goes_on_after(self._batch_size or 1)
        )

    def _finish_backward(self, but_latest: bool = False) -> None:
        """Land the backward left running behind by the batch before (:meth:`RemotePipeline.finish_backward`), its
        gradients weighted as its own batch's: the optimizer weighs the gradients it accumulates by the batch in
        progress. ``but_latest``: this batch's own, left behind already, runs on."""
        if self._remote is None or self._trailing_batch_size is None:
            return
        scale, self._trailing_batch_size = self._trailing_batch_size / (self._batch_size or 1), None
        self._remote.finish_backward(scale, but_latest)

    def _loss_scale(self) -> Optional[float]:
        """The current scale of the Trainer's GradScaler (``16-mixed``), sent with gradients to stage servers."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return None if scaler is None else scaler.get_scale()

    def _swarm_optimizer(self, optimizer: Optimizer, stage: Optional[int], delayed: bool = False) -> SwarmOptimizer:
        """``optimizer`` stepping once the swarm's peers sharing it (``stage``'s, None: the trainers) processed the
        target batch."""
        given = target_batch_size(self.lightning_module.trainer, self.target_batch_size)
        keys = discovery.record_keys(self.run_id, self.num_stages or 0)
        if self.target_batch_size is None:  # this peer's batch per training peer, as their records say (kept after)
            given = PerTrainerBatch(given, keys)
        self.settings = dataclasses.replace(self.settings, target_batch_size=given)
        prefix, timing = discovery.optimizer_prefix(self.run_id, stage), (self.matchmaking_time, self.averaging_timeout)
        trainers = keys if stage is None else None  # the trainers' rounds expect every trainer
        return swarm_optimizer(self.node.dht, prefix, optimizer, given, *timing, delayed=delayed, trainer_keys=trainers)

    def _service(self) -> None:
        """On the training (or serving) thread, between steps: carry out a planned move, then hand the queued
        swarm events to the callbacks."""
        if self.host is not None and self._trailing_batch_size is None:  # else it moves once the backward landed
            self.host.carry_out_move()
        dispatch(self.lightning_module.trainer, self.events.drain())

    def swarm_metrics(self) -> dict[str, float]:
        """The swarm as this peer sees it, for :class:`~lightning_swarm.callbacks.SwarmMonitor`."""
        return self.host.metrics(self.optimizers[0] if self.optimizers else None) if self.host is not None else {}

    @property
    def router_stats(self) -> RouterStats:
        """A copy of this peer's counters of its calls to the stages (calls, failovers, bytes, seconds per stage,
        calls per peer): all zero before fit and on a peer that sends no work."""
        return self.router.stats.copy() if self.router is not None else RouterStats()

    def _wrap_local_optimizer(self) -> None:
        if self.optimizers:
            self.optimizers = [self._swarm_optimizer(partitioning.single_optimizer(self.optimizers), None)]
            self.optimizers[0].load_state_from_peers()

    def setup_optimizers(self, trainer: Trainer) -> None:
        has_local_params = any(p.requires_grad for p in self.lightning_module.parameters())
        if self.role == "serve" or not has_local_params:
            self.optimizers, self.lr_scheduler_configs = [], []
            return
        super().setup_optimizers(trainer)

    def _serve_until_stopped(self, trainer: Trainer) -> None:
        log.warning("Serving until this process receives SIGTERM or SIGINT")
        while not self._stop_requested.wait(0.5):
            self._service()
        trainer.should_stop = True


# the settings' docstrings, for LightningCLI's help; both sides dedented (Python 3.13 on strips a docstring's indent
# itself, and docstring_parser then found no Args section after an indented one)
SwarmStrategy.__doc__ = inspect.cleandoc(SwarmStrategy.__doc__) + "\n\n" + textwrap.dedent(settings.args_section())
