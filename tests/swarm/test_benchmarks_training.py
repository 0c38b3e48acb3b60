"""Smokes of the benchmarks that train a swarm against plain training (convergence, baselines, churn, delayed
updates): each runs its script's ``--smoke`` and checks the figures it wrote against the run. Apart from
test_benchmarks.py so that the two halves run on both of the suite's workers."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy
from helpers import ROOT
from helpers.benchmark_smoke import sent_per_step, smoke

sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import steady_throughput  # noqa: E402


def test_convergence_smoke(tmp_path):
    """Plain training and the 1-trainer swarm validated after the same samples (every val_every steps of the batch),
    on the same data, so the swarm (8-bit, delayed updates) ends within 3% of plain training's loss; the 2-trainer
    swarm never counts more samples than the steps of its trainers hold; each reported gap is the run's final loss
    over plain training's, interpolated at the same samples."""
    text = smoke(tmp_path, "convergence", timeout=600)
    data = json.loads((tmp_path / "results" / "convergence.json").read_text())
    curves, batch = data["curves"], data["batch_size"]
    validated = [k * data["val_every"] * batch for k in range(1, data["steps"] // data["val_every"] + 1)]
    assert curves["plain"]["samples"] == curves["swarm, 1 trainer"]["samples"] == validated, curves
    assert all(0 < s <= data["steps"] * batch for s in curves["swarm, 2 trainers"]["samples"]), curves
    plain = curves["plain"]
    for label in ("swarm, 1 trainer", "swarm, 2 trainers"):
        final, samples = curves[label]["val_loss"][-1], curves[label]["samples"][-1]
        gap = final / numpy.interp(samples, plain["samples"], plain["val_loss"]) - 1
        assert math.isclose(data["gap"][label], gap, abs_tol=1e-12), (label, data["gap"], gap)
        cells = rf"\| {samples} \| {final:.4f} \| [0-9.]+ \| {re.escape(f'{gap:+.2%}')} \|$"
        assert re.search(rf"^\| {label} \| [^|]+ {cells}", text, re.MULTILINE), (label, gap, text)
    assert abs(data["gap"]["swarm, 1 trainer"]) < 0.03, data["gap"]


def test_baselines_smoke(tmp_path):
    """Every method trained the same model on the same batches, so GPipe (the same arithmetic, in microbatches over
    gloo) ends at plain training's loss and the swarm (8-bit activations) within 2% of it; GPipe stepped once per
    batch; the table's ratios are each method's samples/s over plain training's, measured in the same run."""
    text = smoke(tmp_path, "baselines", timeout=600)
    (row,) = json.loads((tmp_path / "results" / "baselines.json").read_text())
    loss = row["final loss"]
    assert math.isclose(loss["gpipe"], loss["plain"], rel_tol=1e-3), loss
    assert math.isclose(loss["swarm"], loss["plain"], rel_tol=0.02), loss
    steps = int(re.search(r"block \d+, (\d+) steps", text).group(1))
    assert row["gpipe optimizer steps"] == steps and 1 <= row["hivemind optimizer steps"] <= steps, row
    cells = [f"{row[key] / row['plain']:.3f} ({row[key]:.1f}/s)" for key in ("gpipe", "hivemind", "swarm")]
    assert f"| {row['d_model']} | {row['plain']:.1f} | {' | '.join(cells)} |" in text, (cells, text)


def test_churn_smoke(tmp_path):
    """The swarm was sampled while the schedule ran: it started with the initial peers and never held more than the
    joins add (nor fewer than the leaves take); every sample's quality is a fraction of the best allocation (at most
    1); the table's mean and lowest are the samples'."""
    text = smoke(tmp_path, "churn", timeout=600)
    data = json.loads((tmp_path / "results" / "churn.json").read_text())
    assert list(data["results"]) == ["with rebalancing"], data["results"].keys()  # the smoke runs one variant
    samples = data["results"]["with rebalancing"]["samples"]
    joins = sum(1 for _, action, _ in data["schedule"] if action == "join")
    leaves = len(data["schedule"]) - joins
    peers = [count for _, _, count in samples]
    assert samples and peers[0] == len(data["initial"]), samples
    assert all(len(data["initial"]) - leaves <= count <= len(data["initial"]) + joins for count in peers), samples
    qualities = [quality for _, quality, _ in samples]
    assert all(0 <= quality <= 1 + 1e-9 for quality in qualities), samples
    mean, lowest = sum(qualities) / len(qualities), min(qualities)
    row = rf"^\| with rebalancing \| {mean:.3f} \| [0-9.]+ \| {lowest:.2f} \| ([0-9.]+) \|$"
    found = re.search(row, text, re.MULTILINE)
    assert found and float(found.group(1)) > 0, (mean, lowest, text)


def test_delayed_updates_smoke(tmp_path):
    """Each run's trainers did the configured steps and sent the 8-bit bytes the 2-stage pipeline implies for them
    (when nothing failed over or recomputed); the table's samples/s are the trainers' own step times', and each
    ratio is its pair's delayed over synchronous figure."""
    text = smoke(tmp_path, "delayed_updates", timeout=600)
    data = json.loads((tmp_path / "results" / "delayed_updates.json").read_text())
    setup = data["setup"]
    for label in ("synchronous", "delayed"):
        assert len(data[label]) == len(data["trained"][label]) == len(data["ratios"]) >= 1, data
        for throughput, trainers in zip(data[label], data["trained"][label]):
            assert len(trainers) == setup["trainers"], trainers
            for history in trainers:
                assert history["steps"] == len(history["times"]) == setup["steps"], history
                assert history["samples"] == setup["steps"] * setup["batch_size"], history
                if not history["failovers"] and not history["recomputed"]:
                    assert history["bytes_sent"] == setup["steps"] * sent_per_step(setup), history
            assert math.isclose(throughput, sum(steady_throughput(history) for history in trainers)), trainers
    for pair, (synchronous, delayed, ratio) in enumerate(zip(data["synchronous"], data["delayed"], data["ratios"])):
        assert math.isclose(ratio, delayed / synchronous)
        assert f"| {pair} | {synchronous:.1f} | {delayed:.1f} | {ratio:.2f} |" in text, text
