"""The remote pipeline: runs segments of the pipeline's blocks on the swarm, forward and backward.

A segment is a run of consecutive blocks called with their side inputs (:mod:`~lightning_swarm.block_calls`); it
crosses one or more stages, each a *hop*. :mod:`~lightning_swarm.client.remote_blocks` puts stand-ins for the blocks
in the model and hands this module the segments the model's own loop calls, so the user's ``training_step`` and loss
code run unchanged; an ``nn.Sequential`` pipeline is run whole by :meth:`RemotePipeline.forward`. Backward goes to
the peer that ran the forward with the output gradient alone: that peer kept the forward's graph. The input of every
hop (and its side inputs) is also kept on the caller: if that peer died or dropped the graph, they go with the
gradient to any peer of the stage, which recomputes the forward from them.

Activations and gradients are encoded once, where they are made (a batch's microbatches in one pass): a stage's
reply goes on to the next stage as it came, compressed and unread, and only the pipeline's output and input gradient
are decoded here, on the device of the tensor they replace. Every reply is checked first
(:class:`~lightning_swarm.client.routing.ReplyCheck`): a forward's output has the microbatch's samples and the shape
(and under ``-true`` precisions the dtype) that the blocks on the meta device return for that input; a backward's
input gradient has the hop input's shape and dtype. A relayed reply is checked by its header and framing; its values
are checked by the stage it goes to, which refuses NaN or Inf
(:class:`~lightning_swarm.errors.NonFiniteInputError`), and a reply this process decodes must be finite too. A peer
that answers otherwise is banned and the microbatch goes to another peer. Side inputs are sent exactly.

A batch is split into equal microbatches that travel through the stages concurrently (each on its own route), so
that one trainer keeps several stages busy at once and their transfers overlap other microbatches' compute: by
default (``"auto"``) as many as measured fastest (``microbatch_tuning``). Side inputs whose first dimension is the
batch are split with it; the others are shared by every microbatch. Outputs and input gradients are concatenated
back, so the loss and the gradients equal the unsplit batch's: each microbatch's output gradient is scaled to be
that of its own mean loss, which is what the stage optimizers accumulate, and the returned gradient is scaled back.

A forward run while :attr:`RemotePipeline.trail_backward` is set leaves its backward running behind: autograd's
backward through the pipeline only sends the output gradient on, and returns at once, so that the trainer's next
batch starts its forward while the stages still compute this one's backward. The input gradient reaches the modules
before the pipeline when :meth:`RemotePipeline.finish_backward` is called: the strategy calls it once the next
batch's backward has left in turn (that one's sends do not wait for the older one's end), and before training ends.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
from hivemind.proto import runtime_pb2
from torch import nn
from torch.utils import _pytree as pytree

from lightning_swarm import block_calls, compression, protocol
from lightning_swarm.block_calls import Call, MetaBlocks
from lightning_swarm.chain_wiring import Receipt, ReceiptCheck
from lightning_swarm.client.microbatch_tuning import Microbatches, MicrobatchTuner
from lightning_swarm.client.routing import PendingCall, ReplyCheck, StageRouter, ban_seconds
from lightning_swarm.errors import (
    CALLERS_FAULT,
    ActivationsLostError,
    BadReplyError,
    ChainBrokenError,
    NonFiniteInputError,
    StageUnavailableError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_THREADS = 64  # microbatches in flight at once with "auto"; threads start only as microbatches need them


@dataclass(frozen=True)
class Hop:
    """One stage's part of a segment: its blocks called with ``calls`` (None: with the activation alone), the last
    returning ``output`` (on the meta device, full batch; None: not known)."""

    stage: int
    calls: Optional[list[Call]] = None
    output: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Request:
    """A hop's side inputs for one microbatch, as sent: the tensors after the activation and the metadata."""

    tensors: list[runtime_pb2.Tensor]
    metadata: dict


@dataclass(frozen=True)
class Segment:
    """Blocks ``first``, ``first + 1``, ... of the pipeline called with ``calls`` (full batch), each returning the
    activation in ``outputs`` (on the meta device), in training mode or not. It starts and ends at stage boundaries
    (:meth:`RemotePipeline.boundaries`): a stage runs its blocks together."""

    first: int
    calls: list[Call]
    outputs: list[torch.Tensor]
    training: bool


@dataclass(frozen=True)
class Landing:
    """Where this process decodes a microbatch's last reply: on ``device``, into ``out`` (its slice of the tensor
    that assembles the batch; None: a tensor of its own), divided by ``scale``. A backward sends the microbatch's
    output gradient times ``scale`` (the gradient of its own mean loss: the stages accumulate those) and divides the
    input gradient that comes back by it."""

    device: torch.device
    out: Optional[torch.Tensor] = None
    scale: float = 1.0


@dataclass(frozen=True)
class Trailing:
    """A backward left running behind (:meth:`RemotePipeline.finish_backward`): its input gradient to come, and the
    pipeline's input as the model made it (None: nothing before the pipeline takes a gradient)."""

    grad_inputs: Future
    inputs: Optional[torch.Tensor]


@dataclass
class Route:
    """A microbatch's way through the hops: each hop's stage, input (as sent) and side inputs, the peer that ran it,
    and the key under which that peer keeps the forward's graph; whether it ran in training mode."""

    train: bool = True
    stages: list[int] = field(default_factory=list)
    inputs: list[Optional[runtime_pb2.Tensor]] = field(default_factory=list)  # None: sent stage to stage
    peers: list[str] = field(default_factory=list)
    keys: list[Optional[str]] = field(default_factory=list)  # None: the forward was not kept (no backward expected)
    sides: list[Optional[Request]] = field(default_factory=list)
    # a chained forward whose output came before its receipt: waits for the receipt to be read (``peers``), raising
    # what reading it raised; and the microbatch's forward again, relayed, if it failed (RemotePipeline._settled)
    receipt: Optional[Callable[[], None]] = field(default=None, repr=False, compare=False)
    redo: Optional[Callable[[Exception], tuple[torch.Tensor, Route]]] = field(default=None, repr=False, compare=False)


