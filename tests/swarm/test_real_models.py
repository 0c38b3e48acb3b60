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
from helpers import FAST, history
from helpers.real_model_checks import exact_against_single_process, loss_falls_with_defaults


@pytest.mark.parametrize("model", ["litgpt", "titan"])
def test_exact_against_single_process(model_swarm, tmp_path, model):
    """LitGPT's GPT (``transformer.h``, each block called with cos, sin, mask=None, input_pos=None positionally)
    and a torchtitan-shaped model (``layers``, an ``nn.ModuleDict``, each layer called with the rotary table)."""
    exact_against_single_process(model_swarm, tmp_path, model)


def test_loss_falls_with_defaults(model_swarm, tmp_path):
    loss_falls_with_defaults(model_swarm, tmp_path, "litgpt")


def test_failover_with_side_inputs_after_kill_9(model_swarm, tmp_path):
    """LitGPT, sequence lengths varying: kill -9 the stage-1 peer doing the work mid-training; every step completes,
    the microbatches in flight (their rotary tables with them) fail over to the other peer of the stage, and the dead
    peer is dropped."""
    steps, swarm = 30, model_swarm
    env = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "8", "SWARM_REBALANCE_PERIOD": "0"}
    for name in ("stage1_a", "stage1_b"):
        swarm.start(name, ["--model", "litgpt"], env={**env, "SWARM_ROLE": "serve", "SWARM_STAGE": "1"})
    deadline = time.monotonic() + 120
    while "Serving stage 1" not in swarm.peers["stage1_b"].log():  # it first downloads the stage from stage1_a
        assert time.monotonic() < deadline and swarm.peers["stage1_b"].alive(), swarm.peers["stage1_b"].log()
        time.sleep(0.2)
    record = tmp_path / "trainer.json"
    args = ["--model", "litgpt", "--max-steps", str(steps), "--vary-seq", "--history", str(record)]
    swarm.start("trainer", args, env={**env, "SWARM_STAGE": "0"})
    stage1 = {swarm.peers[name].addresses()[0].rsplit("/", 1)[-1]: name for name in ("stage1_a", "stage1_b")}

    deadline = time.monotonic() + 120
    while not (record.exists() and history(record)["steps"] >= 10):
        assert time.monotonic() < deadline and swarm.peers["trainer"].alive(), swarm.peers["trainer"].log()[-3000:]
        time.sleep(0.2)
    calls = history(record)["calls_per_peer"]
    victim = max(stage1, key=lambda peer: calls.get(peer, 0))
    assert calls.get(victim, 0) > 0, "no stage-1 peer served work before the kill"
    swarm.signal(stage1[victim], signal.SIGKILL)

    assert swarm.wait("trainer", timeout=300) == 0, swarm.peers["trainer"].log()[-3000:]
    final = history(record)
    failed = final["failed_calls_per_peer"].get(victim, 0)
    print(f"failover with side inputs: {final['failovers']} failovers, {failed} failed calls to the dead peer")
    assert final["steps"] == steps and len(final["losses"]) == steps
    assert final["failovers"] == failed  # every failed call was retried elsewhere and succeeded there
    assert final["side_bytes_sent"] > 0
    assert failed <= 2 * 4  # the calls in flight at the kill at most (2 per microbatch, at most 4 microbatches)
