"""Blocks called the way a model calls them: stand-ins in the model's own container, side inputs that travel with the
activation to in-process stage servers, exactly what the same blocks compute locally."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.stage import InProcessRouter, StageOptimizerStub, ask
from torch import nn

from lightning_swarm import block_calls
from lightning_swarm.block_calls import MetaBlocks, SideInputError
from lightning_swarm.client import remote_blocks
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.errors import SwarmRequestError
from lightning_swarm.server.stage_server import StageServer

CPU = torch.device("cpu")
D = 8


class RotaryBlock(nn.Module):
    """A block called like LitGPT's and transformers' layers: rotary tables, a mask, keywords; returns a tuple."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.attention_type = kind  # read by the model's loop, as Qwen2 reads its layers'
        self.proj = nn.Linear(D, D)

    def forward(self, x, cos, sin, mask=None, *, position_embeddings=None, scale=1.0, use_cache=False, name="b"):
        h = self.proj(x) * cos + x * sin * scale
        if mask is not None:
            h = h.masked_fill(~mask[..., None], 0.0)
        if position_embeddings is not None:
            h = h + position_embeddings[0]
        return (torch.tanh(h) + x, None)


class Model(nn.Module):
    """Blocks in a ModuleList inside a child, called in a Python loop with per-sample masks that differ by layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        self.inner.layers = nn.ModuleList(RotaryBlock(k) for k in ["full", "sliding", "full", "sliding"])
        self.head = nn.Linear(D, 1)

    def forward(self, x, read_after=None):
        t = x.shape[1]
        table = torch.arange(t * D).view(t, D).float()
        cos, sin = torch.cos(table / 7.0), torch.sin(table / 5.0)
        # the full mask broadcast over the batch (an expanded view, sent as its one row)
        masks = {"full": torch.ones(1, t, dtype=torch.bool).expand(x.shape[0], t), "sliding": torch.arange(t) < t - 1}
        masks["sliding"] = masks["sliding"].expand(x.shape[0], t).clone()
        masks["sliding"][0, 0] = False
        seen = []
        for i, layer in enumerate(self.inner.layers[:4]):
            x = layer(x, cos, sin, masks[layer.attention_type], position_embeddings=(cos, sin), scale=0.5)[0]
            if i == read_after:
                seen.append(x.sum())  # code between two block calls that reads the activation
        return self.head(x).sum() + sum(seen)


class Averaging(StageOptimizerStub):
    """A stage optimizer that averages the microbatches' gradients over their samples, as the swarm's does."""

    def __init__(self, module: nn.Module) -> None:
        self.params = list(module.parameters())
        self.sums, self.samples = [torch.zeros_like(p) for p in self.params], 0

    def step(self, batch_size: int) -> None:
        for total, param in zip(self.sums, self.params):
            total += param.grad * batch_size
        self.samples += batch_size

    def grads(self) -> list[torch.Tensor]:
        return [total / self.samples for total in self.sums]


def swarm_of(model: Model, spans: list[tuple[int, int]], microbatches: int) -> tuple[Model, list[StageServer]]:
    """``model`` with its layers served by in-process stage servers, one per span."""
    layers, servers = model.inner.layers, []
    for stage, (start, end) in enumerate(spans):
        blocks = copy.deepcopy(nn.Sequential(*layers[start:end]))
        servers.append(StageServer("run", stage, blocks, CPU, optimizer=Averaging(blocks)))
    pipeline = RemotePipeline(InProcessRouter(servers), "none", microbatches, spans=spans)
    remote = copy.deepcopy(model)
    names = [str(i) for i in range(len(layers))]
    remote.inner.layers = remote_blocks.stand_in(layers, names, pipeline, MetaBlocks(list(layers)))
    return remote, servers


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("read_after", [None, 1], ids=["no read", "read at a stage boundary"])
def test_side_inputs_travel_per_block_and_the_results_equal_local_training(microbatches, read_after):
    """Loss and gradients (stages' parameters, and the input's) equal the same model's in one process: per-sample
    masks (different by layer) are split with the microbatches, tables shared; an activation read between two block
    calls where a stage ends gets its value (the blocks up to it run first)."""
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(4, 6, D, requires_grad=True)
    remote, servers = swarm_of(model, [(0, 2), (2, 4)], microbatches)
    try:
        x_remote = x.detach().clone().requires_grad_()
        remote_loss = remote(x_remote, read_after)
        remote_loss.backward()
        loss = model(x, read_after)
        loss.backward()
        torch.testing.assert_close(remote_loss, loss, rtol=0, atol=1e-6)
        torch.testing.assert_close(x_remote.grad, x.grad, rtol=0, atol=1e-6)
        stats = servers[0].info()  # every forward kept its graph and was consumed by its backward
        assert stats["kept_forwards"] == 0 and stats["backward_samples"] > 0
    finally:
        for server in servers:
            server.shutdown()  # joins the worker: the hand-over that follows the last backward's answer is done
    local = [p.grad for p in model.inner.layers.parameters()]
    served = [grad for server in servers for grad in server.optimizer.grads()]
    assert len(local) == len(served)
    for a, b in zip(local, served):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_shapes_change_between_batches_and_the_replies_are_checked_against_the_meta_device():
    """Sequence length and batch size change from batch to batch; each reply's shape is what the blocks on the meta
    device return for that input."""
    torch.manual_seed(0)
    model = Model()
    remote, servers = swarm_of(model, [(0, 1), (1, 4)], 1)
    try:
        with torch.no_grad():
            for shape in [(2, 3, D), (5, 7, D), (1, 2, D)]:
                x = torch.randn(*shape)
                torch.testing.assert_close(remote(x), model(x), rtol=0, atol=1e-6)
    finally:
        for server in servers:
            server.shutdown()


def test_what_cannot_cross_the_wire_is_named():
    """A KV-cache object, use_cache=True, a side input of an unknown type: one line that names the argument and what
    to set; an activation that the swarm never returned raises instead of giving a wrong value."""
    torch.manual_seed(0)
    model = Model()
    remote, servers = swarm_of(model, [(0, 2), (2, 4)], 1)
    layers, x, t = remote.inner.layers, torch.randn(2, 3, D), torch.ones(3, D)
    try:
        with pytest.raises(SideInputError, match="'use_cache' of block 0 is True.*use_cache=False"):
            layers[0](x, t, t, use_cache=True)

        class DynamicCache:
            pass

        with pytest.raises(SideInputError, match="'mask' of block 0 is a DynamicCache.*KV cache"):
            layers[0](x, t, t, mask=DynamicCache())
        with pytest.raises(SideInputError, match="argument '3' of block 0 is a object"):
            layers[0](x, t, t, object())
        with torch.no_grad():
            first = layers[0](x, t, t)[0]
            with pytest.raises(
                RuntimeError, match="activation after block 0 was read, but the block is inside a stage"
            ):
                first.sum()
            second = layers[1](first, t, t)[0]
            out = layers[3](layers[2](second, t, t)[0], t, t)[0]  # the last block: the segment runs
            assert out.shape == x.shape
            with pytest.raises(RuntimeError, match="activation after block 1 was computed inside the swarm"):
                second.sum()  # where stage 0 ends, but read after the segment ran on past it
        assert layers[1].attention_type == "sliding"  # attributes come from the block's copy on the meta device

        # code that finds blocks by class finds the stand-ins; hooks recording every block's output (as
        # transformers' output_hidden_states=True does) get an error on reading an output the swarm never returned
        recorded = []
        for module in remote.modules():
            if isinstance(module, RotaryBlock):
                module.register_forward_hook(lambda m, args, out: recorded.append(out[0]))
        with torch.no_grad():
            remote(x)
        assert len(recorded) == 4
        assert not isinstance(recorded[-1], remote_blocks.DeferredActivation) and recorded[-1].shape == x.shape
        with pytest.raises(RuntimeError, match="activation after block 1 was computed inside the swarm"):
            recorded[1].sum()
    finally:
        for server in servers:
            server.shutdown()


def test_a_stage_refuses_side_inputs_its_blocks_do_not_take():
    """A request whose side inputs do not fit the blocks (found on the meta device, before any compute) is the
    caller's fault; so is a malformed side-input tree. The stage keeps serving."""
    torch.manual_seed(0)
    server = StageServer("run", 0, nn.Sequential(RotaryBlock("full"), RotaryBlock("full")), CPU)
    x, t = torch.randn(2, 3, D), torch.ones(3, D)
    try:
        tree, tensors = block_calls.pack([((t, t), {}), ((t, t), {"scale": 2.0})])
        assert ask(server, "forward", [x, *tensors], calls=tree).shape == x.shape
        tree, tensors = block_calls.pack([((t, t), {}), ((torch.ones(4, D), t), {})])
        with pytest.raises(SwarmRequestError, match="blocks do not take an input of shape"):
            ask(server, "forward", [x, *tensors], calls=tree)
        empty = [["tuple", []], ["dict", []]]
        malformed = [
            ([[["tuple", []], 3], empty], "each block's side inputs"),
            ([[["tuple", [["t", 7]]], ["dict", []]], empty], "references tensor 7"),
            ([empty], "side inputs for the stage's 2 blocks"),
            ([[["tuple", [["x", 0, [2, 4, 8]], ["t", 0]]], ["dict", []]], empty], "cannot expand to \\[2, 4, 8\\]"),
            ([[["tuple", [["t", 0, [3]], ["t", 0]]], ["dict", []]], empty], "malformed side input"),
        ]
        for tree, message in malformed:
            with pytest.raises(SwarmRequestError, match=message):
                ask(server, "forward", [x, t], calls=tree)
        assert server.backward_samples == 0 and len(server.kept) == 0
    finally:
        server.shutdown()
