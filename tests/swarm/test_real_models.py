"""Real models on a swarm of real peer processes, left as their users wrote them: blocks in an ``nn.ModuleList`` or
``nn.ModuleDict`` some levels down, called in the model's own loop with side inputs (rotary tables, masks, flags).

The peers run tests/helpers/model_peer.py (the models are in tests/helpers/real_models.py, the checks in
tests/helpers/real_model_checks.py). This file runs them on the LitGPT and torchtitan-shaped models;
test_real_models_hf.py on transformers' Llama, GPT-2 and Qwen2 (two files, so that ``pytest -n 2 --dist loadfile``
runs them side by side).
"""

from __future__ import annotations

import signal
import time

import pytest
from helpers import FAST, history, late_receipts
from helpers.real_model_checks import exact_against_single_process, logs, loss_falls_with_defaults


@pytest.mark.parametrize("model", ["litgpt", "titan"])
def test_exact_against_single_process(model_swarm, tmp_path, model):
    """LitGPT's GPT (``transformer.h``, each block called with cos, sin, mask=None, input_pos=None positionally)
    and a torchtitan-shaped model (``layers``, an ``nn.ModuleDict``, each layer called with the rotary table)."""
    exact_against_single_process(model_swarm, tmp_path, model)


def test_loss_falls_with_defaults(model_swarm, tmp_path):
    loss_falls_with_defaults(model_swarm, tmp_path, "litgpt")


def test_rebalancing_and_failover_with_side_inputs(model_swarm, tmp_path):
    """LitGPT, sequence lengths varying, three serve-only peers started on stage 1 beside a trainer serving stage 0:
    a peer moves to stage 0 (building LitGPT's blocks from the meta device: they have no reset_parameters) and
    serves the trainer's microbatches there; then kill -9 it mid-training: every step completes, the microbatches
    in flight (their rotary tables with them) fail over to another peer of the stage, and the dead peer is dropped.
    The trainer never moves, so no stage is left empty."""
    # enough steps for a move first: peers forked from a template start within a second, and a trainer of 40 steps
    # finished before any serve peer moved (the move came ~40 s after the first peer started); with 120 steps the
    # kill came at step 35 (2026-11-28), and the 85 steps after it only lengthened the suite
    steps, swarm, names = 80, model_swarm, ("stage1_a", "stage1_b", "stage1_c")
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "8"}
    for name in names:
        serve = {**env, "SWARM_ROLE": "serve", "SWARM_STAGE": "1", "SWARM_REBALANCE_PERIOD": "5"}
        swarm.start(name, ["--model", "litgpt"], env=serve)
    record = tmp_path / "trainer.json"
    args = ["--model", "litgpt", "--max-steps", str(steps), "--vary-seq", "--history", str(record)]
    swarm.start("trainer", args, env={**env, "SWARM_STAGE": "0", "SWARM_REBALANCE_PERIOD": "0"})
    ids = {name: swarm.peers[name].addresses()[0].rsplit("/", 1)[-1] for name in names}

    deadline, victim, at_move = time.monotonic() + 180, None, {}
    while victim is None:  # a peer that moved to stage 0 and served the trainer there
        assert time.monotonic() < deadline and swarm.peers["trainer"].alive(), logs(swarm)
        time.sleep(0.5)
        calls = history(record)["calls_per_peer"] if record.exists() else {}
        for name in names:
            if name not in at_move and "Serving stage 0" in swarm.peers[name].log():
                at_move[name] = calls.get(ids[name], 0)  # its calls on stage 1, before the move
        victim = next((n for n, before in at_move.items() if calls.get(ids[n], 0) >= before + 4), None)
    before = history(record)
    assert before["steps"] < steps, "training ended before the move: nothing was left to fail over"
    swarm.signal(victim, signal.SIGKILL)

    assert swarm.wait("trainer", timeout=300) == 0, logs(swarm)
    final = history(record)
    failed = final["failed_calls_per_peer"].get(ids[victim], 0)
    print(
        f"rebalancing and failover with side inputs: {victim} moved to stage 0 and served "
        f"{before['calls_per_peer'][ids[victim]] - at_move[victim]} calls there by step {before['steps']}; killed: "
        f"{final['failovers']} failovers, {failed} failed calls to it"
    )
    assert final["steps"] == steps and len(final["losses"]) == steps
    # every failed call to it was retried elsewhere and succeeded there (other peers' moves fail calls over too), but
    # a chain's receipt that failed after its output had come
    assert final["failovers"] + late_receipts(swarm.peers["trainer"].log()) >= failed
    assert final["side_bytes_sent"] > 0
    assert failed <= 2 * 4  # the calls in flight at the kill at most (2 per microbatch, at most 4 microbatches)
