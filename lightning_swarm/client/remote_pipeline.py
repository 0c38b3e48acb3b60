"""The remote pipeline: an ``nn.Module`` that stands in for the LightningModule's pipeline attribute.

Its forward sends the activations through one peer per stage, and its backward sends their gradients back the
same way, so the user's ``training_step`` and loss code run unchanged. The input of every stage is kept on the
caller, which lets backward go to the peer that ran the forward or, if that one died, to any other peer of the
stage (the server recomputes the stage's forward from that input).

A batch is split into equal microbatches that travel through the stages concurrently (each on its own route), so
that one trainer keeps several stages busy at once. Outputs and input gradients are concatenated back, so the loss
and the gradients equal the unsplit batch's: each microbatch's output gradient is scaled to be that of its own
mean loss, which is what the stage optimizers accumulate, and the returned gradient is scaled back.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

import torch
from torch import nn

from lightning_swarm import compression
from lightning_swarm.client.routing import StageRouter

T = TypeVar("T")
Route = tuple[list[torch.Tensor], list[str]]  # a microbatch's input to every stage, and the peer that served it


class RemotePipeline(nn.Module):
    """Runs the pipeline's stages on the swarm. Holds no parameters: those live on the stage servers.

    Args:
        microbatches: a batch is split into this many equal microbatches in flight at once (fewer when the batch
            size is not a multiple: the largest divisor of the batch size not above it).
    """

    def __init__(self, router: StageRouter, codec: str = "8bit", microbatches: int = 1) -> None:
        super().__init__()
        self.router, self.microbatches = router, microbatches
        self.codec = compression.check_codec(codec)
        self._pool = ThreadPoolExecutor(microbatches, "swarm-microbatch") if microbatches > 1 else None
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

    def run_forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, list[Route]]:
        """Forward through every stage, microbatches concurrently; returns the output and each microbatch's route."""
        results = self._map(self._forward_route, self._split(inputs.detach()))
        return torch.cat([output for output, _ in results]).to(inputs.device), [route for _, route in results]

    def run_backward(self, grad_outputs: torch.Tensor, routes: list[Route]) -> torch.Tensor:
        """Backward through every stage along the routes of ``run_forward``, microbatches concurrently."""
        scale = len(routes)  # equal microbatches: the gradient of a microbatch's own mean loss is scale times its part
        grads = [grad * scale for grad in grad_outputs.detach().chunk(scale)]
        return torch.cat(self._map(self._backward_route, grads, routes)) / scale

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _split(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        size = inputs.shape[0] if inputs.ndim else 1
        count = max(d for d in range(1, min(self.microbatches, size) + 1) if size % d == 0)
        return list(inputs.chunk(count))

    def _map(self, fn: Callable[..., T], *iterables: list) -> list[T]:
        if self._pool is None or len(iterables[0]) == 1:
            return list(map(fn, *iterables))
        return list(self._pool.map(fn, *iterables))

    def _forward_route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Route]:
        stage_inputs, peers = [], []
        for stage in range(self.num_stages):
            stage_inputs.append(hidden)
            hidden, peer = self._call(stage, "forward", [hidden])
            peers.append(peer)
        return hidden, (stage_inputs, peers)

    def _backward_route(self, grad: torch.Tensor, route: Route) -> torch.Tensor:
        stage_inputs, peers = route
        for stage in reversed(range(self.num_stages)):
            grad, _ = self._call(stage, "backward", [stage_inputs[stage], grad], prefer=peers[stage])
        return grad

    def _call(
        self, stage: int, method: str, tensors: list[torch.Tensor], prefer: Optional[str] = None
    ) -> tuple[torch.Tensor, str]:
        messages = [compression.serialize(t, self.codec) for t in tensors]
        metadata = {"codec": self.codec, "train": self.training}
        batch = int(tensors[0].shape[0]) if tensors[0].ndim else 1
        reply, peer = self.router.call(stage, method, messages, metadata, batch, prefer=prefer)
        return compression.deserialize(reply[0]), peer


class _RemoteStages(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pipeline: RemotePipeline, anchor: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        outputs, routes = pipeline.run_forward(inputs)
        ctx.pipeline, ctx.routes = pipeline, routes
        ctx.input_device, ctx.input_dtype = inputs.device, inputs.dtype
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs: torch.Tensor):
        grad_inputs = ctx.pipeline.run_backward(grad_outputs, ctx.routes)
        if not ctx.needs_input_grad[2]:
            return None, None, None
        return None, None, grad_inputs.to(device=ctx.input_device, dtype=ctx.input_dtype)
