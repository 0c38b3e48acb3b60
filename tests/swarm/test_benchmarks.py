"""A seconds-long smoke run of each benchmark script: it runs, and writes a results table with real figures. The
GPU benchmarks' are in test_benchmarks_gpu.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers import ROOT


def smoke(tmp_path, name: str, timeout: float) -> str:
    """Run ``benchmarks/<name>.py --smoke`` in a session of its own; returns the results it wrote."""
    out = tmp_path / "RESULTS.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--smoke", "--out", str(out)],
        timeout=timeout,
        capture_output=True,
        text=True,
        start_new_session=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out.read_text()


def test_swarm_throughput_smoke(tmp_path):
    text = smoke(tmp_path, "swarm_throughput", timeout=600)
    # d_model | each stage alone (samples/s) | plain (samples/s) | efficiency (samples/s)
    row = re.search(r"^\| 32 \| ([0-9.]+) / ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \(", text, re.MULTILINE)
    assert row, text
    stage0, stage1, plain, efficiency = map(float, row.groups())
    assert stage0 > 0 and stage1 > 0 and plain > 0 and 0 < efficiency < 10, text


def test_codec_smoke(tmp_path):
    text = smoke(tmp_path, "codec", timeout=300)
    for codec in ("none", "float16", "8bit", "hivemind 8-bit"):
        figures = r"\| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|.* yes \|$"
        row = re.search(rf"^\| cpu \| 4x16x64 \| {codec} {figures}", text, re.MULTILINE)
        assert row, text
        encode, decode, wire = map(float, row.groups())
        assert encode > 0 and decode > 0 and 0 < wire <= 1.01, text
        if codec == "8bit":
            assert wire <= 0.27, text
    assert (tmp_path / "results" / "codec.json").exists()


def test_slow_links_smoke(tmp_path):
    probe = "ip link set lo up && tc qdisc add dev lo root tbf rate 200mbit burst 256kb latency 50ms"
    if subprocess.run(["unshare", "-n", "sh", "-c", probe], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare -n` and tc's tbf (root) to cap bandwidth in a network namespace")
    text = smoke(tmp_path, "slow_links", timeout=280)
    row = re.search(r"^\| 200 Mbit/s \+ 50 ms \| 8-bit \| ([0-9.]+) \| - \| ([0-9.]+) \|", text, re.MULTILINE)
    assert row, text
    speed, to_plain = float(row.group(1)), float(row.group(2))
    assert speed > 0 and 0 < to_plain < 10, text


def test_convergence_smoke(tmp_path):
    text = smoke(tmp_path, "convergence", timeout=600)
    runs = r"plain|swarm, 1 trainer|swarm, 2 trainers"
    losses = re.findall(rf"^\| (?:{runs}) \| [^|]+ \| [0-9]+ \| ([0-9.]+) \|", text, re.MULTILINE)
    assert len(losses) == 3, text
    assert all(0 < float(loss) < 10 for loss in losses), text
    assert (tmp_path / "results" / "convergence.json").exists()


def test_stage_memory_smoke(tmp_path):
    figures = json.loads(smoke(tmp_path, "stage_memory", timeout=200))
    assert len(figures["batches"]) == 3 and all(row["kept_bytes"] > 0 for row in figures["batches"]), figures
    assert figures["expected"]["parameters"] > 0, figures


def test_plot(tmp_path):
    curves = {label: {"samples": [16, 32, 48], "val_loss": [3.1, 2.6, 2.4]} for label in ("plain", "swarm, 1 trainer")}
    (tmp_path / "convergence.json").write_text(json.dumps({"d_model": 32, "curves": curves}))
    delayed = {"synchronous": [10.0, 11.0], "delayed": [12.0, 11.5], "ratios": [1.2, 11.5 / 11.0]}
    (tmp_path / "delayed_updates.json").write_text(json.dumps(delayed))
    (tmp_path / "swarm_throughput.json").write_text("{}")  # a format it does not expect: left out, with a note
    (tmp_path / "unknown.json").write_text("[]")  # no panel for it: a note
    out = tmp_path / "x.png"
    script = ROOT / "benchmarks" / "plot.py"
    command = [sys.executable, str(script), "--data", str(tmp_path), "--out", str(out)]
    result = subprocess.run(command, check=True, timeout=120, capture_output=True, text=True)
    png = out.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, result.stdout
    assert "swarm_throughput.json" in result.stdout and "unknown.json" in result.stdout, result.stdout
    assert "(convergence, delayed_updates)" in result.stdout, result.stdout  # the panels drawn


def test_baselines_smoke(tmp_path):
    text = smoke(tmp_path, "baselines", timeout=600)
    row = re.search(r"^\| 32 \| ([0-9.]+)((?: \| [0-9.]+ \([0-9.]+/s\)){3}) \|$", text, re.MULTILINE)
    assert row, text
    ratios = [float(r) for r in re.findall(r"\| ([0-9.]+) \(", row.group(2))]
    assert float(row.group(1)) > 0 and all(0 < r < 10 for r in ratios), text
    assert (tmp_path / "results" / "baselines.json").exists()


def test_churn_smoke(tmp_path):
    text = smoke(tmp_path, "churn", timeout=600)
    figures = r" \| ([0-9.]+)" * 4
    rows = re.findall(r"^\| (?:with|without) rebalancing" + figures + r" \|$", text, re.MULTILINE)
    assert len(rows) == 1, text  # the smoke runs the variant with rebalancing only
    for mean, _, lowest, trainer in rows:
        assert 0 < float(mean) <= 1.0 and 0 <= float(lowest) <= float(mean) and float(trainer) > 0, text
    assert (tmp_path / "results" / "churn.json").exists()


def test_delayed_updates_smoke(tmp_path):
    text = smoke(tmp_path, "delayed_updates", timeout=600)
    row = re.search(r"^\| 0 \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", text, re.MULTILINE)
    assert row, text
    synchronous, delayed, ratio = map(float, row.groups())
    assert synchronous > 0 and delayed > 0 and abs(ratio - delayed / synchronous) < 0.01, text


def test_transport_smoke(tmp_path):
    text = smoke(tmp_path, "transport", timeout=240)
    for transport in ("hivemind P2P", "gRPC", "ZeroMQ", "direct path", "asyncio TCP"):
        assert f"| {transport} " in text or f" {transport} |" in text, text
    row = re.search(r"^\| 4 MiB \|" + r" ([0-9.]+) \(([0-9.]+)\) \|" * 5 + "$", text, re.MULTILINE)
    assert row, text
    speeds = [float(v) for v in row.groups()[::2]]
    assert all(speed > 0 for speed in speeds) and float(row.group(10)) == 1.0, text
    assert len(json.loads((tmp_path / "results" / "transport.json").read_text())) == 2 * 5
