"""The swarm optimizers: the user's optimizer, wrapped in ``hivemind.Optimizer`` (SWARM section 4).

One wraps each served stage and one wraps the trainer's local parameters (embeddings, head). Each accumulates
gradients until the peers sharing it (the peers of that stage, or all trainers) have together processed
``target_batch_size`` samples, then those peers all-reduce their gradients and step.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import hivemind
import torch
from hivemind.dht import DHT
from hivemind.optim.grad_averager import GradientAverager


def restrict_to(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class with the same per-group hyper-parameters, over ``params`` only."""
    keep = {id(p) for p in params}
    groups = []
    for group in optimizer.param_groups:
        selected = [p for p in group["params"] if id(p) in keep]
        if selected:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": selected})
    if not groups:
        raise ValueError("None of the given parameters is in the optimizer returned by configure_optimizers")
    return type(optimizer)(groups)


@torch.no_grad()
def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's state as its first step would, without that step's effects.

    hivemind averages optimizer state, so it needs the state tensors up front; left alone it creates them with a
    real step on zero gradients, which applies weight decay and advances the step count (changing Adam's bias
    correction). Here parameters are restored and step counts reset, so the first real step is the one of a fresh
    optimizer.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [(p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, (value, grad) in zip(params, saved):
        p.copy_(value)
        p.grad = grad
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


def swarm_optimizer(
    dht: DHT,
    prefix: str,
    optimizer: torch.optim.Optimizer,
    target_batch_size: int,
    matchmaking_time: float,
    averaging_timeout: float,
) -> hivemind.Optimizer:
    """Wrap ``optimizer`` so that it steps once per ``target_batch_size`` samples of all peers under ``prefix``."""
    create_state(optimizer)
    request_timeout = min(1.0, matchmaking_time / 2)  # hivemind: must stay below matchmaking time
    return hivemind.Optimizer(
        dht=dht,
        run_id=prefix,
        target_batch_size=target_batch_size,
        optimizer=optimizer,
        matchmaking_time=matchmaking_time,
        averaging_timeout=averaging_timeout,
        load_state_timeout=averaging_timeout,
        delay_state_averaging=False,
        delay_optimizer_step=False,
        delay_grad_averaging=False,
        # hivemind 1.1.12 passes averager_opts to the state averager only: the gradient averager's go here
        averager_opts=dict(request_timeout=request_timeout),
        grad_averager_factory=partial(GradientAverager, request_timeout=request_timeout),
        tracker_opts=dict(min_refresh_period=0.2, max_refresh_period=2.0, metadata_expiration=4 * averaging_timeout),
        shutdown_timeout=2,
        verbose=False,
    )
