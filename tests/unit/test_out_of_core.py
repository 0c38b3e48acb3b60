"""Out-of-core stages (KARMA): blocks swapped through a device-memory budget, recomputed in backward, updated on the
host. On the CPU the copies are plain copies, but the schedule is the one CUDA runs: what it computes must equal the
resident stage's exactly, and it must never hold more blocks than its plan."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import Block
from helpers.stage import StageOptimizerStub, ask
from torch import nn

from lightning_swarm import block_calls
from lightning_swarm.server.out_of_core import (
    OutOfCoreStage,
    block_bytes,
    check_out_of_core,
    plan_out_of_core,
    predict_pass_s,
    prepare_stage,
)
from lightning_swarm.server.stage_server import StageServer

CPU = torch.device("cpu")


def gpt_blocks(n: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(32, 2, dropout=0.1) for _ in range(n)))


def swapping(blocks: nn.Sequential, resident: int) -> OutOfCoreStage:
    """``blocks`` out of core with a budget that keeps ``resident`` of them on the device between passes."""
    sizes = block_bytes(blocks)
    plan = plan_out_of_core(sizes, budget=(resident + 4) * sizes[0])
    assert len(plan.resident) == resident
    return OutOfCoreStage(list(blocks), CPU, plan)


def server(module: nn.Module, steps: list[torch.optim.Optimizer], **kwargs) -> StageServer:
    """A stage server whose optimizer (plain AdamW, as the stage optimizer steps) steps after every backward."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    steps.append(optimizer)

    class Stepping(StageOptimizerStub):
        def step(self, batch_size: int) -> None:
            optimizer.step()

        def zero_grad(self) -> None:
            optimizer.zero_grad()

    return StageServer("run", 0, module, CPU, optimizer=Stepping(), max_activation_bytes=2**30, **kwargs)


@pytest.mark.parametrize("resident", [0, 2])
def test_swapped_stage_trains_exactly_as_the_resident_one_within_its_plan(resident):
    """Forwards kept and their backward, backwards recomputed from the input, inference forwards, dropout on, an
    optimizer step after every backward: outputs, input gradients, parameters and optimizer state equal the
    resident stage's bit for bit, with no more blocks on the device at once than the plan allows."""
    blocks = gpt_blocks()
    resident_module, out_of_core = copy.deepcopy(blocks), swapping(blocks, resident)
    assert out_of_core.state_dict().keys() == resident_module.state_dict().keys()
    optimizers: list[torch.optim.Optimizer] = []
    servers = [server(resident_module, optimizers), server(out_of_core, optimizers)]
    try:
        for step in range(4):
            x, g = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
            answers = []
            for s in servers:
                torch.manual_seed(step)  # the same dropout draws in both
                answers.append(
                    [
                        ask(s, "forward", [x], keep=f"k{step}"),
                        ask(s, "backward", [g], kept=f"k{step}"),
                        ask(s, "backward", [x, g]),
                        ask(s, "forward", [x], train="" if step % 2 else "1"),
                    ]
                )
            for a, b in zip(*answers):
                assert torch.equal(a, b)
        for a, b in zip(resident_module.state_dict().values(), out_of_core.state_dict().values()):
            assert torch.equal(a, b)
        for a, b in zip(optimizers[0].state.values(), optimizers[1].state.values()):
            assert all(torch.equal(a[k], b[k]) for k in a)
        moved = max(
            (a - b).abs().max().item() for a, b in zip(blocks.state_dict().values(), gpt_blocks().state_dict().values())
        )
        assert moved > 1e-3  # the comparison is of trained stages
    finally:
        for s in servers:
            s.shutdown()
    plan = out_of_core.plan
    assert out_of_core.peak_blocks_on_device == plan.max_blocks_on_device == resident + 2 < len(blocks)
    assert all(p.device == CPU for p in out_of_core.parameters())
    # each pass copies the swapped blocks once, and a resident block once after each step changed it
    assert out_of_core.copied_bytes > 0


def test_swapped_stage_recomputes_under_the_forwards_autocast():
    """bf16 autocast (the stage server's ``bf16-mixed``): the recomputed blocks cast as the forward did, so gradients
    equal those of the blocks run resident under the same autocast."""
    blocks = gpt_blocks(3)
    resident, out_of_core = copy.deepcopy(blocks), swapping(blocks, 0)
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    results = []
    for module, enabled in ((resident, True), (out_of_core, True), (resident, False)):
        torch.manual_seed(0)
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=enabled):
            outputs = module(inputs)
        results.append([outputs, *torch.autograd.grad(outputs, [inputs, *module.parameters()], g.float())])
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][1], results[2][1])  # autocast changed the gradients: it was on in recompute


