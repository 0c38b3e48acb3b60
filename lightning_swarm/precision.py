"""The Trainer's ``precision`` on stage servers: a stage computes as the same blocks would in plain training.

- ``32-true``, ``64-true``, ``bf16-true``, ``16-true``: the stage's parameters are in that dtype (the strategy
  converts the stage with Lightning's precision plugin), and so are the activations and gradients it accepts and
  sends. A tensor of another dtype is refused: it comes from a peer configured with another precision, which would
  silently train another model.
- ``bf16-mixed``, ``16-mixed``: parameters stay fp32 and the stage's forward (and the forward recomputed in
  backward) runs under ``torch.autocast``, as Lightning's ``MixedPrecision`` runs ``training_step``. Activations
  and gradients travel in the dtype the blocks produce; a stage accepts fp32 or the autocast dtype and feeds them to
  its blocks as they came, as the previous block's output would be in plain training.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch

# precision -> (dtype of the stage's parameters, autocast dtype or None)
PRECISIONS: dict[str, tuple[torch.dtype, Optional[torch.dtype]]] = {
    "64-true": (torch.float64, None),
    "32-true": (torch.float32, None),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
}


def check_precision(precision: str) -> str:
    """``precision`` if a stage server supports it, else a ``ValueError`` naming the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported on a swarm: choose one of {sorted(PRECISIONS)}")
    return precision


def parameter_dtype(precision: str) -> torch.dtype:
    return PRECISIONS[check_precision(precision)][0]


def activation_dtypes(precision: str) -> tuple[torch.dtype, ...]:
    """The dtypes of the activations and gradients a stage accepts under ``precision``."""
    dtype, autocast_dtype = PRECISIONS[check_precision(precision)]
    return (dtype,) if autocast_dtype is None else (dtype, autocast_dtype)


def autocast(precision: str, device: torch.device) -> ContextManager:
    """The context a stage's forward runs in: ``torch.autocast`` as Lightning's ``MixedPrecision`` enters it."""
    autocast_dtype = PRECISIONS[check_precision(precision)][1]
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=autocast_dtype, cache_enabled=False)


def unscale_(grads: list[torch.Tensor], loss_scale: float) -> bool:
    """Divide ``grads`` in place by ``loss_scale`` as ``torch.amp.GradScaler.unscale_`` does (the same kernel, the
    same fp32 reciprocal); whether all of them are finite."""
    if not grads:
        return True
    device = grads[0].device
    inv_scale = torch.full((1,), loss_scale, dtype=torch.float64).reciprocal().float().to(device)
    found_inf = torch.zeros(1, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)
    return not found_inf.item()
