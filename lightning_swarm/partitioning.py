"""Partitioning: find the LightningModule's pipeline and cut it into stages of balanced cost (SWARM section 2).

The pipeline is an ``nn.Sequential`` attribute of the LightningModule whose blocks each take one tensor and return
one. Everything else (embeddings, head, loss) stays local to the process that runs ``training_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from torch import nn

from lightning_swarm.optimizer import restrict_to


@dataclass(frozen=True)
class StageSpan:
    """Blocks ``start`` (inclusive) to ``end`` (exclusive) of the pipeline form stage ``index``."""

    index: int
    start: int
    end: int


def find_pipeline(module: LightningModule, name: Optional[str] = None) -> str:
    """The attribute name of the pipeline.

    With ``name`` given, that attribute must be an ``nn.Sequential``. Otherwise the pipeline is found
    automatically: the direct child ``nn.Sequential`` with the most parameters (ties are an error, so the choice is
    never a guess).
    """
    if name is not None:
        candidate = getattr(module, name, None)
        if not isinstance(candidate, nn.Sequential):
            raise ValueError(
                f"pipeline={name!r}: {type(module).__name__}.{name} must be an nn.Sequential of blocks, "
                f"got {type(candidate).__name__}"
            )
        return name
    found = [(n, count_parameters(m)) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if not found:
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential attribute to cut into stages: "
            f"define the blocks as one (e.g. self.blocks = nn.Sequential(...)) or pass pipeline=<attribute name>"
        )
    found.sort(key=lambda item: -item[1])
    if len(found) > 1 and found[0][1] == found[1][1]:
        names = ", ".join(n for n, _ in found)
        raise ValueError(f"Several nn.Sequential attributes could be the pipeline ({names}): pass pipeline=<name>")
    return found[0][0]


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balance_by_parameters(blocks: Sequence[nn.Module], num_stages: int) -> list[StageSpan]:
    """Contiguous spans of blocks, one per stage, that minimise the largest stage's parameter count."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if len(blocks) < num_stages:
        raise ValueError(f"Cannot cut a pipeline of {len(blocks)} blocks into {num_stages} stages")
    costs = [max(count_parameters(b), 1) for b in blocks]
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    n = len(costs)
    inf = float("inf")
    # best[s][i]: the smallest achievable max-stage cost for the first i blocks in s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [StageSpan(k, start, end) for k, (start, end) in enumerate(reversed(bounds))]


def stage_module(pipeline: nn.Sequential, span: StageSpan) -> nn.Sequential:
    """The stage's blocks as their own ``nn.Sequential`` (sharing the pipeline's parameters)."""
    return nn.Sequential(*(pipeline[i] for i in range(span.start, span.end)))


def stage_state_key(pipeline_name: str, span: StageSpan, key: str) -> str:
    """Map a stage-local state-dict key ('0.attn.weight') to the LightningModule's ('blocks.2.attn.weight')."""
    block, _, rest = key.partition(".")
    return f"{pipeline_name}.{span.start + int(block)}.{rest}"


def stage_optimizer(module: LightningModule, pipeline_name: str, stage: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer (class and per-group hyper-parameters) over ``stage``'s parameters only.

    ``configure_optimizers`` runs with the stage in the pipeline's place, so that ``self.parameters()`` covers
    exactly the local modules and this stage.
    """
    pipeline = getattr(module, pipeline_name)
    setattr(module, pipeline_name, stage)
    try:
        optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    finally:
        setattr(module, pipeline_name, pipeline)
    return restrict_to(single_optimizer(optimizers), stage.parameters())


def single_optimizer(optimizers: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The one optimizer ``configure_optimizers`` returned (a swarm trains with one)."""
    if len(optimizers) != 1:
        raise ValueError(f"SwarmStrategy supports one optimizer; configure_optimizers returned {len(optimizers)}")
    return optimizers[0]
