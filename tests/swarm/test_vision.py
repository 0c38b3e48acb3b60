"""The second example, examples/vision.py (a CNN, not a transformer), trains in a real 2-peer swarm on loopback."""

from __future__ import annotations

import csv
import math
import time

import helpers
from helpers import PEER_ENV, ROOT

from lightning_swarm import cli
from lightning_swarm.launch import LocalSwarm

VISION_SCRIPT = str(ROOT / "examples" / "vision.py")
SMALL_CNN = ["--channels", "16", "--n-blocks", "2", "--batch-size", "16", "--lr", "3e-3"]
# each peer keeps its stage: the test checks what each logged about it
FAST = {**helpers.FAST, "SWARM_LINGER": "60.0", "SWARM_REBALANCE_PERIOD": "0"}


def train_losses(log_dir) -> list[float]:
    (metrics,) = log_dir.rglob("metrics.csv")
    with open(metrics, newline="") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def logged(log_dir, column: str) -> list[float]:
    (metrics,) = log_dir.rglob("metrics.csv")
    return [v for v in cli.load_metrics(metrics).get(column, []) if not math.isnan(v)]


def test_two_peers_two_stages_train_the_cnn(tmp_path):
    """Two peers (each serving one of 2 stages and training on its own images): every step completes, the loss is
    finite and falls below chance level (a classifier of 4 shapes that learnt nothing has loss ln 4); the swarm's
    state logged by SwarmMonitor draws with lightning-swarm plot."""
    steps = 50
    start = time.monotonic()
    env = {**PEER_ENV, **FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "32"}
    with LocalSwarm([VISION_SCRIPT], tmp_path, run_id="tvision", env=env) as swarm:
        for i in range(2):
            args = [*SMALL_CNN, "--max-steps", str(steps), "--data-seed", str(i), "--log-dir", str(tmp_path / f"p{i}")]
            swarm.start(f"peer{i}", args, env={"SWARM_STAGE": str(i), "SWARM_ROLE": "both"})
        for i in range(2):
            assert swarm.wait(f"peer{i}", timeout=240) == 0, swarm.peers[f"peer{i}"].log()[-3000:]
        assert "Serving stage 0 of 2" in swarm.peers["peer0"].log()
        assert "Serving stage 1 of 2" in swarm.peers["peer1"].log()

    chance, ends = math.log(4), []
    for i in range(2):
        losses = train_losses(tmp_path / f"p{i}")
        assert len(losses) == steps, f"peer{i} logged {len(losses)} of {steps} steps"
        assert all(math.isfinite(loss) for loss in losses), losses
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(f"peer{i} losses:", " ".join(f"{loss:.2f}" for loss in losses))
        print(f"peer{i}: mean loss of the first five steps {first:.3f}, of the last five {last:.3f}")
        assert last < first - 0.2, losses  # each peer's loss falls
        ends.append(last)
        # SwarmMonitor logged the swarm as this peer saw it: its stage, both stages served
        assert set(logged(tmp_path / f"p{i}", "swarm/stage")) == {i}
        assert max(logged(tmp_path / f"p{i}", "swarm/peers")) == 2
        assert max(logged(tmp_path / f"p{i}", f"swarm/stage{1 - i}_throughput")) > 0

    # the swarm as a whole learnt well beyond chance (one peer alone varies: 0.55 to 1.25 after 50 steps in 4 runs)
    assert sum(ends) / 2 < chance - 0.2, ends

    out = tmp_path / "run.png"  # the recorded run, drawn by lightning-swarm plot
    assert cli.main(["plot", str(tmp_path / "p0"), str(tmp_path / "p1"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"took {time.monotonic() - start:.0f}s")
