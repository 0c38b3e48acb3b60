"""A seconds-long smoke run of each benchmark script: it runs, and writes a results table with real figures. The
GPU benchmarks' are in test_benchmarks_gpu.py."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy
import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import steady_throughput  # noqa: E402


def eight_bit_bytes(elements: int) -> int:
    """The bytes of an 8-bit tensor on the wire: one per element, and a float32 scale per block of 4096."""
    return elements + 4 * -(-elements // 4096)


def sent_per_step(setup: dict) -> int:
    """What a drive-only trainer of the 2-stage GPT sends per step, 8-bit: for each microbatch its input to stage 0,
    stage 0's output on to stage 1, and the gradients of both stages' outputs back (4 activation-sized tensors)."""
    count = setup["microbatches"]
    elements = setup["batch_size"] // count * setup["block_size"] * setup["d_model"]
    return 4 * count * eight_bit_bytes(elements)


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
    """Two peers of a stage, nobody leaving: their gradient rounds assemble (at most one of the 16 fails, on a loaded
    machine), parameters are averaged only after a round that missed a partner (hivemind averages them after every
    step), and both end with equal parameters."""
    smoke(tmp_path, "rounds", timeout=300)
    (row,) = json.loads((tmp_path / "results" / "rounds.json").read_text())
    assert row["rounds"] >= 2 * row["steps"] - 2 and row["failed"] <= 1, row
    assert row["state_rounds"] <= 2 * row["failed"], row
    assert row["equal"], row
