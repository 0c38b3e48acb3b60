"""A peer that moves to a stage builds it from the blocks on the meta device, for any model: the blocks of LitGPT,
transformers and a torchtitan-shaped model (none with ``reset_parameters``) are allocated, initialised as the model
initialises them, take the live state, and then serve exactly what the model's own blocks compute, side inputs and
all, through a stage server."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.real_models import MODELS, PIPELINES, build
from helpers.stage import ask

from lightning_swarm import SwarmStrategy, block_calls, partitioning
from lightning_swarm.server.stage_server import StageServer


def block_inputs(module: torch.nn.Module, path: str, tokens: torch.Tensor) -> list[tuple]:
    """How the model calls each block of its pipeline on ``tokens``: (activation, args, kwargs, activation out)."""
    calls = []

    def record(block, args, kwargs, output):
        calls.append((args[0], args[1:], kwargs, block_calls.activation_of(output)))

    blocks = partitioning.blocks_of(module.get_submodule(path))
    hooks = [b.register_forward_hook(record, with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad():
            module.loss(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


@pytest.mark.parametrize("name", list(MODELS))
def test_a_mover_builds_the_stage_from_meta_and_serves_it_exactly(name):
    """The strategy cuts the model (stage 1's blocks go to the meta device), then builds stage 1 as a moving peer
    does: freshly initialised (finite, and not the model's weights), then loaded with the stage's live state; a stage
    server on it answers exactly what the model's own blocks compute for the model's own side inputs."""
    module = build(name, seed=0)
    original = copy.deepcopy(module).eval()
    tokens = torch.randint(0, 96, (2, 16))
    calls = block_inputs(original, PIPELINES[name], tokens)
    strategy = SwarmStrategy(num_stages=2, stage=0, compression="none")
    strategy._lightning_module = module
    strategy._partition(module)
    span = strategy._spans[1]
    assert all(p.is_meta for i in range(span.start, span.end) for p in strategy._blueprint[i].parameters())

    stage = strategy._build_stage(1, train=False)
    fresh = stage.module.state_dict()
    live = stage.state_from(original.state_dict())
    assert all(torch.isfinite(t).all() for t in fresh.values() if t.is_floating_point())
    assert any(not torch.equal(fresh[k], live[k]) for k in live), "the fresh blocks already held the live weights"
    stage.module.load_state_dict(live)

    server = StageServer("run", 1, stage.module, torch.device("cpu"))
    try:
        first, *_ = calls[span.start]
        expected = calls[span.end - 1][3]
        tree, tensors = block_calls.pack([(args, kwargs) for _, args, kwargs, _ in calls[span.start : span.end]])
        served = ask(server, "forward", [first, *tensors], calls=tree, train=False)
        assert torch.equal(served, expected)
    finally:
        server.shutdown()