class RemotePipeline(nn.Module):
    """Runs the pipeline's blocks on the swarm. Holds no parameters: those live on the stage servers.

    Args:
        spans: each stage's blocks ``[start, end)``; None: each stage is called whole, without side inputs.
        microbatches: a batch is split into this many equal microbatches in flight at once (fewer when the batch
            size is not a multiple: the largest divisor of the batch size not above it), or ``"auto"``: tuned by
            measuring the batches' times (:class:`~lightning_swarm.client.microbatch_tuning.MicrobatchTuner`).
        loss_scale: returns the scale of the trainer's GradScaler (``16-mixed``), or None: the gradients sent to
            the stages are scaled by it, and it travels with them so that the stages unscale theirs.
        exact_dtype: replies must have the dtype the blocks on the meta device return (``-true`` precisions);
            otherwise any floating dtype (under autocast the stage decides).
        meta: the pipeline's blocks on the meta device, for :meth:`forward` to check replies against (None: only
            their sample count is checked).
        wiring: ``"chain"``: a microbatch goes from stage to stage, the trainer sending only the first stage's
            input (and side inputs of all) and collecting the last one's output (:mod:`~lightning_swarm.chain_wiring`);
            ``"star"``: this process relays every boundary.
    """

    def __init__(
        self,
        router: StageRouter,
        codec: str = "8bit",
        microbatches: Microbatches = "auto",
        loss_scale: Optional[Callable[[], Optional[float]]] = None,
        spans: Optional[Sequence[tuple[int, int]]] = None,
        exact_dtype: bool = True,
        meta: Optional[MetaBlocks] = None,
        wiring: str = "star",
    ) -> None:
        super().__init__()
        self.router, self.loss_scale, self.exact_dtype, self.meta = router, loss_scale, exact_dtype, meta
        self.wiring = wiring
        self.spans = None if spans is None else [tuple(span) for span in spans]
        self.tuner = MicrobatchTuner(microbatches, router.num_stages)
        self.codec = compression.check_codec(codec)
        self.trail_backward = False
        """the backward of a forward run now may run behind, until :meth:`finish_backward` (see the module
        docstring); set by the strategy per batch."""
        most = MAX_THREADS if self.tuner.microbatches == "auto" else self.tuner.microbatches
        # a batch's forward beside the previous batch's trailing backward: twice the microbatches in flight
        self._pool = ThreadPoolExecutor(2 * most, "swarm-microbatch") if most > 1 else None
        # two: a batch's backward leaves while the one before it still ends (see finish_backward)
        self._behind = ThreadPoolExecutor(2, "swarm-backward")
        # chains' receipts read after their parcel came: each once it is in, so a thread is never held waiting
        self._receipts = ThreadPoolExecutor(2, "swarm-receipt")
        self._slots = _Slots()
        self._relaying = _RelayPause()  # chains paused after a stage server could not hand on
        self._trailing: list[Trailing] = []
        self._latest = (0.0, 0.0)  # the latest backward through the stages: its forward's start, its end
        self._latest_lock = threading.Lock()

    @property
    def num_stages(self) -> int:
        return self.router.num_stages

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Every stage, each block called with the activation alone (an ``nn.Sequential`` pipeline)."""
        if self.meta is None:
            return self.run(inputs, None)
        calls: list[Call] = [((), {})] * len(self.meta)
        outputs, hidden = [], inputs
        for block in range(len(self.meta)):
            hidden = block_calls.activation_of(self.meta.output(block, hidden, (), {}, self.training))
            outputs.append(hidden)
        return self.run(inputs, Segment(0, calls, outputs, self.training))

    def run(self, inputs: torch.Tensor, segment: Optional[Segment]) -> torch.Tensor:
        """The activation after ``segment`` (None: every stage whole), differentiable when grad is enabled."""
        if not torch.is_grad_enabled():
            return self.run_forward(inputs, segment=segment)[0]
        anchor = torch.empty(0, device=inputs.device, requires_grad=True)  # backward reaches the stages through it
        if self.trail_backward:  # the input's graph is held apart, for finish_backward: the loss's backward stops here
            return _RemoteStages.apply(self, anchor, inputs.detach(), segment, _Held(inputs))
        return _RemoteStages.apply(self, anchor, inputs, segment, None)

    def run_forward(
        self, inputs: torch.Tensor, keep: bool = False, segment: Optional[Segment] = None
    ) -> tuple[torch.Tensor, list[Route]]:
        """Forward through the hops, microbatches concurrently; returns the output and each microbatch's route.
        ``keep``: the peers keep the forward's graph for the backward that follows."""
        hops = self._hops(segment)
        parts = self._split(inputs.detach(), [] if segment is None else segment.calls)
        # a side input shared by the microbatches is encoded once; the tensor is held so that its id stays its own
        encoded: dict[int, tuple[torch.Tensor, compression.WireTensor]] = {}
        sides = [self._side_requests(hops, calls, encoded) for _, calls in parts]
        train = self.training if segment is None else segment.training
        sizes, last = [int(x.shape[0]) for x, _ in parts], hops[-1][1]
        n = len(parts)
        if last.output is not None and self.exact_dtype:  # the replies' shape and dtype are known: decoded in place
            output = _assembly(inputs, [int(inputs.shape[0]), *last.output.shape[1:]], last.output.dtype)
            landings = [Landing(inputs.device, out) for out in output.split(sizes)]
        else:
            output, landings = None, [Landing(inputs.device)] * n
        hidden = compression.encode_split(inputs, self.codec, sizes)  # one pass for all microbatches
        forward = partial(self._slots.run, self._places(n), self._forward_route)
        results = self._map(forward, hidden, sides, [hops] * n, [keep] * n, [train] * n, landings)
        if output is None:
            output = torch.cat([decoded for decoded, _ in results]).to(inputs.device)
        return output, [route for _, route in results]

    def run_backward(self, grad_outputs: torch.Tensor, routes: list[Route], reserved: bool = False) -> torch.Tensor:
        """Backward through the hops along the routes of ``run_forward``, microbatches concurrently; their input
        gradients are decoded into one tensor. ``reserved``: their places in flight were taken already."""
        if not reserved:
            self._slots.reserve(len(routes))
        try:
            first, scale = routes[0].inputs[0], len(routes)  # equal microbatches
            sizes = [int(route.inputs[0].size[0]) for route in routes]
            shape, dtype = [sum(sizes), *first.size[1:]], compression.decoded_dtype(first)
            grad_inputs = _assembly(grad_outputs, shape, dtype)
            landings = [Landing(grad_outputs.device, out, scale) for out in grad_inputs.split(sizes)]
            loss_scale = self.loss_scale() if self.loss_scale is not None else None
            grads = compression.encode_split(grad_outputs, self.codec, sizes, scale)  # each its microbatch's mean loss
        except BaseException:
            self._slots.free(len(routes))
            raise
        self._map(partial(self._slots.held, self._backward_route), grads, routes, [loss_scale] * scale, landings)
        return grad_inputs

    def _places(self, count: int) -> int:
        """How many microbatches may be in flight while a batch of ``count`` starts its forward: ``count`` where
        this process sends both a forward and a backward to the same stage's queue (star wiring, or one stage);
        under chain wiring a stage's queue holds this process's forwards (the first stage) or backwards (the last)
        and the other direction's come from the peer handing them on, each within its own share: twice."""
        return count if self.wiring == "star" or self.num_stages == 1 else 2 * count

    def finish_backward(self, scale: float = 1.0, but_latest: bool = False) -> None:
        """Wait for the backwards left running behind, oldest first, and take their input gradients, times
        ``scale``, back through the modules before the pipeline; a failed one raises here. A segment run before one
        of them (the model read an activation between stages) is taken back in turn, unscaled. ``but_latest``: the
        backward left behind last (the current batch's, already sent) runs on."""
        running = [self._trailing.pop()] if but_latest and self._trailing else []
        try:
            self._land(scale)
        finally:
            self._trailing += running

    def _land(self, scale: float) -> None:
        while self._trailing:
            trailing, self._trailing = self._trailing, []
            for behind in trailing:
                grad_inputs = behind.grad_inputs.result()
                if behind.inputs is not None:
                    grad = grad_inputs.to(device=behind.inputs.device, dtype=behind.inputs.dtype)
                    torch.autograd.backward(behind.inputs, grad * scale if scale != 1.0 else grad)
            scale = 1.0

    def _leave_behind(self, grad_outputs: torch.Tensor, routes: list[Route], started: float, inputs: _Held) -> None:
        """Run the backward along ``routes`` on a backward thread; :meth:`finish_backward` lands it."""
        self._slots.reserve(len(routes))  # before the next batch's forward asks for places
        try:
            grad_inputs = self._behind.submit(self._backward_timed, grad_outputs, routes, started, reserved=True)
        except BaseException:
            self._slots.free(len(routes))
            raise
        self._trailing.append(Trailing(grad_inputs, inputs.tensor if inputs.tensor.requires_grad else None))
        self.router.stats.add(trailing=1)

    def _backward_timed(
        self, grad_outputs: torch.Tensor, routes: list[Route], started: float, reserved: bool = False
    ) -> torch.Tensor:
        """:meth:`run_backward`, with the seconds the stages spent on this batch alone recorded for microbatch
        tuning: from its forward's start, or from the end of an earlier forward's backward that ended later (a
        trailing backward the forward overlapped), to its backward's end. Its latency would count its wait behind
        the batch before it, and the count should win throughput."""
        grad_inputs = self.run_backward(grad_outputs, routes, reserved)
        batch_size = grad_outputs.shape[0] if grad_outputs.ndim else 1
        ended = time.perf_counter()
        with self._latest_lock:  # two backwards may end at once (finish_backward)
            earlier_started, earlier_ended = self._latest
            overlapped = earlier_started < started < earlier_ended
            if started >= earlier_started:
                self._latest = (started, ended)
        self.tuner.record(batch_size, len(routes), ended - (earlier_ended if overlapped else started), overlapped)
        return grad_inputs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._behind.shutdown(wait=False)
        self._receipts.shutdown(wait=False)

    @property
    def boundaries(self) -> set[int]:
        """The blocks at which a stage starts, and the pipeline's length: where segments may start and end."""
        return {start for start, _ in self.spans} | {self.spans[-1][1]} if self.spans else set()

    def _hops(self, segment: Optional[Segment]) -> list[tuple[int, Hop]]:
        """The stages a segment crosses, as (index of the stage's first block in the segment, hop)."""
        if segment is None:
            return [(0, Hop(stage)) for stage in range(self.num_stages)]
        last = segment.first + len(segment.calls)
        if not {segment.first, last} <= self.boundaries:
            raise ValueError(f"segment {segment.first}..{last - 1} does not start and end at stage boundaries")
        hops = []
        for stage, (start, end) in enumerate(self.spans):
            if segment.first <= start and end <= last:
                begin = start - segment.first
                calls = segment.calls[begin : begin + end - start]
                hops.append((begin, Hop(stage, calls, segment.outputs[begin + end - start - 1])))
        return hops

    def _split(self, inputs: torch.Tensor, calls: list[Call]) -> list[tuple[torch.Tensor, list[Call]]]:
        """Equal microbatches of the input and of the side inputs that have its batch dimension (a side input is
        split when its first dimension is the batch size; when the activation's second dimension is too, that is
        ambiguous and the batch is not split)."""
        size = inputs.shape[0] if inputs.ndim else 1
        batched = [t for t in _side_tensors(calls) if t.ndim and t.shape[0] == size]
        count = self.tuner.count(size)
        if batched and inputs.ndim > 1 and inputs.shape[1] == size:
            count = 1
        xs = inputs.chunk(count)
        if not batched:  # each microbatch's calls are the batch's
            return [(x, calls) for x in xs]
        pieces = {id(t): t.chunk(count) for t in batched}
        return [(x, [_slice_call(call, pieces, i) for call in calls]) for i, x in enumerate(xs)]

    def _side_requests(
        self,
        hops: list[tuple[int, Hop]],
        calls: list[Call],
        encoded: dict[int, tuple[torch.Tensor, compression.WireTensor]],
    ) -> list[Optional[Request]]:
        """Each hop's side inputs for one microbatch (None for a whole stage): each distinct tensor once per hop,
        sent exactly."""
        requests = []
        for begin, hop in hops:
            if hop.calls is None:
                requests.append(None)
                continue
            tree, tensors = block_calls.pack(calls[begin : begin + len(hop.calls)])
            for t in tensors:
                if id(t) not in encoded:
                    encoded[id(t)] = (t, compression.encode(t, "none"))
            messages = [encoded[id(t)][1] for t in tensors]
            requests.append(Request(messages, {"calls": tree}))
        return requests

    def _map(self, fn: Callable[..., T], *iterables: list) -> list[T]:
        if self._pool is None or len(iterables[0]) == 1:
            return list(map(fn, *iterables))
        return list(self._pool.map(fn, *iterables))

    def _reply_check(self, batch: int, hop: Hop, landing: Optional[Landing]) -> ReplyCheck:
        shape = None if hop.output is None else [batch, *hop.output.shape[1:]]
        dtype = hop.output.dtype if hop.output is not None and self.exact_dtype else None
        return _check_at(landing, batch, shape, dtype)

    def _forward_route(
        self,
        hidden: runtime_pb2.Tensor,
        sides: list[Optional[Request]],
        hops: list[tuple[int, Hop]],
        keep: bool,
        train: bool,
        landing: Landing,
    ) -> tuple[torch.Tensor, Route]:
        """One microbatch (``hidden``, encoded) through the hops; the last reply is decoded at ``landing``, the others
        go on to the next stage unread (by this process, or under chain wiring by each stage's peer: if that chain
        breaks, the microbatch is sent again relayed here). A stage that finds NaN or Inf in the activation relayed
        to it blames the peer that sent it: that hop runs again on another peer."""
        self.router.stats.add(samples_sent=int(hidden.size[0]))
        broken: Optional[Exception] = None
        if self.wiring == "chain" and len(hops) > 1 and not self._relaying.active():
            route = Route(train, [hop.stage for _, hop in hops], [hidden] + [None] * (len(hops) - 1), sides=sides)
            route.keys = [uuid.uuid4().hex if keep else None for _ in hops]
            check = self._reply_check(int(hidden.size[0]), hops[-1][1], landing)
            route.redo = partial(self._relay, hidden, sides, hops, keep, train, None)
            try:
                self._chain_forward(hidden, route, check)
                self.router.stats.add(chained=1)
                self._relaying.passed()
                return check.decoded, route
            except (*CALLERS_FAULT, StageUnavailableError):
                raise  # the request was wrong, or the first stage has no peer: relaying would not help
            except Exception as e:  # a broken chain, a bad receipt or parcel, or the last peer gone since
                log.warning("Stage-to-stage forward failed (%r): relaying this microbatch instead", e)
                broken = e
                if isinstance(e, ChainBrokenError) or (isinstance(e, _ChainStopped) and e.at_server):
                    self._relaying.start(self.router.ban_timeout)
        return self._relay(hidden, sides, hops, keep, train, landing, broken)

    def _relay(
        self,
        hidden: runtime_pb2.Tensor,
        sides: list[Optional[Request]],
        hops: list[tuple[int, Hop]],
        keep: bool,
        train: bool,
        landing: Optional[Landing],
        broken: Optional[Exception] = None,
    ) -> tuple[torch.Tensor, Route]:
        """One microbatch through the hops, each reply relayed by this process; ``broken``: why a chain was given up
        for it (reported as a failover)."""
        route = Route(train)
        blamed = 0
        while len(route.peers) < len(hops):
            index = len(route.peers)
            (_, hop), side = hops[index], sides[index]
            key = uuid.uuid4().hex if keep else None
            check = self._reply_check(int(hidden.size[0]), hop, landing if index == len(hops) - 1 else None)
            extra = _parts(side)
            if side is not None:
                self.router.stats.add(side_bytes_sent=protocol.payload_bytes(side.tensors))
            try:
                reply, peer = self._call(hop.stage, "forward", [hidden, *extra[0]], check, train, keep=key, **extra[1])
            except NonFiniteInputError:
                if index == 0 or blamed >= self.router.max_retries:
                    raise
                blamed += 1
                self.router.blame(route.stages[-1], route.peers[-1], "an activation with NaN or Inf")
                hidden = route.inputs[-1]
                for kept in (route.stages, route.inputs, route.sides, route.peers, route.keys):
                    kept.pop()
                continue
            route.stages.append(hop.stage)
            route.inputs.append(hidden)
            route.sides.append(side)
            route.peers.append(peer)
            route.keys.append(key)
            hidden = reply
        if broken is not None:
            self._relayed(broken, route)
        return check.decoded, route

    def _relayed(self, broken: Exception, route: Route) -> None:
        """Report the failover of a chained forward that this process relayed along ``route`` instead: from the peer
        whose failed call stopped the chain at a stage server, if that server named it, to the peer the relay
        used in that stage; else from the chain to the relay (``"chain"`` to ``"star"``), counted as a chain break
        unless a call of this process failed (and was counted) first."""
        stopped = broken.failed if isinstance(broken, _ChainStopped) else None
        if stopped is not None and stopped[0] in route.stages:  # a stage of this route: the server's word
            stage, peer, error = stopped
            self.router.failed_over(stage, "forward", peer, route.peers[route.stages.index(stage)], error)
            return
        self.router.failed_over(route.stages[0], "forward", "chain", "star", broken)
        if isinstance(broken, (_ChainStopped, ChainBrokenError)):  # no call of this process failed
            self.router.stats.add(chain_breaks=1)

    def _chain_forward(self, hidden: runtime_pb2.Tensor, route: Route, check: ReplyCheck) -> runtime_pb2.Tensor:
        """Forward along ``route``'s stages, stage to stage; the peers that ran them go into ``route``. Returns the
        last stage's output as its peer parked it, once ``check`` passed it. If it came before the receipt (on its
        way back along the chain), it returns then, and the receipt is read once it comes (``route.receipt``)."""
        first, onward = route.sides[0], []
        tensors = [hidden, *(first.tensors if first is not None else [])]
        for stage, key, side in zip(route.stages[1:], route.keys[1:], route.sides[1:]):
            onward.append({"stage": stage, "keep": key, "calls": None if side is None else side.metadata["calls"]})
            onward[-1]["sides"] = 0 if side is None else len(side.tensors)
            tensors.extend(side.tensors if side is not None else [])
        for side in route.sides:
            if side is not None:
                self.router.stats.add(side_bytes_sent=protocol.payload_bytes(side.tensors))
        own, chained = {"keep": route.keys[0], **(first.metadata if first is not None else {})}, self._chained(onward)
        last = self.router.choose(route.stages[-1], check.batch)  # the last hop's peer, if it can take it
        if last is not None:
            onward[-1]["prefer"] = last
        metadata = {"codec": self.codec, "train": route.train, **own, **chained}
        waiting = None
        try:
            chain = self._start_chain(route.stages[0], tensors, metadata, check.batch)  # first: the device waits for it
            if last is not None:
                waiting = self._wait_for_parcel(route.stages[-1], last, chained["parcel"], check.batch)
            receipt = ReceiptCheck()
            if chain is not None and self._parcel_first(chain, waiting):
                route.receipt = self._read_later(chain, partial(self._forward_receipt, route, chain, receipt, last))
                return self._collected(route.stages[-1], last, chained["parcel"], check, waiting)
            # the first attempt's receipt, or another peer's where it failed, as any call fails over
            _, peer = self.router.call(
                route.stages[0], "forward", tensors, metadata, check.batch, check=receipt, sent=chain
            )
            self._read_receipt(route, peer, receipt.receipt)
            waited = waiting if route.peers[-1] == last else None  # else the hop before failed over from it
            return self._collected(route.stages[-1], route.peers[-1], chained["parcel"], check, waited)
        finally:
            if waiting is not None:
                waiting.cancel()  # a no-op once its parcel came

    def _start_chain(
        self, stage: int, tensors: list[runtime_pb2.Tensor], metadata: dict, batch: int
    ) -> Optional[PendingCall]:
        """A chained forward sent to the peer of its first stage that a call would try first, without waiting for
        its receipt; None if the stage has no peer to take it now (the call waits for one)."""
        peer = self.router.choose(stage, batch)
        return None if peer is None else self.router.start_call(stage, peer, "forward", tensors, metadata, batch)

    def _read_receipt(self, route: Route, peer: str, receipt: Receipt) -> None:
        """Take the peers of a chained forward's receipt, answered by ``peer``, into ``route``, and report its
        failovers; :class:`_ChainStopped` if the chain stopped before its last hop."""
        route.peers, stopped = [peer, *receipt.peers], receipt.stopped
        if len(route.peers) > len(route.stages) - stopped or (len(route.peers) < len(route.stages) and not stopped):
            raise BadReplyError(f"a receipt for {len(route.peers)} hops, expected {len(route.stages)}")
        self._report(receipt)
        if stopped:
            raise _ChainStopped(receipt)

    def _forward_receipt(self, route: Route, chain: PendingCall, receipt: ReceiptCheck, last: str) -> None:
        """The receipt of a chained forward whose output ``last`` gave before it came, read into ``route``."""
        self.router.finish(chain, receipt)
        self._read_receipt(route, chain.peer, receipt.receipt)
        if route.peers[-1] != last:
            raise BadReplyError(f"a receipt naming {route.peers[-1]} for the last hop, whose output {last} gave")

    def _collected(
        self, stage: int, peer: str, parcel: str, check: ReplyCheck, waiting: Optional[PendingCall]
    ) -> runtime_pb2.Tensor:
        """A chained forward's output from its last hop's ``peer``; if that failed (counted as this router's failed
        call), :class:`_ChainStopped` naming it."""
        try:
            return self._collect(stage, peer, parcel, check, waiting=waiting)
        except CALLERS_FAULT:
            raise
        except Exception as e:
            failed = [stage, "forward", peer, "", repr(e)]
            raise _ChainStopped(Receipt(stopped=True, failovers=[failed], error=repr(e)), at_server=False) from e

    @staticmethod
    def _parcel_first(chain: PendingCall, waiting: Optional[PendingCall]) -> bool:
        """Whether the collect ``waiting`` for a chain's parcel brought it before ``chain`` (the chained request)
        brought back the receipt. Waits for the first of the two."""
        if waiting is None or waiting.future is None or chain.future is None:
            return False
        first = concurrent.futures.FIRST_COMPLETED
        concurrent.futures.wait([chain.future, waiting.future], timeout=chain.timeout, return_when=first)
        came = waiting.future.done() and not waiting.future.cancelled() and waiting.future.exception() is None
        return came and not chain.future.done()

    def _read_later(self, chain: PendingCall, read: Callable[[], None]) -> Callable[[], None]:
        """Run ``read`` (a chain's receipt, read) on a receipt thread once ``chain``'s answer is in; returns a wait
        for it that raises what it raised. A receipt that fails is logged as it is read: a forward's route is
        repaired when its backward needs it (:meth:`_settled`), a backward's gradient came already."""
        outcome: Future = Future()

        def run() -> None:
            try:
                read()
                outcome.set_result(None)
            except BaseException as e:
                log.warning("A chain's receipt, read after its parcel came: %r", e)
                outcome.set_exception(e)

        def came(_: Future) -> None:  # on the RPC event loop's thread: the reading goes to a thread of its own
            try:
                self._receipts.submit(run)
            except RuntimeError as e:  # this pipeline was closed
                chain.cancel()
                outcome.set_exception(e)

        chain.future.add_done_callback(came)
        return partial(outcome.result, chain.timeout + 1.0)

    def _settled(self, route: Route) -> Route:
        """``route`` once its chain's receipt was read, if its forward returned before (see :meth:`_chain_forward`);
        if the receipt failed, the route of the microbatch's forward run again, relayed by this process, so that
        its backward finds the graphs it needs."""
        wait, route.receipt = route.receipt, None
        if wait is None:
            return route
        try:
            wait()
            return route
        except Exception as e:
            log.warning("A chained forward's receipt failed after its output came (%r): running it again, relayed", e)
            return route.redo(e)[1]

    def _chain_backward(
        self, hop: int, grad: runtime_pb2.Tensor, route: Route, loss_scale: Optional[float], landing: Landing
    ) -> tuple[int, runtime_pb2.Tensor, Optional[torch.Tensor], BaseException | str]:
        """Backward from ``hop`` down to the first hop, stage to stage along the peers that kept the forwards.
        Returns ``(-1, input gradient, decoded, "")`` if it got there; else the hop whose peer could not take it,
        the gradient parked for that hop and why (``""``: that peer dropped the graph). A parked gradient whose
        peer left before the trainer collected it is lost with the graphs the chain used up on its way: then it
        returns ``hop`` and ``grad`` again, to recompute from there. The first hop's peer is asked for the parcel
        as the chain starts (:meth:`_wait_for_parcel`); if the parcel comes before the receipt, it returns then, and
        the receipt is read once it comes."""
        onward = [{"stage": route.stages[i], "peer": route.peers[i], "kept": route.keys[i]} for i in range(hop)][::-1]
        metadata = {"codec": self.codec, "train": route.train, "kept": route.keys[hop], **self._chained(onward)}
        if loss_scale is not None:
            metadata["loss_scale"] = loss_scale
        receipt, batch, stage, peer = ReceiptCheck(), int(grad.size[0]), route.stages[hop], route.peers[hop]
        first = route.inputs[0]
        check = _check_at(landing, batch, first.size, compression.decoded_dtype(first), loss_scale is None)
        waiting: Optional[PendingCall] = None
        try:
            try:
                chain = self.router.start_call(stage, peer, "backward", [grad], metadata, batch)  # first: see forward
                waiting = self._wait_for_parcel(route.stages[0], route.peers[0], metadata["parcel"])
                if self._parcel_first(chain, waiting):
                    self._read_later(chain, partial(self._backward_receipt, hop, route, chain, receipt))
                    parked, failed = self._collect_parked(hop, route, 0, metadata["parcel"], check, waiting)
                    return (-1, parked, check.decoded, "") if parked is not None else (hop, grad, None, failed)
                self.router.finish(chain, receipt)
            except CALLERS_FAULT:
                raise
            except ActivationsLostError:
                return hop, grad, None, ""
            except Exception as e:
                log.warning("Stage %d: backward on %s failed (%r): recomputing on another peer", stage, peer, e)
                return hop, grad, None, e
            reached = self._backward_reached(hop, route, receipt.receipt)
            if receipt.receipt.stopped:
                parked, failed = self._collect_parked(hop, route, reached, metadata["parcel"], ReplyCheck(batch))
                if parked is None:
                    return hop, grad, None, failed
                return reached - 1, parked, None, receipt.receipt.error
            parked, failed = self._collect_parked(hop, route, 0, metadata["parcel"], check, waiting)
            return (-1, parked, check.decoded, "") if parked is not None else (hop, grad, None, failed)
        finally:
            if waiting is not None:
                waiting.cancel()  # a no-op once its parcel came; else the chain stopped before the first hop

    def _backward_reached(self, hop: int, route: Route, receipt: Receipt) -> int:
        """The hop whose peer holds the parcel of a chained backward from ``hop``, as its receipt says, whose
        failovers are reported; :class:`BadReplyError` if the receipt does not follow ``route``."""
        self._report(receipt)
        reached = hop - len(receipt.peers)
        expected = route.peers[max(reached, 0) : hop][::-1]
        if receipt.peers != expected or reached < int(receipt.stopped) or (reached > 0 and not receipt.stopped):
            raise BadReplyError(f"a receipt naming peers {receipt.peers} from hop {hop}")
        return reached

    def _backward_receipt(self, hop: int, route: Route, chain: PendingCall, receipt: ReceiptCheck) -> None:
        """The receipt of a chained backward from ``hop`` whose input gradient came before it, read."""
        self.router.finish(chain, receipt)
        if self._backward_reached(hop, route, receipt.receipt) != 0:
            raise BadReplyError(f"a receipt of a chain that stopped, from hop {hop}, whose input gradient came")

    def _wait_for_parcel(self, stage: int, peer: str, parcel: str, batch: int = 0) -> PendingCall:
        """A collect of ``parcel`` from ``peer`` that waits there until the chain parks it, sent with the chained
        request: the parcel comes back while the receipt is still on its way along the chain. ``batch``: samples
        counted in flight there meanwhile (a forward's, whose last hop this process chose)."""
        timeout = self.router.request_timeout
        collect = {"collect": parcel, "wait": timeout}
        return self.router.start_call(stage, peer, "forward", [], collect, batch, timeout + 1.0, timed=False)

    def _collect_parked(
        self,
        hop: int,
        route: Route,
        reached: int,
        parcel: str,
        check: ReplyCheck,
        waiting: Optional[PendingCall] = None,
    ) -> tuple[Optional[runtime_pb2.Tensor], BaseException | str]:
        """The gradient that the chain from ``hop`` parked on the peer of hop ``reached``, and ``""``; or None and
        why the chain is recomputed from ``hop`` (see :meth:`_chain_backward`). If that peer is ``hop``'s own, its
        error: the hop is recomputed on another peer. If it is further down, ``""``: the gradients between are gone,
        and so are the graphs the chain used, so ``hop`` is recomputed on its peer, then each hop below it; the
        holder's hop calls it again, which counts its failure (not counted here) and reports the failover."""
        holder = route.stages[reached], route.peers[reached]
        try:
            return self._collect(*holder, parcel, check, count=reached == hop, waiting=waiting), ""
        except CALLERS_FAULT:
            raise
        except Exception as e:
            if reached == hop:
                log.warning("Stage %d: collecting a gradient from %s failed (%r): recomputing", *holder, e)
                return None, e
            log.warning("Stage %d: collecting a gradient from %s failed (%r): recomputing from hop %d", *holder, e, hop)
            return None, ""

    def _collect(
        self,
        stage: int,
        peer: str,
        parcel: str,
        check: ReplyCheck,
        count: bool = True,
        waiting: Optional[PendingCall] = None,
    ) -> runtime_pb2.Tensor:
        """The parcel a chain parked on ``peer`` (of ``stage``), once ``check`` passed it; a failure is counted
        unless ``count`` is False (see :meth:`RemotePipeline._chain_backward`). ``waiting``: that parcel's collect
        already sent (:meth:`_wait_for_parcel`), which fails nobody: if it came back without the parcel (its wait ran
        out, the peer let it wait no longer or did not serve yet when it came), the parcel is asked for again."""
        if waiting is not None:
            try:
                reply = waiting.result()
            except CALLERS_FAULT:
                raise
            except Exception:
                pass
            else:
                return self.router.vet(stage, peer, reply, check, count)[0]
        return self.router.call_peer(stage, peer, "forward", [], {"collect": parcel}, check.batch, check, count)[0]

    def _chained(self, onward: list[dict]) -> dict:
        """A chained request's metadata: its onward hops, a new parcel key, and this trainer as the origin."""
        return {"onward": onward, "parcel": uuid.uuid4().hex, "origin": str(self.router.node.peer_id)}

    def _report(self, receipt: Receipt) -> None:
        """Count and report the failovers of a chain's stages, and the failed calls behind them, as this router's
        own."""
        for stage, method, failed, retried_on, error in receipt.failovers:
            self.router.count_failed(failed)
            if retried_on:  # else it stopped the chain: its failover is the relay's (_relayed)
                self.router.failed_over(stage, method, failed, retried_on, error)

    def _backward_route(
        self, grad: runtime_pb2.Tensor, route: Route, loss_scale: Optional[float], landing: Landing
    ) -> torch.Tensor:
        """One microbatch's output gradient (``grad``, encoded times ``landing.scale``) back through its route; only
        the first hop's input gradient is decoded (at ``landing``).
        A stage that finds NaN or Inf in the gradient relayed to it (never under a loss scale, where NaN reports an
        overflow) blames the peer that computed it: that hop runs again on another peer."""
        route = self._settled(route)
        if any(hidden is None for hidden in route.inputs):
            return self._backward_chain_route(grad, route, loss_scale, landing)
        grads = [grad]
        hop, blamed = len(route.peers) - 1, 0
        while hop >= 0:
            try:
                grad, decoded = self._backward_hop(hop, grads[-1], route, loss_scale, landing if hop == 0 else None)
            except NonFiniteInputError:
                if hop == len(route.peers) - 1 or blamed >= self.router.max_retries:
                    raise
                blamed += 1
                self.router.blame(route.stages[hop + 1], route.peers[hop + 1], "a gradient with NaN or Inf")
                route.keys[hop + 1] = None  # its graph is gone, and so is that peer: recompute elsewhere
                grads.pop()
                hop += 1
                continue
            grads.append(grad)
            hop -= 1
        return decoded

    def _backward_chain_route(
        self, grad: runtime_pb2.Tensor, route: Route, loss_scale: Optional[float], landing: Landing
    ) -> torch.Tensor:
        """One microbatch back along a chained route. Where a hop's peer could not take its gradient, that hop is
        recomputed on a peer of its stage from its input (sent again through the hops before it, unkept, if this
        process does not hold it) and the chain goes on from the hop before."""
        hop = len(route.peers) - 1
        while True:
            hop, grad, decoded, failed = self._chain_backward(hop, grad, route, loss_scale, landing)
            if hop < 0:
                return decoded
            if route.inputs[hop] is None:
                route.inputs[hop] = self._chain_input(hop, route)
            grad, decoded = self._backward_hop(hop, grad, route, loss_scale, landing if hop == 0 else None, failed)
            if hop == 0:
                return decoded
            hop -= 1

    def _chain_input(self, hop: int, route: Route) -> runtime_pb2.Tensor:
        """The input of ``hop`` again: the route's first input through the hops before it, unkept."""
        again = Route(route.train, route.stages[:hop], [route.inputs[0]] + [None] * (hop - 1), sides=route.sides[:hop])
        again.keys = [None] * hop
        check = ReplyCheck(int(route.inputs[0].size[0]))
        if hop > 1:
            return self._chain_forward(route.inputs[0], again, check)
        tensors, metadata = _parts(route.sides[0])
        return self._call(route.stages[0], "forward", [route.inputs[0], *tensors], check, route.train, **metadata)[0]

    def _backward_hop(
        self,
        hop: int,
        grad: runtime_pb2.Tensor,
        route: Route,
        loss_scale: Optional[float],
        landing: Optional[Landing] = None,
        failed: Optional[BaseException | str] = None,
    ) -> tuple[runtime_pb2.Tensor, Optional[torch.Tensor]]:
        """Backward on the peer that kept the forward; else recompute on a peer of the stage from the input (and the
        side inputs). Returns the input gradient as it came and, with ``landing``, decoded there. ``failed``: that
        peer is already known not to take it (chain wiring): why, or ``""`` if it dropped the graph."""
        stage, peer = route.stages[hop], route.peers[hop]
        scaled = {} if loss_scale is None else {"loss_scale": loss_scale}
        inputs = route.inputs[hop]  # the input gradient must be shaped like it; NaN reports an overflow
        check = _check_at(
            landing, int(inputs.size[0]), inputs.size, compression.decoded_dtype(inputs), loss_scale is None
        )
        if failed is None and route.keys[hop] is not None:
            try:
                kept = {"kept": route.keys[hop], **scaled}
                reply, _ = self._call(stage, "backward", [grad], check, route.train, peer, failover=False, **kept)
                return reply, check.decoded
            except CALLERS_FAULT:
                raise
            except ActivationsLostError:
                failed = ""  # that peer is alive but dropped the graph: let it recompute
            except Exception as e:
                log.warning("Stage %d: backward on %s failed (%r): recomputing on another peer", stage, peer, e)
                failed = e
        if failed is not None:
            self.router.stats.add(recomputed=1)
        if failed and isinstance(failed, str):  # a stage server's call, handing the gradient on, failed there
            if self.router.is_local(stage, peer):  # it could not reach this peer, which recomputes the hop itself
                failed = ""
            else:
                self.router.blame(stage, peer, f"reported by the peer handing the gradient on: {failed}")
        side = route.sides[hop]
        extra = _parts(side)
        messages = [inputs, grad, *extra[0]]
        prefer = None if failed else peer
        grad, retried_on = self._call(stage, "backward", messages, check, route.train, prefer, **scaled, **extra[1])
        if failed:
            self.router.failed_over(stage, "backward", peer, retried_on, failed)
        return grad, check.decoded

    def _call(
        self,
        stage: int,
        method: str,
        messages: list[runtime_pb2.Tensor],
        check: ReplyCheck,
        train: bool,
        prefer: Optional[str] = None,
        failover: bool = True,
        **metadata: Any,
    ) -> tuple[runtime_pb2.Tensor, str]:
        """Call ``method`` of ``stage`` (only on ``prefer`` without failover); the reply as it came, once ``check``
        passed it."""
        metadata = {"codec": self.codec, "train": train, **metadata}
        batch = int(messages[0].size[0]) if messages[0].size else 1
        if failover:
            reply, peer = self.router.call(stage, method, messages, metadata, batch, prefer=prefer, check=check)
        else:
            reply, peer = self.router.call_peer(stage, prefer, method, messages, metadata, batch, check), prefer
        return reply[0], peer