def test_plan_keeps_resident_what_fits_and_what_compute_cannot_hide():
    sizes = [100] * 6
    # no timings: every copy counts, so as many blocks as fit stay resident (two swapped + two gradients' window)
    assert plan_out_of_core(sizes, budget=400).resident == ()
    assert len(plan_out_of_core(sizes, budget=700).resident) == 3
    assert len(plan_out_of_core(sizes).resident) == 6  # no budget
    # compute that hides each copy: only the first block of each pass waits for its copy; those stay resident, the
    # others swap at no cost (but the last gradients' copy to the host)
    slow = plan_out_of_core(sizes, compute_s=[1.0] * 6, copy_bandwidth=1000.0, budget=1000)
    assert set(slow.resident) == {0, 5} and slow.predicted_s == pytest.approx(slow.compute_s + 0.1)
    # copies longer than compute: each block made resident saves time, so all that fit are
    fast = plan_out_of_core(sizes, compute_s=[0.01] * 6, copy_bandwidth=1000.0, budget=700)
    assert len(fast.resident) == 3 and fast.predicted_s > fast.compute_s
    everything = predict_pass_s(sizes, [0.01] * 6, 1000.0, set(range(6)))
    # forward 0.06; backward: gradient copies (0.1 each, one after another) from the end of the first block's
    assert everything == pytest.approx(0.06 + 0.03 + 6 * 0.1)
    with pytest.raises(ValueError, match="cannot hold even the out-of-core window"):
        plan_out_of_core(sizes, budget=399)


def test_stage_plans_again_from_the_compute_it_measured(caplog):
    """Given the copy bandwidth, the stage times its blocks in two training forwards after a first one, then plans
    again: with copies that cost next to nothing, only the first block of each pass (whose copy nothing hides)
    stays resident, and the memory the first plan gave the others goes back."""
    blocks = gpt_blocks()
    sizes = block_bytes(blocks)
    plan = plan_out_of_core(sizes, budget=7 * sizes[0])
    stage = OutOfCoreStage(list(blocks), CPU, plan, copy_bandwidth=1e15)
    assert plan.resident == (3, 4, 5)  # sizes only: as many as fit
    for _ in range(3):
        assert stage.plan is plan
        stage(torch.randn(2, 8, 32, requires_grad=True)).sum().backward()
        with torch.no_grad():
            stage(torch.randn(2, 8, 32))  # inference forwards are not timed
    assert stage.plan.resident == (0, 5) and stage.plan.predicted_s is not None
    assert stage.blocks_on_device == 2  # copies of blocks 3 and 4 went; block 0's came in the last backward
    assert "planned again from measured timings: 2 of 6 blocks resident" in caplog.text


def test_auto_goes_out_of_core_only_over_budget(caplog):
    """``auto``: a stage that fits its budget is built as before; one that does not is served out of core, built on
    the host from the meta device, with the same state dict keys."""

    def build() -> nn.Sequential:
        with torch.device("meta"):
            return gpt_blocks(4)

    size = sum(block_bytes(gpt_blocks(4)))
    resident = prepare_stage(build(), CPU, lambda m: m, "32-true", "auto", None)  # the CPU: no limit
    assert type(resident) is nn.Sequential and not any(p.is_meta for p in resident.parameters())
    assert type(prepare_stage(build(), CPU, lambda m: m, "32-true", "auto", 2 * size)) is nn.Sequential
    out_of_core = prepare_stage(build(), CPU, lambda m: m, "32-true", "auto", size)
    assert isinstance(out_of_core, OutOfCoreStage) and "Serving the stage out of core" in caplog.text
    assert out_of_core.state_dict().keys() == resident.state_dict().keys()
    assert not any(p.is_meta for p in out_of_core.parameters())
    # under bf16-true the stage holds half the bytes: it fits where fp32 did not
    half = prepare_stage(build(), CPU, lambda m: m.to(torch.bfloat16), "bf16-true", "auto", size)
    assert type(half) is nn.Sequential
    assert isinstance(prepare_stage(build(), CPU, lambda m: m, "32-true", True, None), OutOfCoreStage)
    assert [check_out_of_core(v) for v in ("auto", "on", "0", True)] == ["auto", True, False, True]
    with pytest.raises(ValueError, match="out_of_core"):
        check_out_of_core("sometimes")


class SideInputBlock(nn.Module):
    """A block called with side inputs, as transformers' layers are: a rotary-like table and a keyword mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x, table, mask=None, scale=1.0):
        h = torch.tanh(self.proj(x) * table) * scale
        return (x + h.masked_fill(~mask[..., None], 0.0), None)


def test_an_out_of_core_stage_takes_side_inputs_exactly_as_the_resident_one():
    """Blocks called with side inputs (a table, a per-sample mask, a keyword number) and returning a tuple: the
    swapped stage's outputs, input gradients and parameter gradients equal the resident stage's."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*(SideInputBlock() for _ in range(4)))
    resident, swapped = server(copy.deepcopy(blocks), []), server(swapping(copy.deepcopy(blocks), 1), [])
    x, table, mask = torch.randn(3, 5, 32), torch.rand(5, 32), torch.rand(3, 5) > 0.3
    tree, tensors = block_calls.pack([((table,), {"mask": mask, "scale": 0.5 + i}) for i in range(4)])
    try:
        answers = [
            [ask(s, "forward", [x, *tensors], calls=tree, train=False) for s in (resident, swapped)],
            [ask(s, "backward", [x, torch.ones_like(x), *tensors], calls=tree) for s in (resident, swapped)],
        ]
    finally:
        resident.shutdown()  # joins the worker: the step that follows the backward's answer has run
        swapped.shutdown()
    for expected, got in answers:
        assert torch.equal(got, expected)
    for p, q in zip(resident.module.parameters(), swapped.module.parameters()):
        assert torch.equal(p, q)  # both stepped on the same gradients
