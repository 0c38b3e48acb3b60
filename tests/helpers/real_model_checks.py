"""Checks of real models on a swarm of real peer processes (tests/swarm/test_real_models*.py): exact against plain
training, and the loss falling with the defaults. The peers run tests/helpers/model_peer.py."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from helpers import FAST, history, plain_training
from helpers.model_peer import SCRIPT
from helpers.real_models import PIPELINES, build

EXACT_STEPS = 6  # with --vary-seq: sequences of 16, 24, 32, 16, 24, 32 tokens
FALLING_STEPS = 25
LOSS_DROP = 0.5  # plain training drops 1.1 (GPT-2) to 2.4 (LitGPT) over 25 steps: mean of the last 5 vs the first 5
EXACT = {  # compression off, one peer per stage, one trainer, no microbatches, no stale step: plain training's sums
    **FAST,
    "SWARM_NUM_STAGES": "2",
    "SWARM_COMPRESSION": "none",
    "SWARM_MICROBATCHES": "1",
    "SWARM_DELAYED_UPDATES": "false",
}


def logs(swarm) -> str:
    """The tail of every peer's log, for an assertion's message."""
    return "".join(f"\n---- {name}:\n{peer.log()[-3000:]}" for name, peer in swarm.peers.items())


def exact_against_single_process(swarm, tmp_path, model: str) -> None:
    """A trainer serving stage 0 and a serve-only peer of stage 1, the pipeline found automatically, sequence lengths
    varying from batch to batch: after ``EXACT_STEPS`` steps the parameters and every step's loss equal plain
    training's (within 1e-6), and the parameters moved, so that the comparison proves something."""
    args = ["--model", model, "--max-steps", str(EXACT_STEPS), "--vary-seq"]
    start = time.monotonic()
    swarm.start("stage1", ["--model", model], env={**EXACT, "SWARM_ROLE": "serve", "SWARM_STAGE": "1"})
    swarm.start(
        "trainer",
        [*args, "--save", str(tmp_path / "swarm.ckpt"), "--history", str(tmp_path / "swarm.json")],
        env={**EXACT, "SWARM_STAGE": "0"},
    )
    assert swarm.wait("trainer", timeout=240) == 0, logs(swarm)
    swarm_seconds = time.monotonic() - start

    swarm_state = torch.load(tmp_path / "swarm.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    plain_state, plain_history = plain_training(args, tmp_path, SCRIPT)
    initial_state = build(model, 0).state_dict()
    assert swarm_state.keys() == plain_state.keys() == initial_state.keys()
    worst = max((swarm_state[k] - plain_state[k]).abs().max().item() for k in plain_state)
    moved = max((plain_state[k] - initial_state[k]).abs().max().item() for k in plain_state)
    swarm_history = history(tmp_path / "swarm.json")
    loss_gap = max(abs(a - b) for a, b in zip(swarm_history["losses"], plain_history["losses"]))
    print(
        f"{model} exactness: max |swarm - plain| over all parameters after {EXACT_STEPS} steps = {worst:.3g}, over "
        f"the losses {loss_gap:.3g}; parameters moved up to {moved:.3g}; swarm run {swarm_seconds:.1f}s; "
        f"losses {[round(x, 4) for x in plain_history['losses']]}; side inputs sent "
        f"{swarm_history['side_bytes_sent']} of {swarm_history['bytes_sent']} bytes"
    )
    assert swarm_history["direct_calls"] + swarm_history["p2p_calls"] > 0, "stage 1 was never called"
    assert worst <= 1e-6, logs(swarm)
    assert moved > 1e-3, "training changed nothing: the comparison would prove nothing"
    assert len(swarm_history["losses"]) == len(plain_history["losses"]) == EXACT_STEPS
    assert swarm_history["losses"] == pytest.approx(plain_history["losses"], abs=1e-6)


def loss_falls_with_defaults(swarm, tmp_path, model: str) -> None:
    """Two stages with the defaults (8-bit compression, microbatches tuned, delayed updates), the pipeline named by
    SWARM_PIPELINE: the trainer's loss falls (mean of the last 5 steps below the first 5's by ``LOSS_DROP``)."""
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_PIPELINE": PIPELINES[model]}
    args = ["--model", model, "--max-steps", str(FALLING_STEPS), "--vary-seq"]
    start = time.monotonic()
    swarm.start("stage1", ["--model", model], env={**env, "SWARM_ROLE": "serve", "SWARM_STAGE": "1"})
    swarm.start("trainer", [*args, "--history", str(tmp_path / "swarm.json")], env={**env, "SWARM_STAGE": "0"})
    assert swarm.wait("trainer", timeout=240) == 0, logs(swarm)
    recorded = history(tmp_path / "swarm.json")
    losses = recorded["losses"]
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    print(
        f"{model} with defaults: loss {first:.3f} (first 5 steps) -> {last:.3f} (last 5) over {len(losses)} steps, "
        f"swarm run {time.monotonic() - start:.1f}s, {recorded['direct_calls'] + recorded['p2p_calls']} calls; "
        f"sent {recorded['bytes_sent']} bytes, of which side inputs {recorded['side_bytes_sent']} "
        f"({recorded['raw_bytes_sent']} uncompressed, {recorded['samples_sent']} samples sent)"
    )
    assert len(losses) == FALLING_STEPS, logs(swarm)
    assert last < first - LOSS_DROP, f"{losses}{logs(swarm)}"