class _ChainStopped(Exception):
    """A chained forward that a stage server could not hand on (``at_server``), or whose output this process could
    not collect; ``failed``: the stage, peer and error of the call that stopped it, if one was named."""

    def __init__(self, receipt: Receipt, at_server: bool = True) -> None:
        super().__init__(receipt.error)
        self.at_server = at_server
        stops = [(stage, peer, error) for stage, _, peer, retried_on, error in receipt.failovers if not retried_on]
        self.failed: Optional[tuple[int, str, str]] = stops[-1] if stops else None


class _RelayPause:
    """After a stage server could not hand a chained forward on, this trainer relays its microbatches itself for as
    long as a peer failing as often in a row would be banned (:func:`~lightning_swarm.client.routing.ban_seconds`;
    a chain that passes ends the row). A server whose view of the next stage is stale, or that cannot reach that
    stage's peers, would otherwise hold every microbatch for its whole wait for a peer (``Onward.wait_timeout``)
    before this trainer relays it."""

    def __init__(self) -> None:
        self._stops, self._until = 0, -math.inf
        self._lock = threading.Lock()

    def active(self) -> bool:
        return time.monotonic() < self._until

    def start(self, seconds: float) -> None:
        """A chain stopped at a stage server: pause chaining (``seconds``: the router's ``ban_timeout``), unless a
        chain in flight with it paused it already."""
        with self._lock:
            if self.active():
                return
            self._stops += 1
            pause = ban_seconds(seconds, self._stops)
            self._until = time.monotonic() + pause
        log.warning("A stage server could not hand a microbatch on: relaying microbatches here for %.0fs", pause)

    def passed(self) -> None:
        """A chain reached its last hop."""
        with self._lock:
            self._stops = 0


