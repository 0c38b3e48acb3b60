"""The remote pipeline: an ``nn.Module`` that stands in for the LightningModule's pipeline attribute.

Its forward sends the activations through one peer per stage, and its backward sends their gradients back the
same way, so the user's ``training_step`` and loss code run unchanged. The input of every stage is kept on the
caller, which lets backward go to the peer that ran the forward or, if that one died, to any other peer of the
stage (the server recomputes the stage's forward from that input).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_swarm import compression
from lightning_swarm.client.routing import StageRouter


class RemotePipeline(nn.Module):
    """Runs the pipeline's stages on the swarm. Holds no parameters: those live on the stage servers."""

    def __init__(self, router: StageRouter, codec: str = "8bit") -> None:
        super().__init__()
        self.router = router
        self.codec = compression.check_codec(codec)
        # a leaf that requires grad, so that backward reaches the stages even when the input needs no gradient
        self.register_buffer("_grad_anchor", torch.empty(0), persistent=False)

    @property
    def num_stages(self) -> int:
        return self.router.num_stages

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            outputs, _, _ = self.run_forward(inputs)
            return outputs
        anchor = self._grad_anchor.detach().requires_grad_()
        return _RemoteStages.apply(self, anchor, inputs)

    def run_forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
        """Forward through every stage; returns the output, each stage's input and the peer that served it."""
        stage_inputs, peers = [], []
        hidden = inputs.detach()
        for stage in range(self.num_stages):
            stage_inputs.append(hidden)
            hidden, peer = self._call(stage, "forward", [hidden])
            peers.append(peer)
        return hidden.to(inputs.device), stage_inputs, peers

    def run_backward(
        self, grad_outputs: torch.Tensor, stage_inputs: list[torch.Tensor], peers: list[str]
    ) -> torch.Tensor:
        grad = grad_outputs.detach()
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
        outputs, stage_inputs, peers = pipeline.run_forward(inputs)
        ctx.pipeline, ctx.stage_inputs, ctx.peers = pipeline, stage_inputs, peers
        ctx.input_device, ctx.input_dtype = inputs.device, inputs.dtype
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs: torch.Tensor):
        grad_inputs = ctx.pipeline.run_backward(grad_outputs, ctx.stage_inputs, ctx.peers)
        if not ctx.needs_input_grad[2]:
            return None, None, None
        return None, None, grad_inputs.to(device=ctx.input_device, dtype=ctx.input_dtype)
