"""Swarms with an out-of-core stage train as plain training and follow the resident stage."""

from __future__ import annotations

import pytest
import torch
from gpt import Block
from helpers import FAST, SMALL_GPT, history, plain_training

from lightning_swarm.server.out_of_core import (
    block_bytes,
)


def six_block_gpt() -> list[str]:
    """SMALL_GPT with 6 blocks: 3 per stage, so that a budget can leave all of them swapped."""
    gpt = [*SMALL_GPT]
    gpt[gpt.index("--n-layer") + 1] = "6"
    return gpt


def swapping_everything() -> dict[str, str]:
    """A stage-1 serving peer whose budget holds the out-of-core window (four blocks) but no resident block."""
    budget = 4 * block_bytes([Block(32, 2)])[0] + 100
    return {"SWARM_ROLE": "serve", "SWARM_STAGE": "1", "SWARM_DEVICE_MEMORY_BUDGET": str(budget)}


def test_swarm_with_an_out_of_core_stage_trains_as_plain_training(swarm, tmp_path):
    """Stage 1's peer serves its three blocks out of core, all swapped, kept forwards on: the swarm's losses and the
    checkpoint it gathers after 6 steps equal plain training's, as with the resident stage
    (tests/swarm/test_swarm.py::test_exact_against_single_process)."""
    args = [*six_block_gpt(), "--max-steps", "6"]
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_COMPRESSION": "none", "SWARM_MICROBATCHES": "1"}
    env["SWARM_DELAYED_UPDATES"] = "false"  # delayed updates apply each step one step late, unlike plain training
    swarm.start(
        "stage1", six_block_gpt(), env={**env, **swapping_everything(), "SWARM_MAX_ACTIVATION_BYTES": str(2**30)}
    )
    swarm.start(
        "trainer",
        [*args, "--save", str(tmp_path / "swarm.ckpt"), "--history", str(tmp_path / "swarm.json")],
        env={**env, "SWARM_STAGE": "0"},
    )
    assert swarm.wait("trainer", timeout=240) == 0, swarm.peers["trainer"].log()[-3000:]
    assert "Serving the stage out of core: 0 of 3 blocks resident, 3 swapped" in swarm.peers["stage1"].log()

    swarm_state = torch.load(tmp_path / "swarm.ckpt", weights_only=False)["state_dict"]
    plain_state, plain_history = plain_training(args, tmp_path)
    worst = max((swarm_state[k] - plain_state[k]).abs().max().item() for k in plain_state)
    losses = history(tmp_path / "swarm.json")["losses"]
    print(f"out of core: max |swarm - plain| = {worst:.3g}; losses {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert worst <= 1e-6 and losses == pytest.approx(plain_history["losses"], abs=1e-6)
    assert losses[0] - losses[-1] > 0.1


def test_swarm_with_an_out_of_core_stage_follows_the_resident_one_with_default_settings(swarm, tmp_path):
    """Default settings (delayed updates, 8-bit wire, microbatches in flight, kept forwards capped by what the
    budget leaves, so backward recomputes from the input): the same run with stage 1 resident, then out of core;
    the loss falls alike."""
    args = [*six_block_gpt(), "--max-steps", "8"]
    env = {**FAST, "SWARM_NUM_STAGES": "2"}
    runs = {}
    for name, stage1 in (
        ("resident", {"SWARM_ROLE": "serve", "SWARM_STAGE": "1"}),
        ("out of core", swapping_everything()),
    ):
        peer, trainer = f"stage1 {name}", f"trainer {name}"
        swarm.start(peer, six_block_gpt(), env={**env, **stage1})
        out = tmp_path / f"{name}.json"
        swarm.start(trainer, [*args, "--history", str(out)], env={**env, "SWARM_STAGE": "0"})
        assert swarm.wait(trainer, timeout=240) == 0, swarm.peers[trainer].log()[-3000:]
        swarm.stop(peer)
        runs[name] = history(out)["losses"]
    assert "Serving the stage out of core" in swarm.peers["stage1 out of core"].log()
    resident, out_of_core = runs["resident"], runs["out of core"]
    print(f"losses, resident: {resident}\nlosses, out of core: {out_of_core}")
    assert len(resident) == len(out_of_core) == 8
    assert resident[0] - resident[-1] > 0.3 and out_of_core[0] - out_of_core[-1] > 0.3
    assert abs(sum(resident[-3:]) - sum(out_of_core[-3:])) / 3 < 0.1