class _Slots:
    """This pipeline's microbatches in flight. A batch's forward takes a place for each of its microbatches, within
    a limit (:meth:`RemotePipeline._places`): while the previous batch's backward trails, its microbatches start as
    the backward's end where needed, so that a stage's queue holds no more of this trainer's own requests than one
    batch's microbatches (its fair share under contention; more were answered busy, and a backward answered busy
    recomputes elsewhere)."""

    def __init__(self) -> None:
        self._used = 0
        self._changed = threading.Condition()

    def reserve(self, count: int) -> None:
        """Take ``count`` places at once, without waiting (a backward's, sent after its forward freed them)."""
        with self._changed:
            self._used += count

    def free(self, count: int = 1) -> None:
        with self._changed:
            self._used -= count
            self._changed.notify_all()

    def run(self, limit: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a place taken once fewer than ``limit`` are taken (a trailing backward's microbatches
        each end: every call they make has a timeout)."""
        with self._changed:
            self._changed.wait_for(lambda: self._used < limit)
            self._used += 1
        return self.held(fn, *args)

    def held(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a place taken already, freed when it returns."""
        try:
            return fn(*args)
        finally:
            self.free()


@dataclass(frozen=True)
class _Held:
    """The pipeline's input with its graph, kept out of autograd's view of the pipeline (a trailing backward)."""

    tensor: torch.Tensor


class _RemoteStages(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        pipeline: RemotePipeline,
        anchor: torch.Tensor,
        inputs: torch.Tensor,
        segment: Optional[Segment],
        held: Optional[_Held],
    ) -> torch.Tensor:
        started = time.perf_counter()
        outputs, routes = pipeline.run_forward(inputs, keep=True, segment=segment)
        ctx.pipeline, ctx.routes, ctx.started, ctx.held = pipeline, routes, started, held
        ctx.input_device, ctx.input_dtype = inputs.device, inputs.dtype
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs: torch.Tensor):
        if ctx.held is not None:
            ctx.pipeline._leave_behind(grad_outputs, ctx.routes, ctx.started, ctx.held)
            return None, None, None, None, None
        grad_inputs = ctx.pipeline._backward_timed(grad_outputs, ctx.routes, ctx.started)
        if not ctx.needs_input_grad[2]:
            return None, None, None, None, None
        return None, None, grad_inputs.to(device=ctx.input_device, dtype=ctx.input_dtype), None, None


