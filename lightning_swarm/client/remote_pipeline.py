"""The remote pipeline: an ``nn.Module`` that stands in for the LightningModule's pipeline attribute.

Its forward sends the activations through one peer per stage, and its backward sends their gradients back the
same way, so the user's ``training_step`` and loss code run unchanged. Backward goes to the peer that ran the
forward with the output gradient alone: that peer kept the forward's graph. The input of every stage is also kept
on the caller: if that peer died or dropped the graph, the input goes with the gradient to any peer of the stage,
which recomputes the stage's forward from it.

Activations and gradients are encoded once, where they are made: a stage's reply goes on to the next stage as it
came, compressed, and only the pipeline's output and input gradient are kept decoded here (as the check decoded
them). Every reply is checked first (:class:`~lightning_swarm.client.routing.ReplyCheck`): a forward's output has
the microbatch's samples, finite values, and the shape per sample and dtype of the stage's first output (learned); a
backward's input gradient has the stage input's shape and dtype. A peer that answers otherwise is banned and the
microbatch goes to another peer.


A batch is split into equal microbatches that travel through the stages concurrently (each on its own route), so
that one trainer keeps several stages busy at once and their transfers overlap other microbatches' compute: by
default (``"auto"``) as many as measured fastest (``microbatch_tuning``). Outputs and input gradients are
concatenated back, so the loss and the gradients equal the unsplit batch's: each microbatch's output gradient is
scaled to be that of its own mean loss, which is what the stage optimizers accumulate, and the returned gradient is
scaled back.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar, Union

import torch
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm import compression
from lightning_swarm.client.microbatch_tuning import Microbatches, MicrobatchTuner
from lightning_swarm.client.routing import ReplyCheck, StageRouter
from lightning_swarm.errors import CALLERS_FAULT, ActivationsLostError

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_THREADS = 64  # microbatches in flight at once with "auto"; threads start only as microbatches need them


@dataclass
class Route:
    """A microbatch's way through the stages: each stage's input (as sent), the peer that ran it, and the key under
    which that peer keeps the forward's graph."""

    inputs: list[runtime_pb2.Tensor]
    peers: list[str]
    keys: list[Optional[str]]  # None: the forward was not kept (no backward expected)


