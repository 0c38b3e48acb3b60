"""A swarm started with every setting at its default steps each stage about once per round of its trainers' batches
(issue 27): counted in steps against samples, never in time."""

from __future__ import annotations

import sys

import pytest
from helpers import FAST, PEER_ENV, ROOT, SMALL_GPT, history

sys.path.insert(0, str(ROOT / "benchmarks"))
from default_target import PEER  # noqa: E402  examples/gpt.py, reporting its stage optimizer's steps and samples

pytestmark = pytest.mark.usefixtures("no_swarm_env")


def test_with_no_target_given_each_stage_steps_once_per_batch_of_every_trainer(tmp_path, request):
    """Two peers, each serving one of two stages and training on its own data (batch 8), no target batch size
    given: each stage's optimizer takes the target 2 x 8 while both train, and its steps are that far apart in
    samples (each stage has one peer, so the samples its stage server stepped with are all of the stage's, counted
    exactly). The old default, one peer's batch, stepped every 8 samples exactly; the bound (10 on average) leaves
    room for the batches one trainer sends before the other starts and after it finished (then one trainer: a step
    per batch; this small model trains 40 steps in seconds, about the skew of two peers' starts)."""
    from lightning_swarm.launch import LocalSwarm

    batch, trainers, steps = 8, 2, 120
    env = {**PEER_ENV, **FAST, "SWARM_NUM_STAGES": "2", "SWARM_REBALANCE_PERIOD": "0", "SWARM_COMPRESSION": "none"}
    paths = [tmp_path / f"peer{i}.json" for i in range(trainers)]
    peers = {
        f"peer{i}": (
            [*SMALL_GPT, "--max-steps", str(steps), "--data-seed", str(i), "--history", str(paths[i])],
            {"SWARM_STAGE": str(i)},
        )
        for i in range(trainers)
    }
    assert SMALL_GPT[SMALL_GPT.index("--batch-size") + 1] == str(batch)
    with LocalSwarm(["-c", PEER], tmp_path, run_id="default_target", env=env) as swarm:
        swarm.start_together(peers)
        codes = {name: swarm.wait(name, timeout=240) for name in peers}
        assert codes == dict.fromkeys(peers, 0), {name: swarm.peers[name].log()[-3000:] for name in peers}
    for path in paths:
        run = history(path)
        assert run["samples"] == steps * batch
        assert trainers * batch in run["stage_targets"], run["stage_targets"]
        assert 1 <= run["stage_epoch"] and run["stage_samples"] >= 1.25 * batch * run["stage_epoch"], (
            run["stage_epoch"],
            run["stage_samples"],
        )
