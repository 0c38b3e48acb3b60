"""The Trainer's precision on a stage server: it computes what the same blocks compute in plain training under that
precision, accepts the activation dtypes that precision makes, and (``16-mixed``) unscales the trainer's loss scale
and skips a microbatch whose gradients overflowed instead of accumulating it."""

from __future__ import annotations

import asyncio
import copy
import math
import time

import pytest
import torch
from helpers.oracles import error_bound
from helpers.stage import InProcessRouter, StageOptimizerStub
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm import compression, protocol
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.errors import SwarmRequestError
from lightning_swarm.precision import check_precision
from lightning_swarm.server.stage_server import StageServer

D = 16


def blocks(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Blocks with ops autocast runs in low precision (linear) and in fp32 (layer norm, softmax)."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Softmax(-1))
            for _ in range(2)
        )
    ).to(dtype)


def request(
    server: StageServer, tensors: list[torch.Tensor], codec: str = "none", **metadata
) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(
        uid=server.uid,
        tensors=[compression.serialize(t, codec) for t in tensors],
        metadata=protocol.encode_metadata({"codec": codec, **metadata}),
    )


def ask(server: StageServer, kind: str, tensors: list[torch.Tensor], **metadata) -> torch.Tensor:
    response = asyncio.run(server.answer(kind, request(server, tensors, **metadata)))
    return compression.deserialize(response.tensors[0])