class RemotePipeline(nn.Module):
    """Runs the pipeline's stages on the swarm. Holds no parameters: those live on the stage servers.

    Args:
        microbatches: a batch is split into this many equal microbatches in flight at once (fewer when the batch
            size is not a multiple: the largest divisor of the batch size not above it), or ``"auto"``: tuned by
            measuring the batches' times (:class:`~lightning_swarm.client.microbatch_tuning.MicrobatchTuner`).
        loss_scale: returns the scale of the trainer's GradScaler (``16-mixed``), or None: the gradients sent to
            the stages are scaled by it, and it travels with them so that the stages unscale theirs.
    """

    def __init__(
        self,
        router: StageRouter,
        codec: str = "8bit",
        microbatches: Microbatches = "auto",
        loss_scale: Optional[Callable[[], Optional[float]]] = None,
    ) -> None:
        super().__init__()
        self.router, self.loss_scale = router, loss_scale
        self.tuner = MicrobatchTuner(microbatches, router.num_stages)
        self.codec = compression.check_codec(codec)
        # each stage's output: its shape per sample and its dtype, learned from the first reply
        self._outputs: list[Optional[tuple[list[int], torch.dtype]]] = [None] * router.num_stages
        most = MAX_THREADS if self.tuner.microbatches == "auto" else self.tuner.microbatches
        self._pool = ThreadPoolExecutor(most, "swarm-microbatch") if most > 1 else None
        # a leaf that requires grad, so that backward reaches the stages even when the input needs no gradient
        self.register_buffer("_grad_anchor", torch.empty(0), persistent=False)

    @property
    def num_stages(self) -> int:
        return self.router.num_stages

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            outputs, _ = self.run_forward(inputs)
            return outputs
        anchor = self._grad_anchor.detach().requires_grad_()
        return _RemoteStages.apply(self, anchor, inputs)

    def run_forward(self, inputs: torch.Tensor, keep: bool = False) -> tuple[torch.Tensor, list[Route]]:
        """Forward through every stage, microbatches concurrently; returns the output and each microbatch's route.
        ``keep``: the peers keep the forward's graph for the backward that follows."""
        microbatches = self._split(inputs.detach())
        results = self._map(self._forward_route, microbatches, [keep] * len(microbatches))
        return torch.cat([output for output, _ in results]).to(inputs.device), [route for _, route in results]

    def run_backward(self, grad_outputs: torch.Tensor, routes: list[Route]) -> torch.Tensor:
        """Backward through every stage along the routes of ``run_forward``, microbatches concurrently."""
        scale = len(routes)  # equal microbatches: the gradient of a microbatch's own mean loss is scale times its part
        grads = [grad * scale for grad in grad_outputs.detach().chunk(scale)]
        loss_scale = self.loss_scale() if self.loss_scale is not None else None
        return torch.cat(self._map(self._backward_route, grads, routes, [loss_scale] * scale)) / scale

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _split(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        size = inputs.shape[0] if inputs.ndim else 1
        return list(inputs.chunk(self.tuner.count(size)))

    def _map(self, fn: Callable[..., T], *iterables: list) -> list[T]:
        if self._pool is None or len(iterables[0]) == 1:
            return list(map(fn, *iterables))
        return list(self._pool.map(fn, *iterables))

    def _forward_route(self, inputs: torch.Tensor, keep: bool = False) -> tuple[torch.Tensor, Route]:
        route, hidden = Route([], [], []), compression.encode(inputs, self.codec)
        for stage in range(self.num_stages):
            key = uuid.uuid4().hex if keep else None
            route.inputs.append(hidden)
            batch, learned = int(hidden.size[0]), self._outputs[stage]
            check = ReplyCheck(batch) if learned is None else ReplyCheck(batch, [batch, *learned[0]], learned[1])
            hidden, peer = self._call(stage, "forward", [hidden], check, keep=key)
            self._outputs[stage] = learned or (list(hidden.size[1:]), compression.decoded_dtype(hidden))

            route.peers.append(peer)
            route.keys.append(key)
        return check.decoded, route

    def _backward_route(
        self, grad_outputs: torch.Tensor, route: Route, loss_scale: Optional[float] = None
    ) -> torch.Tensor:
        grad = compression.encode(grad_outputs, self.codec)
        for stage in reversed(range(self.num_stages)):
            grad, decoded = self._backward_stage(stage, grad, route, loss_scale)
        return decoded

    def _backward_stage(
        self, stage: int, grad: runtime_pb2.Tensor, route: Route, loss_scale: Optional[float]
    ) -> tuple[runtime_pb2.Tensor, torch.Tensor]:
        """Backward on the peer that kept the forward; else recompute on a peer of the stage from the input. Returns
        the input gradient as it came and decoded."""
        peer, failed = route.peers[stage], None
        scaled = {} if loss_scale is None else {"loss_scale": loss_scale}
        inputs = route.inputs[stage]  # the input gradient must be shaped like it; NaN reports an overflow
        check = ReplyCheck(int(inputs.size[0]), inputs.size, compression.decoded_dtype(inputs), loss_scale is None)
        if route.keys[stage] is not None:
            try:
                kept = {"kept": route.keys[stage], **scaled}
                reply, _ = self._call(stage, "backward", [grad], check, prefer=peer, failover=False, **kept)
                return reply, check.decoded
            except CALLERS_FAULT:
                raise
            except ActivationsLostError:
                pass  # that peer is alive but dropped the graph: let it recompute
            except Exception as e:
                log.warning("Stage %d: backward on %s failed (%r): recomputing on another peer", stage, peer, e)
                peer, failed = None, e
            self.router.stats.add(recomputed=1)
        grad, retried_on = self._call(stage, "backward", [inputs, grad], check, prefer=peer, **scaled)
        if failed is not None:
            self.router.failed_over(stage, "backward", route.peers[stage], retried_on, failed)
        return grad, check.decoded

    def _call(
        self,
        stage: int,
        method: str,
        messages: list[runtime_pb2.Tensor],
        check: ReplyCheck,
        prefer: Optional[str] = None,
        failover: bool = True,
        **metadata: Union[str, float, None],
    ) -> tuple[runtime_pb2.Tensor, str]:
        """Call ``method`` of ``stage`` (only on ``prefer`` without failover); the reply as it came, once ``check``
        passed it."""
        self.router.stats.add(raw_bytes_sent=sum(compression.raw_nbytes(m) for m in messages))
        metadata = {"codec": self.codec, "train": self.training, **metadata}
        batch = int(messages[0].size[0]) if messages[0].size else 1
        if failover:
            reply, peer = self.router.call(stage, method, messages, metadata, batch, prefer=prefer, check=check)
        else:
            reply, peer = self.router.call_peer(stage, prefer, method, messages, metadata, batch, check), prefer
        return reply[0], peer


class _RemoteStages(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pipeline: RemotePipeline, anchor: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        outputs, routes = pipeline.run_forward(inputs, keep=True)
        ctx.pipeline, ctx.routes, ctx.started = pipeline, routes, started
        ctx.input_device, ctx.input_dtype = inputs.device, inputs.dtype
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs: torch.Tensor):
        grad_inputs = ctx.pipeline.run_backward(grad_outputs, ctx.routes)
        batch_size = grad_outputs.shape[0] if grad_outputs.ndim else 1
        ctx.pipeline.tuner.record(batch_size, len(ctx.routes), time.perf_counter() - ctx.started)
        if not ctx.needs_input_grad[2]:
            return None, None, None
        return None, None, grad_inputs.to(device=ctx.input_device, dtype=ctx.input_dtype)
