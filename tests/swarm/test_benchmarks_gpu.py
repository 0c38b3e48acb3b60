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
from helpers import ROOT


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


def test_gpu_harness_on_cpu(tmp_path):
    """The whole GPU benchmark, on the CPU with a tiny model: plain and swarm figures, memory columns "n/a" (one update
    mode: the other only sets the swarm's SWARM_DELAYED_UPDATES)."""
    result = gpu_bench(tmp_path, "--device", "cpu", "--precision", "32-true", "--updates", "synchronous")
    assert result.returncode == 0, result.stderr[-3000:]
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


def test_gpu_harness_reports_failed_runs(tmp_path):
    """A run whose processes fail is reported, and the benchmark goes on and exits 0."""
    result = gpu_bench(tmp_path, "--device", "cpu", "--precision", "no-such-precision", "--updates", "synchronous")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "results" / "gpu.json").read_text())["runs"]
    assert sorted((r["kind"], r["status"]) for r in runs) == [("plain", "failed"), ("swarm", "failed")], runs
    assert all("no-such-precision" in r["error"] for r in runs), runs
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| no-such-precision | synchronous | failed | failed | - | - |" in text, text


def test_gpu_harness_reports_timed_out_runs(tmp_path):
    """A swarm run past --timeout: reported with the samples/s of the batches it finished, its peers stopped."""
    args = ["--device", "cpu", "--no-plain", "--precision", "32-true", "--updates", "synchronous"]
    result = gpu_bench(tmp_path, *args, "--batches", "1000", "--timeout", "25")
    assert result.returncode == 0, result.stderr[-3000:]
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


def test_gpu_report(tmp_path):
    """Merging results from separate commands: a run replaces the earlier one of its configuration; the ratio, the
    stage peers' share of plain training's memory and out-of-memory runs are reported."""
    gib = 2**30

    def run(kind: str, updates, status: str = "ok", speed: float = 0.0, reserved: tuple = ()) -> dict:
        names = ["plain"] if kind == "plain" else ["trainer", "stage 0", "stage 1"]
        memory = {
            name: {"allocated": size // 2, "reserved": size, "nvidia_smi": size + gib}
            for name, size in zip(names, reserved)
        }
        run = dict(device="H100", d_model=2048, n_layer=8, batch=8, block=512, precision="bf16-mixed", kind=kind)
        run.update(
            updates=updates, microbatches=None, status=status, memory={**memory, "total": {"nvidia_smi": 30 * gib}}
        )
        return {**run, "samples_per_s": speed} if status == "ok" else {**run, "oom_in": ["stage0_0"], "error": "x"}

    first = [
        run("plain", None, speed=40.0, reserved=(10 * gib,)),
        run("swarm", "synchronous", speed=8.0, reserved=(gib,) * 3),
    ]
    later = [
        run("swarm", "synchronous", speed=32.0, reserved=(gib, 5 * gib, 6 * gib)),
        run("swarm", "delayed", "out of memory"),
    ]
    for name, runs in (("first.json", first), ("later.json", later)):
        (tmp_path / name).write_text(json.dumps({"runs": runs}))
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(tmp_path / "RESULTS.md"), "--merge"]
    subprocess.run([*command, str(tmp_path / "first.json"), str(tmp_path / "later.json")], check=True, timeout=120)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| H100 | 2048 | 8 blocks, 8x512 | bf16-mixed | synchronous | 40.00 | 32.00 | 0.800 | - |" in text, text
    assert "| bf16-mixed | delayed | 40.00 | out of memory (stage0_0) | - | - |" in text, text
    assert (
        "| 10240 (5120) / 11264 | 1024 (512) / 2048 | 5120 (2560) / 6144 | 6144 (3072) / 7168 | 0.60 | 30720 |" in text
    )
    assert "To be measured on a lent GPU" not in text
    assert len(json.loads((tmp_path / "results" / "gpu.json").read_text())["runs"]) == 3


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
