"""The stage server: answers forward and backward requests for the stage this peer serves (SWARM section 2).

Serving is split by role, as hivemind's ``moe/server`` splits it:

- this module, the connection handler: requests arrive over hivemind's libp2p RPC or the direct path
  (:mod:`~lightning_swarm.transport`), both answered by :meth:`StageServer.answer_tensors`. The caller's membership
  is checked first (on a stream, on its first message), the samples and bytes it claims against bounds; then it is
  decoded straight onto the stage's device, on a stream of the decoding thread's own, and validated beside the event
  loop, and checked against the stage's blocks on the meta device (:class:`~lightning_swarm.block_calls.MetaBlocks`):
  an input the blocks do not take is the caller's fault, refused before it costs any compute, and any input they
  take is served, so sequence length and batch size may change from request to request. Whether its values are
  finite is computed there too, but read only once its compute is done, so that no request waits for the one before
  it to know: one with NaN or Inf is refused then, its kept graph dropped and its gradients not accumulated. The
  reply is encoded on a stream of the encoding thread's own, once the device finished its compute, so that its copy
  never waits behind the next request's kernels. The decoding thread queues the request, and the worker hands its
  output to the encoding thread: no turn of the event loop stands between a request's decoding and its reply;
- the task pool (:mod:`~lightning_swarm.server.task_pool`): the accepted requests, in a bounded queue shared fairly
  between callers, handed over in batches where requests can share a pass;
- the runtime (:mod:`~lightning_swarm.server.runtime`): the one thread that computes on the device, never waiting
  for it per request;
- the backend (:mod:`~lightning_swarm.server.backend`): the stage's blocks, optimizer and kept forwards.

A request that fails validation or computation leaves the stage's parameters and accumulated gradients untouched.
A malformed request is refused with :class:`~lightning_swarm.errors.SwarmRequestError` (the caller's fault; NaN or
Inf in a tensor with :class:`~lightning_swarm.errors.NonFiniteInputError`); one that runs out of memory is answered
"busy" (the caller tries another peer, or waits), once what it held is freed; any other failure of a well-formed
request is the server's (:class:`~lightning_swarm.errors.StageFailedError`: the caller fails over). The throughput
a server publishes is measured on its requests' compute on the device.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm import block_calls, chain_wiring, compression, device_sync, protocol, security
from lightning_swarm.block_calls import Call
from lightning_swarm.errors import (
    ActivationsLostError,
    ChainBrokenError,
    NonFiniteInputError,
    NotServingError,
    StageBusyError,
    StageFailedError,
    SwarmRequestError,
)
from lightning_swarm.events import EventQueue
from lightning_swarm.logs import RateLimit
from lightning_swarm.precision import activation_dtypes
from lightning_swarm.protocol import stage_uid
from lightning_swarm.security import AccessPolicy
from lightning_swarm.server import device_memory
from lightning_swarm.server.backend import StageBackend, StageOptimizer
from lightning_swarm.server.onward import Onward
from lightning_swarm.server.runtime import StageRuntime, out_of_memory, refuse
from lightning_swarm.server.task_pool import Task, TaskPool
from lightning_swarm.stage_api import StageService

log = logging.getLogger(__name__)

BUSY_LOG_PERIOD = 10.0  # seconds between two log lines about one caller's busy answers of one kind
BUSY_HOLD = 0.25  # seconds a caller answered busy more than once a second waits for each further busy answer
MAX_HELD = 256  # busy answers held at once; beyond, they are sent at once
CODEC_THREADS = min(32, (os.cpu_count() or 1) + 4)  # threads that decode and encode (asyncio's default executor's)


class StageServer(StageService):
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
        max_request_samples: requests claiming more samples (their first dimension) are refused; also the most
            samples of inference forwards run together in one batch.
        max_activation_bytes: memory for the graphs of training forwards awaiting their backward (what autograd
            saved, and the stage's input and output; past it, the caller holding the most for the share of its
            forwards whose backward came gives up its oldest, and their backward recomputes).
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
        self.backend = StageBackend(
            stage,
            module,
            device,
            optimizer,
            events,
            precision,
            max_activation_bytes,
            activation_timeout,
            checkpoint_activations,
        )
        self.precision = precision
        self.activation_dtypes = activation_dtypes(precision)  # what requests may carry
        self.run_id, self.stage, self.uid = run_id, stage, stage_uid(run_id, stage)
        self.module, self.device, self.optimizer = module, device, optimizer
        self.kept, self.params, self.lock = self.backend.kept, self.backend.params, self.backend.lock
        self.max_request_bytes, self.max_request_samples = max_request_bytes, max_request_samples
        self._snapshot_path = device_memory.start_recording(device)
        self.policy = policy  # callers off its allow-list, or without the swarm's secret, are refused
        self._tasks = TaskPool(max_queue, max_batch_samples=max_request_samples)
        self._busy_lines = RateLimit(BUSY_LOG_PERIOD)  # a line per caller and kind of busy answer each period
        self._busy_at_once = RateLimit(1.0)  # a caller's first busy answer each second is sent at once
        self._held = 0  # busy answers being held (counted on the event loop only)
        self.runtime = StageRuntime(self.backend, self._tasks, self._overloaded, idle_period, throttle)
        self.onward = Onward(stage, 4 * max_request_bytes)  # hands chained requests on; its router is set later
        self._codec = ThreadPoolExecutor(CODEC_THREADS, f"stage{stage}-codec")  # decoding and encoding

    @property
    def throughput(self):
        """The samples per second the stage computes (an exponential moving average over its requests)."""
        return self.runtime.throughput

    @property
    def backward_samples(self) -> int:
        """Samples whose gradients reached the stage optimizer."""
        return self.runtime.backward_samples

    @property
    def skipped_samples(self) -> int:
        """Samples whose gradients were not finite (a 16-mixed overflow): not accumulated."""
        return self.runtime.skipped_samples

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
            queued_samples=self._tasks.queued_samples,
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
            optimizer = await asyncio.get_running_loop().run_in_executor(None, self.backend.optimizer_bytes)
            state, step = {"optimizer": optimizer}, None
        else:
            state, step = await asyncio.get_running_loop().run_in_executor(None, self.backend.state_and_step)
        response = runtime_pb2.ExpertResponse(
            tensors=[compression.serialize(t, "none") for t in state.values()],
            metadata=protocol.encode_metadata({"keys": list(state), "step": step}),
        )
        for part in protocol.stream_response(response):
            yield part

    # ---- validation ---------------------------------------------------------------------------------------------

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
        arrived = time.monotonic()
        try:
            self._check_uid(request.uid)
            metadata = protocol.decode_metadata(request.metadata)
            parcel = chain_wiring.collect_key(metadata)
            if parcel is not None:
                if kind != "forward" or len(request.tensors):
                    raise SwarmRequestError("a parcel is collected by a forward request without tensors")
                wait = chain_wiring.collect_wait(metadata)
                return [await self.onward.parcels.take_when_parked(parcel, wait, caller)]
            codec = str(metadata.get("codec", "none"))
            if codec not in compression.CODECS:
                raise SwarmRequestError(f"unknown compression {codec!r}")
            key = metadata.get("keep" if kind == "forward" else "kept")
            if key is not None and not (isinstance(key, str) and 0 < len(key) <= 64):
                raise SwarmRequestError("a kept forward's key must be a string of 1 to 64 characters")
            chained = chain_wiring.is_chained(metadata)
            hops = chain_wiring.onward_hops(metadata, kind) if chained else []
            deadline = chain_wiring.deadline(metadata, arrived) if chained else None
            passed = sum(hop.get("sides", 0) for hop in hops)  # side inputs of the hops after this one
            if passed > len(request.tensors):
                raise SwarmRequestError(f"onward hops claim {passed} side inputs of {len(request.tensors)} tensors")
            split = len(request.tensors) - passed
            tensors, onward = request.tensors[:split], request.tensors[split:]
            expected = 1 if kind == "forward" or key is not None else 2
            tree = self._side_inputs_tree(metadata)
            if len(tensors) < expected or (tree is None and len(tensors) != expected):
                raise SwarmRequestError(f"{kind} expects {expected} tensor(s), got {len(tensors)}")
            self._check_shapes(tensors[:expected], [*tensors[expected:], *onward])
            if not self._tasks.admits(caller):  # before its tensors cost any decoding
                raise self._busy()
            loss_scale = self._loss_scale(kind, metadata)
            # a scaled gradient may have overflowed upstream: a backward with it is skipped, not refused
            finite = [True] * (expected - 1) + [loss_scale is None]
            train = bool(metadata.get("train", True))

            def reply(task: Task, output: torch.Tensor, done: device_sync.Mark) -> compression.WireTensor:
                encoded = self._encode(task, output, done, codec)
                if not chained:
                    return encoded
                return self.onward.hand_on(kind, encoded, metadata, hops, onward, task.batch, deadline)

            def decode_and_queue() -> tuple[Task, Future]:  # the worker takes it, then hands the output to a thread
                task = self._decode_request(kind, tensors, expected, finite, tree, key, loss_scale, train)
                answer = _when_computed(task, reply, self.onward.pool if hops else self._codec)
                self._submit(caller, task, key, metadata["origin"] if chained else caller)
                return task, answer

            loop = asyncio.get_running_loop()  # a request's way from decoding to its reply takes no turn of it
            task, answer = await loop.run_in_executor(self._codec, decode_and_queue)
            try:
                encoded = await asyncio.wrap_future(answer)
            except asyncio.CancelledError:
                task.future.cancel()  # the caller stopped waiting: not computed, if the worker has not begun
                raise
        except (ActivationsLostError, NotServingError, ChainBrokenError):
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
            if out_of_memory(e):  # in decoding or encoding (the worker answers busy itself)
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
        if tree is not None and not (isinstance(tree, list) and len(tree) == len(self.backend.blocks)):
            raise SwarmRequestError(f"side inputs for the stage's {len(self.backend.blocks)} blocks expected")
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
        kind: str,
        messages: Sequence[runtime_pb2.Tensor],
        expected: int,
        finite: list[bool],
        tree: Optional[list],
        key: Optional[str],
        loss_scale: Optional[float],
        train: bool,
    ) -> Task:
        """The request as a task: its activations (and gradient) and its blocks' calls, decoded on the stage's device
        on this thread's stream, and whether those named in ``finite`` are (not waited for: see :meth:`_encode`); an
        input the blocks do not take (on the meta device) is refused."""
        with device_sync.side_stream(self.device):
            tensors = list(map(self._decode, messages[:expected]))
            if tree is None:
                calls: list[Call] = [((), {})] * len(self.backend.blocks)
            else:
                calls = block_calls.unpack(tree, [self._decode_side(m) for m in messages[expected:]], len(tree))
            flag = device_sync.all_finite_later([t for t, checked in zip(tensors, finite) if checked])
            ready = device_sync.mark(self.device)
        if kind == "forward" or key is None:  # a kept forward's backward carries no input
            try:
                self.backend.meta.activation(0, tensors[0], calls, train)
            except Exception as e:
                raise SwarmRequestError(
                    f"stage {self.stage}'s blocks do not take an input of shape {list(tensors[0].shape)} with these "
                    f"side inputs: {e!r:.300}"
                ) from None
        batch = int(tensors[0].shape[0])
        return Task(kind, tensors, train, batch, None, loss_scale, calls, Future(), ready, flag)

    def _encode(self, task: Task, output: torch.Tensor, done: device_sync.Mark, codec: str) -> compression.WireTensor:
        """The reply, encoded on this thread's stream once the compute that made it is done; or, if the request held
        NaN or Inf where it must not, :class:`NonFiniteInputError`. The stage computed on it, as it did not wait to
        know: a training forward's kept graph is dropped, and a backward's gradients were not accumulated (the
        runtime read the same flag). So an input is checked without holding up the request behind it."""
        if not task.finite.read():  # computed before the compute began: no wait once ``done`` is reached
            if task.kind == "forward" and task.key is not None:
                self.kept.pop(task.key)
            raise NonFiniteInputError("tensor contains NaN or Inf")
        with device_sync.side_stream(self.device):
            device_sync.wait_for(done, [output])
            return compression.encode(output, codec)

    def _decode_side(self, message: runtime_pb2.Tensor) -> torch.Tensor:
        """A side input, exactly as sent (any dtype; masks may hold -inf)."""
        try:
            return compression.deserialize(message, device=self.device)
        except Exception as e:
            if out_of_memory(e):
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

    def _decode(self, message: runtime_pb2.Tensor) -> torch.Tensor:
        try:
            tensor = compression.deserialize(message, device=self.device)
        except Exception as e:
            if out_of_memory(e):
                raise  # the device is full, the message may be fine: answered busy
            raise SwarmRequestError(f"undecodable tensor: {e!r}") from None
        if tensor.numel() == 0:  # costs no bytes whatever its batch dimension, which would count as samples
            raise SwarmRequestError(f"empty tensor of shape {list(tensor.shape)}")
        if tensor.dtype not in self.activation_dtypes:
            expected = " or ".join(map(str, self.activation_dtypes))
            raise SwarmRequestError(f"expected a {expected} tensor, got {tensor.dtype} (precision {self.precision})")
        return tensor

    def _submit(self, caller: str, task: Task, key: Optional[str], owner: str) -> None:
        """Queue a decoded request for the runtime (the caller's fair share of the queue kept); ``key``: the kept
        forward it keeps or uses, ``owner``'s (the caller's own; a chained request's, its trainer's)."""
        if not self.runtime.is_alive():
            raise StageFailedError(f"stage {self.stage}'s worker is not running")
        task.key = None if key is None else (owner, key)
        try:
            displaced = self._tasks.put(caller, task)
        except queue.Full:
            raise self._busy() from None
        if displaced is not None:  # the newest request of the caller that held the most places
            refuse(displaced.future, StageBusyError(f"stage {self.stage} is busy: other callers need their share"))

    def _busy(self) -> StageBusyError:
        return StageBusyError(f"stage {self.stage} is busy ({self._tasks.maxsize} requests queued)")

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

    def busy(self) -> bool:
        """Whether requests are queued or being computed."""
        return self._tasks.qsize() > 0 or self.lock.locked()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the stage's current state (stage-local keys), taken between two requests, with the last
        optimizer step in it."""
        return self.backend.state_and_step()[0]

    def state_and_step(self) -> tuple[dict[str, torch.Tensor], Optional[int]]:
        """The stage's current state and the optimizer step (epoch) that state is at (None: no optimizer here)."""
        return self.backend.state_and_step()

    def shutdown(self) -> None:
        """Stop the runtime; requests still queued are answered with an error."""
        for task in self._tasks.close():
            refuse(task.future, StageBusyError(f"stage {self.stage} is shutting down"))
        self.runtime.join(timeout=30)
        self.onward.close()
        self._codec.shutdown(wait=False)  # replies being encoded or queued to be still go out
        self.kept.clear()
        device_memory.dump(self._snapshot_path)


def _when_computed(
    task: Task, reply: Callable[[Task, torch.Tensor, device_sync.Mark], compression.WireTensor], pool: Executor
) -> Future:
    """The future of ``reply(task, output, done)``, run on ``pool`` as soon as the runtime answered ``task``: the
    worker hands it to a thread of ``pool`` itself, with no turn of the event loop between the compute and the
    reply's encoding. A failed compute's error, or a pool shut down with the server, is the reply's at once."""
    computed, answer = task.future, Future()

    def settle() -> None:
        if answer.set_running_or_notify_cancel():  # else the caller stopped waiting
            try:
                answer.set_result(reply(task, *computed.result()))
            except Exception as e:
                answer.set_exception(e)

    def closing() -> None:
        refuse(answer, StageBusyError("the stage server is shutting down"))

    def hand(_: Future) -> None:
        if computed.cancelled():
            answer.cancel()
        elif computed.exception() is not None:
            refuse(answer, computed.exception())
        else:
            try:
                job = pool.submit(settle)
            except RuntimeError:  # shut down
                closing()
                return
            job.add_done_callback(lambda job: job.cancelled() and closing())

    computed.add_done_callback(hand)
    return answer