def _assembly(like: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor on ``like``'s device, for the microbatches' threads to decode their replies into: a normal
    tensor even under inference mode (Lightning's validation), which does not reach those threads."""
    with torch.inference_mode(False):
        return like.new_empty(shape, dtype=dtype)


def _check_at(
    landing: Optional[Landing],
    batch: int,
    shape: Optional[Sequence[int]],
    dtype: Optional[torch.dtype],
    finite: bool = True,
) -> ReplyCheck:
    """A reply's check: without ``landing`` its header and framing only (it goes on unread), with it decoded there."""
    if landing is None:
        return ReplyCheck(batch, shape, dtype, finite)
    return ReplyCheck(batch, shape, dtype, finite, device=landing.device, out=landing.out, divide=landing.scale)


def _parts(side: Optional[Request]) -> tuple[list[runtime_pb2.Tensor], dict]:
    """A hop's side inputs as a request carries them: tensors after the activation, and metadata."""
    return ([], {}) if side is None else (side.tensors, side.metadata)


def _side_tensors(calls: list[Call]) -> list[torch.Tensor]:
    """The distinct tensors among the side inputs of ``calls``."""
    found: dict[int, torch.Tensor] = {}
    for call in calls:
        for leaf in pytree.tree_leaves(call):
            if isinstance(leaf, torch.Tensor):
                found.setdefault(id(leaf), leaf)
    return list(found.values())


def _slice_call(call: Call, pieces: dict[int, tuple[torch.Tensor, ...]], index: int) -> Call:
    """``call`` for microbatch ``index``: its batched tensors replaced by their piece (shared pieces stay shared)."""
    return pytree.tree_map(
        lambda t: pieces[id(t)][index] if isinstance(t, torch.Tensor) and id(t) in pieces else t, call
    )
