"""The stage server: answers forward and backward requests for the stage this peer serves (SWARM section 2).

Requests arrive over hivemind's libp2p RPC or the direct path (:mod:`~lightning_swarm.transport`), both answered by
:meth:`StageServer.answer_tensors`: the caller's membership is checked first (on a stream, on its first message), the
samples and bytes it claims against bounds; then it is decoded straight onto the stage's device and validated beside
the event loop, and checked against the stage's blocks on the meta device
(:class:`~lightning_swarm.block_calls.MetaBlocks`): an input the blocks do not take is the caller's fault, refused
before it costs any compute, and any input they take is served, so sequence length and batch size may change from
request to request. It then waits in a bounded queue shared fairly between callers
(:mod:`~lightning_swarm.server.fair_queue`) for one compute worker thread that owns the stage module on that device. A
training forward keeps its autograd graph for a while (:mod:`~lightning_swarm.server.kept_activations`), so that the
backward that follows on this peer needs only the output gradient and computes no forward again. A request runs all
the stage's blocks in turn, each called with the activation and the side inputs its metadata's ``calls`` lists
(:mod:`~lightning_swarm.block_calls`; by default none). A backward sent
with the stage's input instead recomputes the forward from it, so any peer of the stage can serve it (the fallback
when the first peer died or dropped the graph). Backward hands the parameter gradients to the stage optimizer (which
accumulates them towards the stage's target batch size) and returns the gradient of the input.
A request that fails validation or computation leaves the stage's parameters and accumulated gradients untouched.
A malformed request is refused with :class:`~lightning_swarm.errors.SwarmRequestError` (the caller's fault); one that
runs out of memory is answered "busy" (the caller tries another peer, or waits), once what it held is freed; any other
failure of a well-formed request is the server's (:class:`~lightning_swarm.errors.StageFailedError`: the caller fails
over).
The stage computes in the Trainer's precision (:mod:`~lightning_swarm.precision`); under ``16-mixed`` a backward
carries the trainer's loss scale (:meth:`StageServer._backward_through` says how it is used).
The throughput a server publishes is measured on its requests' compute, the device synchronised.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any, AsyncIterator, Optional, Protocol, Sequence

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.performance_ema import PerformanceEMA
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_swarm import block_calls, compression, device_sync, protocol, security
from lightning_swarm.block_calls import Call, MetaBlocks
from lightning_swarm.errors import (
    ActivationsLostError,
    NonFiniteInputError,
    NotServingError,
    StageBusyError,
    StageFailedError,
    SwarmRequestError,
)
from lightning_swarm.events import EventQueue, StageStep
from lightning_swarm.logs import RateLimit
from lightning_swarm.precision import activation_dtypes, autocast, parameter_dtype, unscale_
from lightning_swarm.protocol import stage_uid
from lightning_swarm.security import AccessPolicy
from lightning_swarm.server import device_memory
from lightning_swarm.server.fair_queue import FairQueue
from lightning_swarm.server.kept_activations import Kept, KeptActivations, counting_saved_bytes, default_max_bytes
from lightning_swarm.server.out_of_core import OutOfCoreStage, spare_bytes

log = logging.getLogger(__name__)

BUSY_LOG_PERIOD = 10.0  # seconds between two log lines about one caller's busy answers of one kind
BUSY_HOLD = 0.25  # seconds a caller answered busy more than once a second waits for each further busy answer
MAX_HELD = 256  # busy answers held at once; beyond, they are sent at once


class StageOptimizer(Protocol):
    """What a stage server asks of its optimizer (:class:`~lightning_swarm.optimizer.SwarmOptimizer` has it)."""

    local_epoch: int

    def step(self, batch_size: int) -> Any: ...

    def zero_grad(self) -> None: ...

    def follow_swarm(self) -> None: ...

    def apply_finished_update(self, wait: bool = False) -> None: ...

    def progress(self) -> dict: ...

    def state_dict(self) -> dict: ...


def _blocks_of(module: nn.Module) -> list[nn.Module]:
    """The blocks a stage module runs in turn."""
    if isinstance(module, OutOfCoreStage):
        return list(module._blocks)
    return list(module) if isinstance(module, nn.Sequential) else [module]


def _refuse(future: Future, error: Exception) -> None:
    """Answer a queued request with ``error``, unless its caller stopped waiting (its handler was cancelled)."""
    if future.set_running_or_notify_cancel():
        future.set_exception(error)


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator running out of memory (the device's, or a backend's without its own type);
    not this server's own "busy" answer to one."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and not isinstance(error, StageBusyError) and "out of memory" in str(error)


class StageServer(ServicerBase):
    """Serves one stage of one run. Handlers are registered under the run id as namespace.

    Args:
        module: the stage's blocks, already on ``device``, or an
            :class:`~lightning_swarm.server.out_of_core.OutOfCoreStage` that brings them there block by block.
        optimizer: the stage's optimizer (None: serve without training), held and stepped by the server as
            hivemind's ``ModuleBackend`` does: after each successful backward (once answered) it steps with the
            microbatch's size and zeroes the gradients; whenever no request came for ``idle_period`` seconds it
            follows the swarm (a peer the routers leave idle still follows the stage's steps); before each forward
            it applies a finished background (delayed) step, so that only forwards run during a step see the old
            parameters, and before the state is read it waits for one; ``info()`` and ``rpc_state`` report its
            progress and state.
        events: where the server reports the optimizer's steps (:class:`~lightning_swarm.events.StageStep`).
        max_queue: requests waiting for the worker; further requests are answered "busy". Shared fairly between
            callers: under contention each keeps an equal share of the places and of the worker's samples.
        max_request_bytes: requests with more tensor bytes are refused before they are decoded.
        max_request_samples: requests claiming more samples (their first dimension) are refused.
        max_activation_bytes: memory for the graphs of training forwards awaiting their backward (what autograd
            saved, and the stage's input and output; past it, the caller holding the most gives up its oldest, and
            their backward recomputes).
            None: half of the device's free memory when the server starts (CUDA), 1 GiB on the CPU; for an
            out-of-core stage, half of what its plan leaves of the device-memory budget.
        activation_timeout: seconds such a graph is kept at most.
        checkpoint_activations: keep only each block's input and recompute the block in backward (activation
            checkpointing), so that many microbatches in flight cost little memory.
        throttle: slow this peer down on purpose by this factor (after each request the worker waits
            ``throttle - 1`` times the request's compute time), to show or test a swarm of unequal peers on one
            machine. Default 1: full speed.
        precision: the Trainer's precision (see :mod:`~lightning_swarm.precision`): ``-mixed`` runs the forward
            under autocast; ``-true`` needs ``module`` in that dtype already. Decides the dtypes accepted.
    """

    def __init__(
        self,
        run_id: str,
        stage: int,
        module: nn.Module,
        device: torch.device,
        optimizer: Optional[StageOptimizer] = None,
        events: Optional[EventQueue] = None,
        idle_period: float = 1.0,
        max_queue: int = 64,
        max_request_bytes: int = 256 * 2**20,
        max_request_samples: int = 4096,
        max_activation_bytes: Optional[int] = None,
        activation_timeout: float = 120.0,
        checkpoint_activations: bool = False,
        throttle: float = 1.0,
        policy: Optional[AccessPolicy] = None,
        precision: str = "32-true",
    ) -> None:
        if throttle < 1:
            raise ValueError(f"throttle must be at least 1 (a slowdown factor), got {throttle}")
        self.precision = precision
        self.activation_dtypes = activation_dtypes(precision)  # what requests may carry
        self.dtype = parameter_dtype(precision)
        wrong = {p.dtype for p in module.parameters() if p.is_floating_point()} - {self.dtype}
        if wrong:
            raise ValueError(
                f"precision={precision!r} needs the stage's parameters in {self.dtype}, found "
                f"{sorted(map(str, wrong))}: convert the module first (the precision plugin's convert_module)"
            )
        self.run_id, self.stage, self.uid = run_id, stage, stage_uid(run_id, stage)
        self.module, self.device, self.optimizer, self.events = module, device, optimizer, events
        self.idle_period = idle_period
        self.max_request_bytes, self.checkpoint_activations = max_request_bytes, checkpoint_activations
        self.max_request_samples = max_request_samples
        self.blocks = _blocks_of(module)
        self.meta = MetaBlocks(self.blocks)  # what the blocks take and return, known without computing
        if max_activation_bytes is None:
            max_activation_bytes = spare_bytes(module)
        if max_activation_bytes is None:
            max_activation_bytes = default_max_bytes(device)
        self.kept = KeptActivations(max_activation_bytes, activation_timeout)
        self._snapshot_path = device_memory.start_recording(device)
        self.throttle = throttle
        self.policy = policy  # callers off its allow-list, or without the swarm's secret, are refused
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.throughput = PerformanceEMA(alpha=0.1)
        self.lock = threading.Lock()  # held by the worker while it computes; others take it to read the state
        self._tasks = FairQueue(max_queue)
        self._busy_lines = RateLimit(BUSY_LOG_PERIOD)  # a line per caller and kind of busy answer each period
        self._busy_at_once = RateLimit(1.0)  # a caller's first busy answer each second is sent at once
        self._held = 0  # busy answers being held
        self._queued_samples = 0
        self.backward_samples = 0  # samples whose gradients reached the stage optimizer
        self.skipped_samples = 0  # samples whose gradients were not finite (16-mixed overflow): not accumulated
        self._worker = threading.Thread(target=self._work, name=f"stage{stage}-worker", daemon=True)
        self._worker.start()

    # ---- RPC handlers -------------------------------------------------------------------------------------------

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self._check_caller(context, request.metadata)
        return await self.answer("forward", request, str(context.remote_id))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        self._check_caller(context, request.metadata)
        return await self.answer("backward", request, str(context.remote_id))

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for part in self._answer_stream("forward", requests, context):
            yield part

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for part in self._answer_stream("backward", requests, context):
            yield part

    async def _answer_stream(
        self, kind: str, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:  # the caller's membership is checked on the first message, before the rest of the stream is read
            request = await protocol.gather_request(
                requests, self.max_request_bytes, lambda metadata: self._check_caller(context, metadata)
            )
            response = await self.answer(kind, request, str(context.remote_id))
        except protocol.WIRE_ERRORS as e:
            raise protocol.error_for_wire(e) from None
        for part in protocol.stream_response(response):
            yield part

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """The stage's load and progress, as a msgpack dict (checked against the allow-list; carries no secret)."""
        self._check_caller(context, None)
        self._check_uid(request.uid)
        return runtime_pb2.ExpertInfo(serialized_info=protocol.encode_metadata(self.info()))

    def info(self) -> dict:
        return dict(
            stage=self.stage,
            queued_samples=self._queued_samples,
            throughput=self.throughput.samples_per_second if self.throughput.num_updates else 0.0,
            backward_samples=self.backward_samples,
            skipped_samples=self.skipped_samples,
            kept_bytes=self.kept.nbytes,
            kept_forwards=len(self.kept),
            dropped_forwards=self.kept.dropped,  # kept forwards given up before their backward: it recomputes them
            device_memory=device_memory.usage(self.device),
            **(self.optimizer.progress() if self.optimizer is not None else {}),
        )

    async def rpc_state(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream the stage's current state dict (uncompressed), e.g. to gather a complete checkpoint; with
        ``{"optimizer": True}`` in the metadata, its optimizer's state dict instead (``torch.save`` bytes)."""
        self._check_caller(context, request.metadata)
        self._check_uid(request.uid)
        if protocol.decode_metadata(request.metadata).get("optimizer"):
            if self.optimizer is None:
                raise SwarmRequestError(f"stage {self.stage} has no optimizer on this peer (it is not training)")
            optimizer = await asyncio.get_running_loop().run_in_executor(None, self._optimizer_bytes)
            state, step = {"optimizer": optimizer}, None
        else:
            state, step = await asyncio.get_running_loop().run_in_executor(None, self.state_and_step)
        response = runtime_pb2.ExpertResponse(
            tensors=[compression.serialize(t, "none") for t in state.values()],
            metadata=protocol.encode_metadata({"keys": list(state), "step": step}),
        )
        for part in protocol.stream_response(response):
            yield part

    # ---- validation and compute -----------------------------------------------------------------------------------

    async def answer(
        self, kind: str, request: runtime_pb2.ExpertRequest, caller: str = "this peer"
    ) -> runtime_pb2.ExpertResponse:
        """:meth:`answer_tensors`, as hivemind's message (for libp2p)."""
        tensors = await self.answer_tensors(kind, request, caller)
        return runtime_pb2.ExpertResponse(tensors=[compression.to_message(t) for t in tensors])

    async def answer_tensors(
        self, kind: str, request: runtime_pb2.ExpertRequest, caller: str = "this peer"
    ) -> list[compression.WireTensor]:
        """Validate a forward or backward request, run it on the worker and encode the reply. ``request`` may also
        be any object with its fields (``uid``, ``tensors``, ``metadata``), e.g. from the direct path. ``caller``
        (a peer id) is whom the queue and the kept activations are shared between."""
        try:
            self._check_uid(request.uid)
            metadata = protocol.decode_metadata(request.metadata)
            codec = str(metadata.get("codec", "none"))
            if codec not in compression.CODECS:
                raise SwarmRequestError(f"unknown compression {codec!r}")
            key = metadata.get("keep" if kind == "forward" else "kept")
            if key is not None and not (isinstance(key, str) and 0 < len(key) <= 64):
                raise SwarmRequestError("a kept forward's key must be a string of 1 to 64 characters")
            expected = 1 if kind == "forward" or key is not None else 2
            tree = self._side_inputs_tree(metadata)
            if len(request.tensors) < expected or (tree is None and len(request.tensors) != expected):
                raise SwarmRequestError(f"{kind} expects {expected} tensor(s), got {len(request.tensors)}")
            self._check_shapes(request.tensors[:expected], request.tensors[expected:])
            if not self._tasks.admits(caller):  # before its tensors cost any decoding
                raise self._busy()
            loss_scale = self._loss_scale(kind, metadata)
            # a scaled gradient may have overflowed upstream: a backward with it is skipped, not refused
            finite = [True] * (expected - 1) + [loss_scale is None]
            train = bool(metadata.get("train", True))
            loop = asyncio.get_running_loop()  # decoding and encoding run beside it, not on it
            tensors, calls = await loop.run_in_executor(
                None, self._decode_request, request.tensors, expected, finite, tree, key is None, train
            )
            batch = int(tensors[0].shape[0])
            future = self._submit(kind, tensors, train, batch, caller, key, loss_scale, calls)
            output = await asyncio.wrap_future(future)
            encoded = await loop.run_in_executor(None, compression.encode, output, codec)
        except (ActivationsLostError, NotServingError):
            raise  # expected when the caller's view is stale: no log line
        except StageBusyError as e:
            if self._busy_lines((caller, str(e))):  # a caller's first busy answer of each kind is always logged
                log.warning("Stage %d refused a %s request from %s: %r", self.stage, kind, caller, e)
            await self._hold_busy_answer(caller)
            raise
        except (SwarmRequestError, StageFailedError) as e:
            log.warning("Stage %d refused a %s request from %s: %r", self.stage, kind, caller, e)
            raise
        except Exception as e:
            if _out_of_memory(e):  # in decoding or encoding (the worker answers busy itself)
                raise self._overloaded(kind, repr(e)) from None
            log.warning("Stage %d failed a %s request from %s: %r", self.stage, kind, caller, e)
            raise StageFailedError(f"stage {self.stage} failed a {kind} request: {e!r}") from None
        return [encoded]

    async def _hold_busy_answer(self, caller: str) -> None:
        """Hold a busy answer to a caller already answered busy this second for ``BUSY_HOLD`` seconds. A caller that
        sends again as soon as it is refused (a flooder) otherwise costs the server a request's handling per answer,
        hundreds a second, taken from the callers it serves; a trainer's first busy answer still lets it fail over at
        once."""
        if self._busy_at_once(caller) or self._held >= MAX_HELD:
            return
        self._held += 1
        try:
            await asyncio.sleep(BUSY_HOLD)
        finally:
            self._held -= 1

    def _check_caller(self, context: P2PContext, raw_metadata: Optional[bytes]) -> None:
        """Refuse callers off the allow-list and, unless ``raw_metadata`` is None, those without the secret's token."""
        if self.policy is None:
            return
        if raw_metadata is None:
            if not self.policy.admits(context.remote_id):
                security.refuse(f"peer {context.remote_id} is not on the allow-list of this swarm")
            return
        try:
            metadata = protocol.decode_metadata(raw_metadata)
        except Exception:
            metadata = {}
        self.policy.check_request(self.run_id, context, metadata if isinstance(metadata, dict) else {})

    def _side_inputs_tree(self, metadata: dict) -> Optional[list]:
        """The side inputs of the stage's blocks as a request lists them (None: none)."""
        tree = metadata.get("calls")
        if tree is not None and not (isinstance(tree, list) and len(tree) == len(self.blocks)):
            raise SwarmRequestError(f"side inputs for the stage's {len(self.blocks)} blocks expected")
        return tree

    def _check_shapes(self, messages: Sequence[runtime_pb2.Tensor], sides: Sequence[runtime_pb2.Tensor]) -> None:
        """Refuse, from the tensors' headers alone, a request whose activations (``messages``) claim no samples or too
        many, or whose tensors claim more bytes than the cap."""
        widest = max(d.itemsize for d in compression.DTYPES.values())
        activation = max(d.itemsize for d in self.activation_dtypes)
        sizes = [math.prod(m.size) * activation for m in messages] + [math.prod(m.size) * widest for m in sides]
        for message, size in zip([*messages, *sides], sizes):
            if size > self.max_request_bytes:
                raise SwarmRequestError(
                    f"tensor of shape {list(message.size)} exceeds the cap of {self.max_request_bytes} bytes"
                )
        if sum(sizes) > self.max_request_bytes:
            shapes = [list(m.size) for m in [*messages, *sides]]
            raise SwarmRequestError(f"tensors of shapes {shapes} exceed the cap of {self.max_request_bytes} bytes")
        for message in messages:
            if not message.size:
                raise SwarmRequestError("a tensor without a batch dimension")
            if message.size[0] > self.max_request_samples:
                raise SwarmRequestError(
                    f"a request may claim at most {self.max_request_samples} samples (max_request_samples), this one "
                    f"claims {message.size[0]}"
                )

    def _decode_request(
        self,
        messages: Sequence[runtime_pb2.Tensor],
        expected: int,
        finite: list[bool],
        tree: Optional[list],
        has_input: bool,
        train: bool,
    ) -> tuple[list[torch.Tensor], list[Call]]:
        """The request's activations (and gradient) and its blocks' calls, decoded on the stage's device; an input
        the blocks do not take (on the meta device) is refused."""
        tensors = list(map(self._decode, messages[:expected], finite))
        if tree is None:
            calls: list[Call] = [((), {})] * len(self.blocks)
        else:
            calls = block_calls.unpack(tree, [self._decode_side(m) for m in messages[expected:]], len(tree))
        if has_input:
            try:
                self.meta.activation(0, tensors[0], calls, train)
            except Exception as e:
                raise SwarmRequestError(
                    f"stage {self.stage}'s blocks do not take an input of shape {list(tensors[0].shape)} with these "
                    f"side inputs: {e!r:.300}"
                ) from None
        return tensors, calls

    def _decode_side(self, message: runtime_pb2.Tensor) -> torch.Tensor:
        """A side input, exactly as sent (any dtype; masks may hold -inf)."""
        try:
            return compression.deserialize(message, device=self.device)
        except Exception as e:
            if _out_of_memory(e):
                raise
            raise SwarmRequestError(f"undecodable side input: {e!r}") from None

    def _check_uid(self, uid: str) -> None:
        if uid == self.uid:
            return
        if uid.startswith(stage_uid(self.run_id, 0)[:-1]):  # another stage of this run: the caller's view is stale
            raise NotServingError(f"this peer no longer serves {uid!r}: it serves {self.uid!r}")
        raise SwarmRequestError(f"unknown stage {uid!r}: this peer serves {self.uid!r}")

    @staticmethod
    def _loss_scale(kind: str, metadata: dict) -> Optional[float]:
        """The loss scale a backward's gradient carries (``16-mixed``), or None."""
        scale = metadata.get("loss_scale")
        if scale is None or kind != "backward":
            return None
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise SwarmRequestError(f"loss_scale must be a positive finite number, got {scale!r}")
        return float(scale)

    def _decode(self, message: runtime_pb2.Tensor, finite: bool = True) -> torch.Tensor:
        try:
            tensor = compression.deserialize(message, device=self.device)
        except Exception as e:
            if _out_of_memory(e):
                raise  # the device is full, the message may be fine: answered busy
            raise SwarmRequestError(f"undecodable tensor: {e!r}") from None
        if tensor.numel() == 0:  # costs no bytes whatever its batch dimension, which would count as samples
            raise SwarmRequestError(f"empty tensor of shape {list(tensor.shape)}")
        if tensor.dtype not in self.activation_dtypes:
            expected = " or ".join(map(str, self.activation_dtypes))
            raise SwarmRequestError(f"expected a {expected} tensor, got {tensor.dtype} (precision {self.precision})")
        if finite and not device_sync.all_finite(tensor):
            raise NonFiniteInputError("tensor contains NaN or Inf")
        return tensor

    def _submit(
        self,
        kind: str,
        tensors: list[torch.Tensor],
        train: bool,
        batch: int,
        caller: str,
        key: Optional[str],
        loss_scale: Optional[float] = None,
        calls: Optional[list[Call]] = None,
    ) -> Future:
        if not self._worker.is_alive():
            raise StageFailedError(f"stage {self.stage}'s worker is not running")
        future: Future = Future()
        caller_key = None if key is None else (caller, key)
        calls = [((), {})] * len(self.blocks) if calls is None else calls
        task = (kind, tensors, train, batch, caller_key, loss_scale, calls, future)
        try:
            displaced = self._tasks.put(caller, task, batch)
        except queue.Full:
            raise self._busy() from None
        self._queued_samples += batch
        if displaced is not None:  # the newest request of the caller that held the most places
            self._queued_samples -= displaced[3]
            _refuse(displaced[-1], StageBusyError(f"stage {self.stage} is busy: other callers need their share"))
        return future

    def _busy(self) -> StageBusyError:
        return StageBusyError(f"stage {self.stage} is busy ({self._tasks.maxsize} requests queued)")

    def _work(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self.idle_period)
            except queue.Empty:
                self.kept.expire()
                self._idle()
                continue
            if task is None:
                return
            self._serve(*task)
            del task  # the request's tensors: not held while the worker waits for the next one

    def _serve(
        self,
        kind: str,
        tensors: list[torch.Tensor],
        train: bool,
        batch: int,
        key: Optional[tuple],
        loss_scale: Optional[float],
        calls: list[Call],
        future: Future,
    ) -> None:
        """Compute one request on the worker and answer it (its tensors are freed once this returns)."""
        self._queued_samples -= batch
        self.kept.expire()
        if not future.set_running_or_notify_cancel():
            return
        start, error = time.perf_counter(), None
        try:
            with self.lock:
                if self.module.training != train:  # a walk over every submodule: not on every request
                    self.module.train(train)
                output, accumulate = self._compute(kind, tensors, key, loss_scale, calls)
            self._synchronize()  # the time below is the compute's, not that of launching its kernels
        except (SwarmRequestError, ActivationsLostError) as e:
            future.set_exception(e)
            return
        except Exception as e:
            if not _out_of_memory(e):  # on an input the blocks take (on meta), a failing block is the stage's fault
                future.set_exception(StageFailedError(f"stage {self.stage} {kind} failed: {e!r}"))
                return
            error = repr(e)  # handled below, once the failed call's frames (and the tensors they hold) are gone
        if error is not None:
            if key is not None:
                self.kept.pop(key)  # a forward kept before the failure, or the graph the failed backward used
            tensors.clear()  # the request's inputs, shared with the handler awaiting the answer
            future.set_exception(self._overloaded(kind, error))
            return
        if self.throttle > 1:
            time.sleep((self.throttle - 1) * (time.perf_counter() - start))
        self.throughput.update(batch, interval=time.perf_counter() - start)  # compute only, not the step below
        if kind == "backward" and not accumulate:
            self.skipped_samples += batch
            log.info("Stage %d: gradients not finite under loss scale %s: microbatch skipped", self.stage, loss_scale)
        self.backward_samples += batch if accumulate else 0
        future.set_result(output)  # the caller goes on while the stage optimizer takes its turn
        if accumulate:
            self._hand_over_gradients(batch)

    def _synchronize(self) -> None:
        """Wait for the work queued on the stage's device (a GPU runs kernels after they were launched)."""
        device_sync.synchronize(self.device)

    def _overloaded(self, kind: str, error: str) -> StageBusyError:
        """The answer to a request that ran out of memory: busy (callers try another peer or wait), after giving
        the allocator's cached blocks back to the device."""
        log.warning(
            "Stage %d ran out of memory in a %s request: answered busy (%s; kept %d forwards of %d bytes; device %s)",
            self.stage,
            kind,
            error,
            len(self.kept),
            self.kept.nbytes,
            device_memory.usage(self.device),
        )
        device_memory.dump(self._snapshot_path)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return StageBusyError(f"stage {self.stage} is out of memory: try another peer or later")

    def _idle(self) -> None:
        if self.optimizer is None:
            return
        try:
            with self.lock:
                self.optimizer.follow_swarm()
        except Exception as e:  # the next idle period tries again; requests must keep being served
            log.warning("Stage %d: idle-time work failed: %r", self.stage, e)

    def _compute(
        self,
        kind: str,
        tensors: list[torch.Tensor],
        key: Optional[tuple[str, str]],
        loss_scale: Optional[float],
        calls: list[Call],
    ) -> tuple[torch.Tensor, bool]:
        """The request's output, and whether the parameters' ``.grad`` now hold gradients to accumulate."""
        if kind == "forward":
            if self.optimizer is not None:
                self.optimizer.apply_finished_update(wait=False)
            if key is None:
                return self._forward(tensors[0], calls), False
            return self._forward_and_keep(tensors[0], key, calls), False
        if key is None:
            return self._backward(*tensors, loss_scale=loss_scale, calls=calls)
        return self._backward_kept(key, tensors[0], loss_scale)

    @torch.no_grad()
    def _forward(self, inputs: torch.Tensor, calls: list[Call]) -> torch.Tensor:
        return self._run(inputs.to(self.device), calls, checkpointed=False)

    def _forward_and_keep(self, inputs: torch.Tensor, key: tuple[str, str], calls: list[Call]) -> torch.Tensor:
        inputs = inputs.to(self.device).requires_grad_()
        with torch.enable_grad(), counting_saved_bytes(self.params) as saved:
            outputs = self._run(inputs, calls)
        saved.count(inputs)  # the entry holds both, whether the graph saved them or not
        saved.count(outputs)
        self.kept.put(key, Kept(inputs, outputs, saved.nbytes, self._params_version(), calls, owner=key[0]))
        return outputs.detach()

    def _run(self, inputs: torch.Tensor, calls: list[Call], checkpointed: bool = True) -> torch.Tensor:
        """The stage's blocks with their side inputs, in the Trainer's precision; under checkpointing (if on and
        ``checkpointed``), block by block, each keeping only its input (its recomputation restores the forward's
        autocast state). An out-of-core stage recomputes anyway."""
        with autocast(self.precision, self.device):
            if isinstance(self.module, OutOfCoreStage):
                return self.module(inputs, calls)
            wrap = partial(checkpoint, use_reentrant=False) if checkpointed and self.checkpoint_activations else None
            return block_calls.run_blocks(self.blocks, inputs, calls, wrap)

    def _params_version(self) -> int:
        return sum(p._version for p in self.params)

    def _backward_kept(
        self, key: tuple[str, str], grad_outputs: torch.Tensor, loss_scale: Optional[float]
    ) -> tuple[torch.Tensor, bool]:
        kept = self.kept.pop(key)
        if kept is None:
            raise ActivationsLostError(f"stage {self.stage} no longer holds this forward's activations")
        if kept.params_version != self._params_version():
            # the stage stepped since this forward: autograd refuses a graph whose saved parameters changed; the old
            # graph is let go before the forward is recomputed
            inputs, calls, kept = kept.inputs.detach(), kept.calls, None
            return self._backward(inputs, grad_outputs, loss_scale, calls)
        return self._backward_through(kept.inputs, kept.outputs, grad_outputs, loss_scale)

    def _backward(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor, loss_scale: Optional[float], calls: list[Call]
    ) -> tuple[torch.Tensor, bool]:
        inputs = inputs.to(self.device).requires_grad_()
        with torch.enable_grad():
            outputs = self._run(inputs, calls)
        return self._backward_through(inputs, outputs, grad_outputs, loss_scale)

    def _backward_through(
        self, inputs: torch.Tensor, outputs: torch.Tensor, grad_outputs: torch.Tensor, loss_scale: Optional[float]
    ) -> tuple[torch.Tensor, bool]:
        """The input's gradient, and whether the parameters' ``.grad`` were set (to accumulate).

        ``16-mixed``: the trainer's GradScaler scaled the loss, so ``grad_outputs`` arrive multiplied by the
        ``loss_scale`` the trainer sends. The backward runs on them as they are (the scale is what keeps fp16
        gradients from underflowing, as in plain training), then the parameter gradients are unscaled here as
        ``GradScaler.unscale_`` would, so that the stage optimizer steps on true gradients. When a parameter
        gradient or the input's gradient is not finite (an overflow, here or in a later stage), nothing is
        accumulated and the input's gradient comes back as NaN: earlier stages skip the microbatch too, and the
        trainer's GradScaler finds NaN in its own gradients, skips its step and lowers the scale, as one overflow
        anywhere does in plain training. (Scaling on each server instead would send unscaled fp16 gradients, which
        underflow on the way.)
        """
        if grad_outputs.shape != outputs.shape:
            raise SwarmRequestError(
                f"gradient of shape {list(grad_outputs.shape)} does not match the output {list(outputs.shape)}"
            )
        # gradients are computed apart and handed over only once all of them exist: a failure leaves no trace
        grad_outputs = grad_outputs.to(self.device, outputs.dtype)
        grads = torch.autograd.grad(outputs, [inputs, *self.params], grad_outputs, allow_unused=True)
        param_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads[1:])]
        if loss_scale is not None and not (unscale_(param_grads, loss_scale) and torch.isfinite(grads[0]).all()):
            return torch.full_like(grads[0], math.nan), False
        for param, grad in zip(self.params, param_grads):
            param.grad = grad
        return grads[0], True

    def _hand_over_gradients(self, batch: int) -> None:
        """After a backward was answered: the stage optimizer accumulates its gradients (and steps)."""
        if self.optimizer is None:
            return
        try:
            with self.lock:
                epoch = self.optimizer.local_epoch
                self.optimizer.step(batch_size=batch)
                self.optimizer.zero_grad()
            if self.optimizer.local_epoch > epoch and self.events is not None:
                self.events.emit(StageStep(self.stage, self.optimizer.local_epoch))
        except Exception as e:  # the caller has its gradient; the next backward or idle period tries again
            log.warning("Stage %d: the optimizer failed after a backward: %r", self.stage, e)

    def busy(self) -> bool:
        """Whether requests are queued or being computed."""
        return self._tasks.qsize() > 0 or self.lock.locked()

    def _optimizer_bytes(self) -> torch.Tensor:
        with self.lock:
            buffer = io.BytesIO()
            torch.save(self.optimizer.state_dict(), buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the stage's current state (stage-local keys), taken between two requests, with the last
        optimizer step in it."""
        return self.state_and_step()[0]

    def state_and_step(self) -> tuple[dict[str, torch.Tensor], Optional[int]]:
        """:meth:`state_dict`, and the optimizer step (epoch) that state is at (None: no optimizer here)."""
        with self.lock:
            if self.optimizer is not None:
                self.optimizer.apply_finished_update(wait=True)
            state = {k: t.detach().cpu().clone() for k, t in self.module.state_dict().items()}
            return state, self.optimizer.local_epoch if self.optimizer is not None else None

    def shutdown(self) -> None:
        """Stop the worker; requests still queued are answered with an error."""
        for *_, future in self._tasks.close():
            _refuse(future, StageBusyError(f"stage {self.stage} is shutting down"))
        self._worker.join(timeout=30)

        self.kept.clear()
        device_memory.dump(self._snapshot_path)
