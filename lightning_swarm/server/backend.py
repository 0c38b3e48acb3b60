"""The stage backend: the stage's blocks on their device, its optimizer, and the training forwards it keeps for their
backward (:mod:`~lightning_swarm.server.kept_activations`), behind one lock.

A request runs all the stage's blocks in turn, each called with the activation and the side inputs its ``calls``
list (:mod:`~lightning_swarm.block_calls`). A training forward keeps its autograd graph for a while, so that the
backward that follows on this peer needs only the output gradient and computes no forward again. A backward sent
with the stage's input instead recomputes the forward from it, so any peer of the stage can serve it (the fallback
when the first peer died or dropped the graph). Backward leaves the parameter gradients in ``.grad`` for
:meth:`StageBackend.hand_over_gradients`, which gives them to the stage optimizer (held and stepped here as
hivemind's ``ModuleBackend`` does: it accumulates them towards the stage's target batch size) and returns the
gradient of the input. A failed request leaves the parameters and accumulated gradients untouched. The stage
computes in the Trainer's precision (:mod:`~lightning_swarm.precision`); under ``16-mixed`` a backward carries the
trainer's loss scale (:meth:`StageBackend._backward_through` says how it is used).
"""

from __future__ import annotations

import io
import logging
import math
import threading
from functools import partial
from typing import Any, Optional, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_swarm import block_calls
from lightning_swarm.block_calls import Call, MetaBlocks
from lightning_swarm.errors import ActivationsLostError, SwarmRequestError
from lightning_swarm.events import EventQueue, StageStep
from lightning_swarm.precision import autocast, parameter_dtype, unscale_
from lightning_swarm.server.kept_activations import Kept, KeptActivations, counting_saved_bytes, default_max_bytes
from lightning_swarm.server.out_of_core import OutOfCoreStage, spare_bytes

log = logging.getLogger(__name__)


class StageOptimizer(Protocol):
    """What a stage backend asks of its optimizer (:class:`~lightning_swarm.optimizer.SwarmOptimizer` has it)."""

    local_epoch: int

    def step(self, batch_size: int) -> Any: ...

    def zero_grad(self) -> None: ...

    def follow_swarm(self) -> None: ...

    def apply_finished_update(self, wait: bool = False) -> None: ...

    def progress(self) -> dict: ...

    def state_dict(self) -> dict: ...


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The blocks a stage module runs in turn."""
    if isinstance(module, OutOfCoreStage):
        return list(module._blocks)
    return list(module) if isinstance(module, nn.Sequential) else [module]


class StageBackend:
    """The stage's module and optimizer on ``device`` (see the module docstring; the arguments are
    :class:`~lightning_swarm.server.stage_server.StageServer`'s)."""

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        device: torch.device,
        optimizer: Optional[StageOptimizer] = None,
        events: Optional[EventQueue] = None,
        precision: str = "32-true",
        max_activation_bytes: Optional[int] = None,
        activation_timeout: float = 120.0,
        checkpoint_activations: bool = False,
    ) -> None:
        self.dtype = parameter_dtype(precision)
        wrong = {p.dtype for p in module.parameters() if p.is_floating_point()} - {self.dtype}
        if wrong:
            raise ValueError(
                f"precision={precision!r} needs the stage's parameters in {self.dtype}, found "
                f"{sorted(map(str, wrong))}: convert the module first (the precision plugin's convert_module)"
            )
        self.stage, self.module, self.device, self.precision = stage, module, device, precision
        self.optimizer, self.events, self.checkpoint_activations = optimizer, events, checkpoint_activations
        self.blocks = blocks_of(module)
        self.meta = MetaBlocks(self.blocks)  # what the blocks take and return, known without computing
        if max_activation_bytes is None:
            max_activation_bytes = spare_bytes(module)
        if max_activation_bytes is None:
            max_activation_bytes = default_max_bytes(device)
        self.kept = KeptActivations(max_activation_bytes, activation_timeout)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.lock = threading.Lock()  # held while computing or stepping; others take it to read the state

    def compute(
        self,
        kind: str,
        tensors: list[torch.Tensor],
        train: bool,
        key: Optional[tuple[str, str]],
        loss_scale: Optional[float],
        calls: list[Call],
    ) -> tuple[torch.Tensor, bool]:
        """The request's output, and whether the parameters' ``.grad`` now hold gradients to hand over."""
        with self.lock:
            if self.module.training != train:  # a walk over every submodule: not on every request
                self.module.train(train)
            return self._compute(kind, tensors, key, loss_scale, calls)

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
        kept = self.kept.pop(key, backward_of=key[0])
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

    def drop_gradients(self) -> None:
        """Forget the gradients a backward left in ``.grad`` (its request was refused): none reach the optimizer."""
        with self.lock:
            for param in self.params:
                param.grad = None

    def hand_over_gradients(self, batch: int) -> None:
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

    def follow_swarm(self) -> None:
        """When no request came for a while: the stage optimizer follows the swarm's steps."""
        if self.optimizer is None:
            return
        try:
            with self.lock:
                self.optimizer.follow_swarm()
        except Exception as e:  # the next idle period tries again; requests must keep being served
            log.warning("Stage %d: idle-time work failed: %r", self.stage, e)

    def optimizer_bytes(self) -> torch.Tensor:
        """The optimizer's state dict, as ``torch.save`` bytes."""
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