def local(module: nn.Module, x: torch.Tensor, g: torch.Tensor, dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Plain training's forward under ``torch.autocast("cpu", dtype)`` (or none), and the gradients of the input
    and the parameters for output gradient ``g``."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None, cache_enabled=False):
        y = module(x)
    return y.detach(), list(torch.autograd.grad(y, [x, *module.parameters()], g.to(y.dtype)))


class Accumulated(StageOptimizerStub, list):
    """A stage optimizer that records the microbatch sizes handed to it and leaves ``.grad`` as backward set it."""

    def step(self, batch_size: int) -> None:
        self.append(batch_size)


def handed_over(accumulated: Accumulated, count: int) -> None:
    """Wait (up to 10 s) until ``count`` microbatches were handed to the stage optimizer: a stage's worker hands the
    gradients over just after answering the backward."""
    deadline = time.monotonic() + 10
    while len(accumulated) < count and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def make_server():
    servers = []

    def make(module: nn.Module, precision: str, **kwargs) -> StageServer:
        servers.append(StageServer("run", 0, module, torch.device("cpu"), precision=precision, **kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.shutdown()


def served(server: StageServer, grad_input: torch.Tensor) -> list[torch.Tensor]:
    return [grad_input, *(p.grad.clone() for p in server.params)]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_bf16_mixed_stage_equals_blocks_under_autocast(make_server, checkpointing, input_dtype):
    """Forward output and every gradient equal the blocks' under torch.autocast (bit for bit), for a kept forward,
    a recomputed backward and an evaluation forward; the stage keeps fp32 parameters and answers in the dtype the
    blocks produce; fp32 and bf16 activations are both accepted (as the previous block may produce either)."""
    server = make_server(blocks(), "bf16-mixed", checkpoint_activations=checkpointing)
    x, g = torch.randn(4, 8, D, dtype=input_dtype), torch.randn(4, 8, D)
    expected_y, expected = local(blocks(), x, g, torch.bfloat16)
    assert expected[0].dtype == input_dtype
    assert all(p.dtype == torch.float32 for p in server.module.parameters())

    y = ask(server, "forward", [x], keep="k")
    assert y.dtype == expected_y.dtype and torch.equal(y, expected_y)
    for got, want in zip(served(server, ask(server, "backward", [g], kept="k")), expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for got, want in zip(served(server, ask(server, "backward", [x, g])), expected):  # recomputed forward
        assert torch.equal(got, want)
    assert torch.equal(ask(server, "forward", [x], train=False), expected_y)
    assert server.info()["backward_samples"] == 8


def test_bf16_mixed_activations_travel_as_bf16_through_the_8bit_codec(make_server):
    """A stage whose blocks end in a linear layer answers bf16 under bf16-mixed; the 8-bit codec keeps the dtype."""
    server = make_server(nn.Sequential(nn.Linear(D, D)), "bf16-mixed")
    x = torch.randn(4, 8, D)
    response = asyncio.run(server.answer("forward", request(server, [x], codec="8bit")))
    assert response.tensors[0].dtype == "bfloat16" + compression.EIGHT_BIT_TAG
    y = compression.deserialize(response.tensors[0])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = server.module(x)
    assert y.dtype == torch.bfloat16
    assert (y.float() - expected.float()).abs().max() <= error_bound(expected, "8bit").max()


@pytest.mark.parametrize("precision, dtype", [("bf16-true", torch.bfloat16), ("64-true", torch.float64)])
def test_true_precision_needs_the_stage_in_its_dtype_and_refuses_other_activations(make_server, precision, dtype):
    """-true: the stage computes in that dtype (as the converted blocks would) and refuses activations of another
    dtype, which would come from a peer configured with another precision."""
    with pytest.raises(ValueError, match=f"precision='{precision}' needs the stage's parameters in {dtype}"):
        make_server(blocks(), precision)
    server = make_server(blocks(dtype), precision)
    x, g = torch.randn(4, 8, D, dtype=dtype), torch.randn(4, 8, D, dtype=dtype)
    expected_y, expected = local(blocks(dtype), x, g, None)
    assert torch.equal(ask(server, "forward", [x], keep="k"), expected_y)
    for got, want in zip(served(server, ask(server, "backward", [g], kept="k")), expected):
        assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(
        SwarmRequestError, match=f"expected a {dtype} tensor, got torch.float32 \\(precision {precision}"
    ):
        ask(server, "forward", [x.float()])


def test_mixed_precision_refuses_other_dtypes_and_precisions_outside_lightnings_are_refused(make_server):
    server = make_server(blocks(), "bf16-mixed")
    with pytest.raises(SwarmRequestError, match="expected a torch.float32 or torch.bfloat16 tensor, got torch.float16"):
        ask(server, "forward", [torch.randn(4, 8, D, dtype=torch.float16)])
    with pytest.raises(ValueError, match="precision='transformer-engine' is not supported on a swarm"):
        check_precision("transformer-engine")


LOSS_SCALE = 2.0**12


def test_16_mixed_unscales_the_trainers_loss_scale_as_grad_scaler_does(make_server):
    """The trainer's GradScaler scales the loss by S: a stage sent gradients scaled by S, with S, holds the
    parameter gradients GradScaler.unscale_ gives in plain 16-mixed training (bit for bit), close to the unscaled
    gradients, and returns the input's gradient still scaled (the trainer unscales its own)."""
    accumulated = Accumulated()
    server = make_server(blocks(), "16-mixed", optimizer=accumulated)
    x, g = torch.randn(4, 8, D), torch.randn(4, 8, D)
    scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
    _, plain = local(blocks(), x, scaler.scale(g), torch.float16)  # as the scaled loss's backward gives it
    reference = blocks()
    for p, grad in zip(reference.parameters(), plain[1:]):
        p.grad = grad.clone()
    scaler.unscale_(torch.optim.SGD(reference.parameters(), lr=0.1))

    ask(server, "forward", [x], keep="k")
    loss_scale = scaler.get_scale()  # what the strategy sends
    grads = served(server, ask(server, "backward", [scaler.scale(g)], kept="k", loss_scale=loss_scale))
    handed_over(accumulated, 1)
    assert torch.equal(grads[0], plain[0])
    for got, p in zip(grads[1:], reference.parameters()):
        assert torch.equal(got, p.grad)
    assert accumulated == [4] and server.info()["skipped_samples"] == 0

    _, unscaled = local(blocks(), x, g, torch.float16)
    for got, want in zip(grads[1:], unscaled[1:]):
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-4)
    assert max((got - want).abs().max().item() for got, want in zip(grads[1:], unscaled[1:])) > 0  # fp16 did round


@pytest.mark.parametrize("overflow", ["in a later stage", "here"])
def test_16_mixed_overflow_skips_the_microbatch_and_leaves_the_stage_untouched(make_server, overflow):
    """A gradient that overflowed (an Inf from a later stage, or a scale too large for this stage's fp16 backward)
    is answered, not refused: nothing is accumulated, .grad keeps what it held, and the input's gradient comes back
    NaN so that earlier stages and the trainer's GradScaler skip the step too. The next microbatch is accumulated."""
    accumulated = Accumulated()
    server = make_server(blocks(), "16-mixed", optimizer=accumulated)
    x, g = torch.randn(4, 8, D), torch.randn(4, 8, D)
    ask(server, "backward", [x, g * LOSS_SCALE], loss_scale=LOSS_SCALE)
    before = [p.grad.clone() for p in server.params]
    state = {k: v.clone() for k, v in server.module.state_dict().items()}

    if overflow == "here":
        grad, scale = g * 2.0**30, 2.0**30  # finite, but the fp16 products overflow
    else:
        grad, scale = g * LOSS_SCALE, LOSS_SCALE
        grad[0, 0, 0] = math.inf
    ask(server, "forward", [x], keep="k")
    grad_input = ask(server, "backward", [grad], kept="k", loss_scale=scale)
    assert grad_input.shape == x.shape and grad_input.isnan().all()
    assert all(torch.equal(p.grad, b) for p, b in zip(server.params, before))
    assert all(torch.equal(v, state[k]) for k, v in server.module.state_dict().items())
    info = server.info()
    assert accumulated == [4] and info["backward_samples"] == 4 and info["skipped_samples"] == 4

    assert ask(server, "backward", [x, g * LOSS_SCALE], loss_scale=LOSS_SCALE).isfinite().all()
    handed_over(accumulated, 2)
    assert accumulated == [4, 4]


def test_non_finite_gradients_without_a_loss_scale_and_bad_loss_scales_are_refused(make_server):
    server = make_server(blocks(), "16-mixed")
    x, g = torch.randn(4, 8, D), torch.randn(4, 8, D)
    g[0, 0, 0] = math.inf
    with pytest.raises(SwarmRequestError, match="NaN or Inf"):
        ask(server, "backward", [x, g])
    with pytest.raises(SwarmRequestError, match="NaN or Inf"):  # a forward's input never may be
        ask(server, "forward", [g], loss_scale=LOSS_SCALE)
    for scale in (0, -1.0, math.inf, "8", True):
        with pytest.raises(SwarmRequestError, match="loss_scale must be a positive finite number"):
            ask(server, "backward", [x, x], loss_scale=scale)


@pytest.mark.parametrize("init_scale", [2.0**12, 2.0**40], ids=["in range", "overflowing"])
def test_16_mixed_trainer_and_stages_follow_plain_16_mixed_training(make_server, init_scale):
    """A trainer's 16-mixed step through a remote pipeline of two 16-mixed stage servers, against the same model in
    one process: the GradScaler's scale travels with the gradients, the stages hold plain training's unscaled
    parameter gradients and the trainer's local ones are equal (bit for bit); with a scale that overflows fp16, the
    stages skip the microbatch and the trainer's GradScaler skips its step and lowers the scale, as in plain
    training."""
    full = blocks()
    local_in = nn.Linear(D, D)
    plain = nn.Sequential(copy.deepcopy(local_in), copy.deepcopy(full))
    accumulated = Accumulated()
    servers = [make_server(copy.deepcopy(full[k : k + 1]), "16-mixed", optimizer=accumulated) for k in range(2)]
    pipeline = RemotePipeline(InProcessRouter(servers), codec="none", microbatches=1)
    x = torch.randn(4, 8, D)

    def step(model: nn.Module, scaler: torch.amp.GradScaler) -> torch.optim.Optimizer:
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        return optimizer

    plain_scaler, swarm_scaler = (torch.amp.GradScaler("cpu", init_scale=init_scale) for _ in range(2))
    pipeline.loss_scale = swarm_scaler.get_scale
    step(plain, plain_scaler)
    try:
        step(nn.Sequential(local_in, pipeline), swarm_scaler)
    finally:
        pipeline.close()
    assert swarm_scaler.get_scale() == plain_scaler.get_scale()
    overflowed = plain_scaler.get_scale() < init_scale
    assert overflowed == (init_scale > 2.0**20)
    assert torch.equal(local_in.weight, plain[0].weight)  # stepped alike, or both skipped
    if overflowed:
        assert local_in.weight.grad.isnan().any()
        assert accumulated == [] and [s.info()["skipped_samples"] for s in servers] == [4, 4]
        return
    handed_over(accumulated, 2)
    assert accumulated == [4, 4]
    assert torch.equal(local_in.weight.grad, plain[0].weight.grad)
    stage_grads = [p.grad for server in servers for p in server.params]
    assert all(torch.equal(got, p.grad) for got, p in zip(stage_grads, plain[1].parameters()))


def test_the_strategy_sends_the_scale_of_its_grad_scaler_only_under_16_mixed():
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    from lightning_swarm.strategy import SwarmStrategy

    strategy = SwarmStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu")
    assert strategy._loss_scale() == 2.0**16  # GradScaler's initial scale
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert strategy._loss_scale() is None
    strategy.precision_plugin = Precision()
    assert strategy._loss_scale() is None
    assert check_precision(strategy.precision_plugin.precision) == "32-true"
