"""A seconds-long smoke run of each benchmark script: it runs, and writes a results table with real figures. The
GPU benchmarks' are in test_benchmarks_gpu.py, those that train a swarm against plain training in
test_benchmarks_training.py."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.benchmark_smoke import sent_per_step, smoke

sys.path.insert(0, str(ROOT / "benchmarks"))


def test_swarm_throughput_smoke(tmp_path):
    """The trainer sent the 8-bit bytes its microbatches imply (as a multiple of the ideal 2*A*(S-1), by the codec's
    formula, when nothing failed over), no backward recomputed its forward, and the table's efficiency is the
    swarm's samples/s over the slowest stage's alone, both measured in the run."""
    text = smoke(tmp_path, "swarm_throughput", timeout=600)
    (row,) = json.loads((tmp_path / "results" / "swarm_throughput.json").read_text())
    setup, d_model = row["setup"], row["d_model"]
    ideal = 2 * setup["batch_size"] * setup["block_size"] * d_model * 4  # 2*A*(S-1), A in fp32 bytes, S = 2
    labels = [key for key in row if f"{key} bytes" in row]
    assert labels and row["plain"] > 0 and min(row["stages_alone"]) > 0, row
    for label in labels:
        count = int(re.search(r"(\d+) microbatch", label).group(1))  # the smoke's variants have a fixed count
        assert row[f"{label} recomputed"] == 0, row
        if not row[f"{label} failovers"]:
            expected = sent_per_step({**setup, "d_model": d_model, "microbatches": count}) / ideal
            assert math.isclose(row[f"{label} bytes"], expected), (row[f"{label} bytes"], expected)
        assert len(row[f"{label} peak_rss"]) == 3 and all(rss > 0 for rss in row[f"{label} peak_rss"]), row
        efficiency = row[label] / min(row["stages_alone"])
        assert f"| {efficiency:.3f} ({row[label]:.1f}/s) |" in text, text


HEADER_BYTES = 64  # at most, beside a tensor's payload: its shape, dtype and codec in the message


def test_codec_smoke(tmp_path):
    """Every codec's output decodes within the error bound (the table's "yes"), its bytes on the wire are its
    payload (by the codec's formula) plus a small header, and the table's figures are the raw figures'."""
    text = smoke(tmp_path, "codec", timeout=300)
    rows = {r["codec"]: r for r in json.loads((tmp_path / "results" / "codec.json").read_text())}
    assert rows.keys() == {"none", "float16", "8bit", "hivemind 8-bit"}, rows
    n = 4 * 16 * 64
    payload = {"none": 4 * n, "float16": 2 * n, "8bit": n + 4 * -(-n // 4096)}  # 8-bit: a float32 absmax per block
    for codec, row in rows.items():
        figures = r"\| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|.* yes \|$"
        cells = re.search(rf"^\| cpu \| 4x16x64 \| {codec} {figures}", text, re.MULTILINE)
        assert cells and row["within_bound"] and row["shape"] == [4, 16, 64], text
        encode, decode, wire = map(float, cells.groups())
        assert (encode, decode, wire) == (
            round(row["encode_mb_s"], 1),
            round(row["decode_mb_s"], 1),
            round(row["wire_fraction"], 4),
        ), (row, cells.groups())
        assert row["wire_fraction"] == row["wire_bytes"] / (4 * n) and encode > 0 and decode > 0
        if codec in payload:
            assert 0 < row["wire_bytes"] - payload[codec] <= HEADER_BYTES, (codec, row["wire_bytes"], payload[codec])
    ours, theirs = rows["8bit"]["wire_bytes"], rows["hivemind 8-bit"]["wire_bytes"]
    side_by_side = rf"^\| cpu \| 4x16x64 \| [0-9.]+ \| [0-9.]+ \| {ours / theirs:.4f} \|$"  # ours / hivemind's bytes
    assert re.search(side_by_side, text, re.MULTILINE), text


def test_optimizer_host_smoke(tmp_path):
    """Both ways of the stage optimizer's work stepped once per cycle on the same optimizer (a step every 4th
    hand-over, checked in the script), both ways of a round's copies gave hivemind's gradients bit for bit (checked
    in the script), and the table's figures are the raw figures'."""
    text = smoke(tmp_path, "optimizer_host", timeout=300)
    (row,) = json.loads((tmp_path / "results" / "optimizer_host.json").read_text())
    assert row["device"] == "cpu" and row["tensors"] == 48, row  # 4 blocks of 12 tensors
    assert set(row["steps"]) == set(row["ms"]) and len(row["steps"]) == 2, row
    assert all(steps == row["cycles"] + 1 for steps in row["steps"].values()), row  # the warm-up cycle's step too
    old, new = (row["ms"][variant] for variant in row["steps"])
    parts = ("backward", "step", "round")
    cells = [f"{ms[part + ' host']:.3f} / {ms[part]:.3f}" for part in parts for ms in (old, new)]
    keys = ("backward host", "step host", "round")  # a round's ratio: of totals
    ratios = [f"{old[key] / new[key]:.2f}" for key in keys]
    figures = [*cells[:2], ratios[0], *cells[2:4], ratios[1], *cells[4:], ratios[2]]
    assert " | ".join(["| cpu", "64", "48", "3", *figures]) + " |" in text, text


def test_slow_links_smoke(tmp_path):
    """The smoke's one link: 200 Mbit/s with 50 ms added to each stage request. Each microbatch makes 4 requests one
    after another (forward and backward through 2 stages) and the microbatches of a batch travel together, so a
    batch takes 200 ms at least: the swarm's samples/s cannot pass batch / 0.2 s. The trainer sent the 8-bit bytes
    its microbatches imply (when nothing failed over), and the ratio to plain training is the two measured rates'."""
    probe = "ip link set lo up && tc qdisc add dev lo root tbf rate 200mbit burst 256kb latency 50ms"
    if subprocess.run(["unshare", "-n", "sh", "-c", probe], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare -n` and tc's tbf (root) to cap bandwidth in a network namespace")
    text = smoke(tmp_path, "slow_links", timeout=280)
    (row,) = json.loads((tmp_path / "results" / "slow_links.json").read_text())
    assert (row["rate_mbit"], row["latency_ms"], row["codec"]) == (200, 50.0, "8-bit"), row
    setup = {**row["setup"], "d_model": row["d_model"]}
    assert 0 < row["swarm"] <= setup["batch_size"] / (4 * row["latency_ms"] / 1000), row
    assert math.isclose(row["to_plain"], row["swarm"] / row["plain"]), row
    if not row["failovers"]:
        assert row["sent"] == sent_per_step(setup), (row["sent"], sent_per_step(setup))
    cells = rf"\| {row['swarm']:.1f} \| - \| {row['to_plain']:.3f} \| {row['sent'] / 2**20:.2f} \|$"
    assert re.search(rf"^\| 200 Mbit/s \+ 50 ms \| 8-bit {cells}", text, re.MULTILINE), text


def test_stage_memory_smoke(tmp_path):
    """The stage's expected memory is its GPT blocks' fp32 weights (12 d^2 + 13 d per block), as many gradients and
    accumulators, and Adam's two statistics; every batch (the same microbatches) keeps the same forwards' bytes, and
    none is dropped."""
    figures = json.loads(smoke(tmp_path, "stage_memory", timeout=200))
    args, expected, batches = figures["args"], figures["expected"], figures["batches"]
    d = args["d_model"]
    assert expected["parameters"] == 4 * args["blocks"] * (12 * d * d + 13 * d), figures
    assert expected["gradients"] == expected["accumulators"] == expected["parameters"], figures
    assert expected["optimizer_state"] == 2 * expected["parameters"], figures
    assert [row["batch"] for row in batches] == list(range(args["batches"])), figures
    assert len({row["kept_bytes"] for row in batches}) == 1 and batches[0]["kept_bytes"] > 0, figures
    assert all(row["kept_forwards_dropped"] == 0 for row in batches), figures


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


TRANSPORTS = ("hivemind P2P", "gRPC", "ZeroMQ", "direct path", "asyncio TCP")


def test_transport_smoke(tmp_path):
    """Each transport echoed each payload size of the smoke (0.25 and 4 MiB); each row's speeds are those of the raw
    figures, and the bracketed fractions are each speed over the plain socket's, measured side by side; no speed is
    beyond what a loopback copy of the payload each way allows (100 GB/s)."""
    text = smoke(tmp_path, "transport", timeout=240)
    assert f"| payload | {' | '.join(TRANSPORTS)} |" in text, text
    rows = json.loads((tmp_path / "results" / "transport.json").read_text())
    assert sorted((r["transport"], r["bytes"]) for r in rows) == sorted(
        (t, size) for t in TRANSPORTS for size in (2**18, 2**22)
    ), rows
    for r in rows:
        assert 0 < r["mb_s"] < 100_000 and math.isclose(r["mb_s"], r["bytes"] / (r["seconds"] / 2) / 1e6), r
    for size, label in ((2**18, "0.25 MiB"), (2**22, "4 MiB")):
        speed = {r["transport"]: r["mb_s"] for r in rows if r["bytes"] == size}
        cells = [f"{speed[t]:.1f} ({speed[t] / speed['asyncio TCP']:.2f})" for t in TRANSPORTS]
        assert f"| {label} | {' | '.join(cells)} |" in text, (cells, text)


def test_rounds_smoke(tmp_path):
    """Two peers of a stage, nobody leaving: their gradient rounds assemble, parameters are averaged only after a
    step without every partner (hivemind averages them after every step), and both end with equal parameters.
    How many rounds fail is the benchmark's figure, not the smoke's: on a loaded machine a peer that has not seen its
    partner's samples yet steps alone, without a round (a CI run saw 9 of the 16 steps so, and another all 16 at the
    benchmark's pace, a step a second, which the smoke halves), so the smoke asks that each peer had rounds that
    assembled, at least a quarter of the 2 x 8 steps in all (a broken round assembles none)."""
    smoke(tmp_path, "rounds", timeout=300)
    (row,) = json.loads((tmp_path / "results" / "rounds.json").read_text())
    assert all(report["sizes"].get("2", 0) >= 1 for report in row["reports"]), row
    assert row["rounds"] - row["failed"] >= row["steps"] // 2, row
    alone = sum(report["epoch"] for report in row["reports"]) - row["rounds"]  # steps without a round
    assert row["state_rounds"] <= 2 * (row["failed"] + alone), row
    assert row["equal"], row


def test_default_target_smoke(tmp_path):
    """Two peers on two stages, 6 steps each, with no target batch size given: both peers train their steps, and each
    stage's optimizer took the target of both trainers' batches, 32 (the old default was one peer's batch, 16, for
    the whole swarm)."""
    text = smoke(tmp_path, "default_target", timeout=300)
    results = json.loads((tmp_path / "results" / "default_target.json").read_text())
    assert [r["name"] for r in results] == ["default"], results
    (r,) = results
    assert r["steps"] == [6, 6] and r["samples"] == 2 * 6 * 16 and not r["cut"], r
    assert 32 in r["targets"], r
    assert re.search(r"^\| default \| 1 \| \d+ \| 6/6 \|", text, re.MULTILINE), text


def test_warm_start_smoke(tmp_path):
    """A peer forked from the template joins having spent a fraction of the CPU a fresh interpreter spends: torch's
    and Lightning's imports, most of a fresh peer's start, were paid once by the template."""
    text = smoke(tmp_path, "warm_start", timeout=300)
    cpu = {
        row: float(figure)
        for row, figure in re.findall(
            r"\| (fresh interpreter|forked from the template) \|"
            r" \d+ \| [\d.]+ \| ([\d.]+) \|",
            text,
        )
    }
    assert cpu.keys() == {"fresh interpreter", "forked from the template"}, text
    assert cpu["forked from the template"] < 0.5 * cpu["fresh interpreter"], text
