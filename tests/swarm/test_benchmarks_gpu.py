"""The GPU benchmarks (benchmarks/gpu.py, benchmarks/out_of_core.py) without a GPU: their smoke runs skip, and their
harness runs on the CPU, reports failed, timed-out and out-of-memory runs, and stops its peers on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import ROOT

CPU_RUN = ["--device", "cpu", "--precision", "32-true", "--updates", "synchronous"]


def gpu_bench(tmp_path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    """Run ``benchmarks/gpu.py`` (``args``, results into ``tmp_path``) in a session of its own, and check that no
    process it started outlives it."""
    mark = str(tmp_path)
    env = {**os.environ, "GPU_BENCH_TEST": mark}
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *args, "--out", str(tmp_path / "RESULTS.md")]
    result = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True, start_new_session=True)
    assert not started_by(mark), result.stdout[-3000:]
    return result


def started_by(mark: str) -> list[int]:
    """Live processes (peers, their p2pd and DHT helpers) whose environment carries ``GPU_BENCH_TEST=mark``."""
    found = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and process.environ().get("GPU_BENCH_TEST") == mark:
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def test_gpu_smoke_skips_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = gpu_bench(tmp_path, "--smoke", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped: no CUDA device" in result.stdout
    assert not (tmp_path / "RESULTS.md").exists()


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The whole GPU benchmark run on the CPU with a tiny model (plain and the synchronous swarm): its directory."""
    directory = tmp_path_factory.mktemp("cpu_run")
    result = gpu_bench(directory, *CPU_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    """A run whose processes fail (an unknown precision): its directory."""
    directory = tmp_path_factory.mktemp("failed_run")
    result = gpu_bench(directory, "--device", "cpu", "--precision", "no-such-precision", "--updates", "synchronous")
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


@pytest.fixture(scope="module")
def timed_out_run(tmp_path_factory):
    """The swarm of cpu_run's configuration past --timeout: its directory."""
    directory = tmp_path_factory.mktemp("timed_out_run")
    result = gpu_bench(directory, *CPU_RUN, "--no-plain", "--batches", "1000", "--timeout", "25")
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


def runs_of(directory) -> list[dict]:
    return json.loads((directory / "results" / "gpu.json").read_text())["runs"]


def test_gpu_harness_on_cpu(cpu_run):
    """The whole GPU benchmark, on the CPU with a tiny model: plain and swarm figures, memory columns "n/a" (one update
    mode: the other only sets the swarm's SWARM_DELAYED_UPDATES)."""
    tmp_path = cpu_run
    text = (tmp_path / "RESULTS.md").read_text()
    assert "To be measured on a lent GPU" in text and "python3 benchmarks/gpu.py --out $OUT/RESULTS.md ARGS" in text
    for updates in ("synchronous",):
        speed = rf"^\| cpu \| 64 \| 2 blocks, 4x32 \| 32-true \| {updates} \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|"
        row = re.search(speed, text, re.MULTILINE)
        assert row, text
        plain, swarm, ratio = map(float, row.groups())
        assert plain > 0 and swarm > 0 and abs(ratio - swarm / plain) < 0.002, text
        memory = (
            rf"^\| cpu \| 64 \| 2 blocks, 4x32 \| 32-true \| {updates}((?: \| n/a \(n/a\) / n/a){{4}}) \| - \| n/a \|$"
        )
        assert re.search(memory, text, re.MULTILINE), text
    runs = json.loads((tmp_path / "results" / "gpu.json").read_text())["runs"]
    assert sorted((r["kind"], r["updates"], r["status"]) for r in runs) == [
        ("plain", None, "ok"),
        ("swarm", "synchronous", "ok"),
    ]
    for r in runs:  # every process reported itself (no CUDA: no figures)
        names = {"plain"} if r["kind"] == "plain" else {"trainer", "stage 0", "stage 1"}
        assert {name for name, m in r["memory"].items() if "reserved" in m} == names, r
        assert r["batches"] == 5 and all(r["memory"][name]["reserved"] is None for name in names), r


def test_gpu_harness_reports_failed_runs(failed_run):
    """A run whose processes fail is reported, and the benchmark goes on and exits 0."""
    tmp_path = failed_run
    runs = json.loads((tmp_path / "results" / "gpu.json").read_text())["runs"]
    assert sorted((r["kind"], r["status"]) for r in runs) == [("plain", "failed"), ("swarm", "failed")], runs
    assert all("no-such-precision" in r["error"] for r in runs), runs
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| no-such-precision | synchronous | failed | failed | - | - |" in text, text


def test_gpu_harness_reports_timed_out_runs(timed_out_run):
    """A swarm run past --timeout: reported with the samples/s of the batches it finished, its peers stopped."""
    tmp_path = timed_out_run
    (run,) = json.loads((tmp_path / "results" / "gpu.json").read_text())["runs"]
    assert run["status"] == "timed out" and 2 < run["batches"] < 1002 and run["samples_per_s"] > 0, run
    assert (
        f"| timed out ({run['samples_per_s']:.2f} over {run['batches']} batches) |"
        in (tmp_path / "RESULTS.md").read_text()
    )


def test_gpu_harness_stops_peers_on_sigterm(tmp_path):
    """SIGTERM (as from `timeout`) while a swarm trains: the benchmark stops every peer's process group and exits."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--no-plain"]
    command += ["--precision", "32-true", "--updates", "synchronous", "--out", str(tmp_path / "RESULTS.md")]
    mark = str(tmp_path)
    env = {**os.environ, "GPU_BENCH_TEST": mark, "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob("gpu_bench_*/*/trainer0.log")):  # the swarm's peers are up
            assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read()[-3000:]
            time.sleep(0.5)
        time.sleep(2)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        assert not started_by(mark)
        assert not list(tmp_path.glob("gpu_bench_*")), "its temporary directory was left behind"
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
        for pid in started_by(mark):
            os.kill(pid, signal.SIGKILL)


def test_gpu_report(cpu_run, timed_out_run, failed_run, tmp_path):
    """Merging the results of separate commands, here the measured runs of the tests above: a run replaces the
    earlier one of its configuration (the timed-out swarm replaces the finished one, and the other way round), the
    swarm / plain ratio is that of the merged runs' own figures, a failed configuration is reported beside them, and
    the stage peers' share of plain training's memory is the larger stage's reserved memory over plain's."""
    plain = next(r for r in runs_of(cpu_run) if r["kind"] == "plain")
    finished = next(r for r in runs_of(cpu_run) if r["kind"] == "swarm")
    (timed_out,) = runs_of(timed_out_run)
    files = {"ok.json": runs_of(cpu_run), "timed_out.json": [timed_out], "failed.json": runs_of(failed_run)}
    for name, runs in files.items():
        (tmp_path / name).write_text(json.dumps({"runs": runs}))
    label = "| cpu | 64 | 2 blocks, 4x32 | 32-true | synchronous |"
    for order, swarm in ((["ok", "timed_out"], timed_out), (["timed_out", "ok"], finished)):
        out = tmp_path / "-".join(order) / "RESULTS.md"
        out.parent.mkdir()
        merge = [str(tmp_path / f"{name}.json") for name in [*order, "failed"]]
        command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(out), "--merge", *merge]
        subprocess.run(command, check=True, timeout=120)
        merged = runs_of(out.parent)
        assert len(merged) == 4 and swarm in merged and plain in merged, merged  # one run per configuration
        text = out.read_text()
        if swarm is timed_out:
            cells = f"{plain['samples_per_s']:.2f} | timed out ({swarm['samples_per_s']:.2f} over {swarm['batches']} "
            assert f"{label} {cells}batches) | - |" in text, text
        else:
            ratio = swarm["samples_per_s"] / plain["samples_per_s"]
            cells = f"{plain['samples_per_s']:.2f} | {swarm['samples_per_s']:.2f} | {ratio:.3f} |"
            assert f"{label} {cells}" in text, text
        assert "| no-such-precision | synchronous | failed | failed | - | - |" in text, text

    # the memory columns of a GPU run: the CPU runs' processes with reserved, allocated and nvidia-smi figures
    gib = 2**30
    reserved = {"plain": 10 * gib, "trainer": gib, "stage 0": 5 * gib, "stage 1": 6 * gib}
    on_gpu = [
        {**run, "device": "H100", "memory": {**figures, "total": {"nvidia_smi": 30 * gib}}}
        for run, figures in (
            (plain, {"plain": {"reserved": reserved["plain"], "allocated": gib, "nvidia_smi": 11 * gib}}),
            (finished, {n: {"reserved": reserved[n], "allocated": gib, "nvidia_smi": 7 * gib} for n in reserved}),
        )
    ]
    (tmp_path / "gpu.json").write_text(json.dumps({"runs": on_gpu}))
    out = tmp_path / "gpu" / "RESULTS.md"
    out.parent.mkdir()
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(out), "--merge"]
    subprocess.run([*command, str(tmp_path / "gpu.json")], check=True, timeout=120)
    share = max(reserved["stage 0"], reserved["stage 1"]) / reserved["plain"]
    cells = [f"{reserved[n] // 2**20} (1024) / {7168 if n != 'plain' else 11264}" for n in reserved]
    assert f"| {' | '.join(cells)} | {share:.2f} | 30720 |" in out.read_text(), out.read_text()
    assert "To be measured on a lent GPU" not in out.read_text()


def test_gpu_out_of_memory_is_reported():
    """How a failed GPU run is classified, from the processes' logs (no CUDA here to run out of)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import failure

    logs = {
        "stage0_0": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        "stage1_0": "Serving until this process receives SIGTERM or SIGINT",
        "trainer0": "SwarmRequestError('stage 0 forward failed: OutOfMemoryError(...)')",
    }
    crashed = failure(RuntimeError("trainer0 of gpu2048 exited with 1"), logs)
    assert crashed == {"status": "out of memory", "error": "trainer0 of gpu2048 exited with 1", "oom_in": [*logs][::2]}
    stuck = subprocess.TimeoutExpired(["python"], 300)
    assert failure(stuck, logs)["status"] == "out of memory"
    assert failure(stuck, {"trainer0": "Waiting for peers to serve stage(s) [1]"})["status"] == "timed out"
    plain = subprocess.CalledProcessError(1, ["python"], stderr=b"Traceback ...\nValueError: Precision 'x' is invalid")
    assert failure(plain, {"plain": plain.stderr.decode()}) == {"status": "failed", "error": plain.stderr.decode()}


def test_out_of_core_smoke_skips_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    command = [sys.executable, str(ROOT / "benchmarks" / "out_of_core.py"), "--smoke", "--out", str(tmp_path / "R.md")]
    result = subprocess.run(command, timeout=120, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped: no CUDA device" in result.stdout and not (tmp_path / "R.md").exists()


def test_out_of_core_on_cpu(tmp_path):
    """The out-of-core benchmark on the CPU (a small stage, the plan's budget alone makes it swap): every run
    trains, the swapped ones within their plan and on the resident run's loss curve."""
    script = ROOT / "benchmarks" / "out_of_core.py"
    command = [sys.executable, str(script), "--device", "cpu", "--warmup", "1", "--batches", "2", "--out"]
    result = subprocess.run([*command, str(tmp_path / "RESULTS.md")], timeout=300, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "To be measured on a lent GPU" in text and "python3 benchmarks/out_of_core.py --out $OUT/RESULTS.md" in text
    runs = {}
    figures = r"([0-9.]+) \| ([0-9.]+) \| ([^|]+) \|[^|]+\|[^|]+\|[^|]+\| ([0-9.e-]+)"
    for kind in ("resident", "recompute", "out of core 2x", "out of core 4x"):
        row = re.search(rf"^\| cpu \| 24 x 128 \(\d+ MiB\) \| 2x32 \| float32 \| {kind} \| {figures} \|$", text, re.M)
        assert row, text
        runs[kind] = row.groups()
    assert all(float(speed) > 0 and float(loss) == 0 for speed, _, _, loss in runs.values()), text
    for kind in ("out of core 2x", "out of core 4x"):  # blocks resident in the plan / most on the device at once
        resident, peak = map(int, runs[kind][2].split(" / "))
        assert peak <= resident + 2 < 24, text
    data = json.loads((tmp_path / "results" / "out_of_core.json").read_text())
    assert [r["kind"] for r in data["results"][0]["runs"]] == ["resident", "recompute", "out of core", "out of core"]
