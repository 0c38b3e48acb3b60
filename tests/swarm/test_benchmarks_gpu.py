"""The GPU benchmarks (benchmarks/gpu.py, benchmarks/out_of_core.py) without a GPU: their smoke runs skip, and their
harness runs on the CPU, times "auto" microbatches only once their tuning settled, reports failed, timed-out,
skipped and out-of-memory runs, and stops its peers on SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import ROOT

from lightning_swarm.client.microbatch_tuning import TRIAL_BATCHES, WARMUP_BATCHES

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu  # noqa: E402

CPU_RUN = ["--device", "cpu", "--updates", "synchronous", "--precision", "32-true"]
LABEL = "| cpu | 64 | 2 blocks, 4x32 |"


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
    """The whole GPU benchmark run on the CPU with a tiny model, in 32-true (plain, and the synchronous swarm with 2
    then "auto" microbatches) and in a precision its processes refuse (the runs fail): its directory."""
    directory = tmp_path_factory.mktemp("cpu_run")
    result = gpu_bench(directory, *CPU_RUN, "no-such-precision", "--trace")
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


@pytest.fixture(scope="module")
def timed_out_run(tmp_path_factory):
    """The swarm of cpu_run's configuration (2 microbatches) past --timeout: its directory."""
    directory = tmp_path_factory.mktemp("timed_out_run")
    # 12 s once up was too short for a timed batch on a loaded 2-core CPU (the trainer warms up first)
    args = ["--no-plain", "--microbatches", "2", "--batches", "1000", "--timeout", "30"]
    result = gpu_bench(directory, *CPU_RUN, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


def runs_of(directory, precision: str = "32-true") -> list[dict]:
    return [
        r for r in json.loads((directory / "results" / "gpu.json").read_text())["runs"] if r["precision"] == precision
    ]


def test_gpu_harness_on_cpu(cpu_run):
    """The whole GPU benchmark, on the CPU with a tiny model: plain and swarm figures per microbatch setting, each
    timed after its own warm-up: "auto" only once its tuning settled, so that every timed batch used the count it
    settled on; the swarm's loss on plain training's; memory columns "n/a"."""
    text = (cpu_run / "RESULTS.md").read_text()
    assert "To be measured on a lent GPU" in text and "benchmarks/run_on_gpu.sh $OUT" in text
    runs = {r["microbatches"]: r for r in runs_of(cpu_run)}
    assert sorted((r["kind"], r["updates"], r["target"], r["status"]) for r in runs.values()) == [
        ("plain", None, None, "ok"),
        ("swarm", "synchronous", 4, "ok"),
        ("swarm", "synchronous", 4, "ok"),
    ]
    plain, fixed, auto = runs[None], runs[2], runs["auto"]
    assert plain["batches"] == 2 and len(plain["losses"]) == 4, plain
    assert fixed["warmup"] == 2 and fixed["batches"] == 2 and fixed["counts"] == [2], fixed
    # the tuner compares two counts, each over its warm-up and trial batches: none of that in the timed batches
    assert auto["settled"] in (1, 2, 4) and auto["counts"] == [auto["settled"]], auto
    assert auto["warmup"] >= 2 * (WARMUP_BATCHES + TRIAL_BATCHES) and auto["batches"] == 2, auto
    assert fixed["swarm"] == auto["swarm"] and len(fixed["losses"]) == fixed["warmup"] + 2 + auto["warmup"] + 2
    assert fixed["loss_gap"] == auto["loss_gap"] < 0.02, fixed  # 8-bit wire, a step every batch: plain's curve
    for r in (fixed, auto):
        row = rf"^{re.escape(LABEL)} 32-true \| synchronous \| 4 \| {re.escape(gpu.microbatch_label(r))} \| "
        row += r"([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) / ([0-9.]+) \| ([0-9.]+) \|$"
        found = re.search(row, text, re.MULTILINE)
        assert found, text
        speed, swarm, ratio, *calls, gap = map(float, found.groups())
        assert speed == round(plain["samples_per_s"], 2) and swarm == round(r["samples_per_s"], 2), text
        assert abs(ratio - swarm / speed) < 0.002 and all(c > 0 for c in calls) and gap == round(r["loss_gap"], 4)
    assert f"| auto ({auto['settled']} after {auto['warmup']} batches) |" in text
    memory = rf"^{re.escape(LABEL)} 32-true \| synchronous, target 4((?: \| n/a \(n/a\) / n/a){{4}}) \| - \| n/a \|$"
    assert re.search(memory, text, re.MULTILINE), text
    for r in runs.values():  # every process reported itself (no CUDA: no figures)
        names = {"plain"} if r["kind"] == "plain" else {"trainer", "stage 0", "stage 1"}
        assert {name for name, m in r["memory"].items() if "reserved" in m} == names, r
        assert all(r["memory"][name]["reserved"] is None for name in names), r
        assert r["kind"] == "plain" or all(rss > 0 for rss in r["stage_peak_rss"].values()), r


def test_gpu_harness_traces_each_phases_requests_and_steps(cpu_run):
    """--trace: each timed swarm phase's requests, split into their parts per stage and kind, and the steps."""
    for r in (r for r in runs_of(cpu_run) if r["kind"] == "swarm"):
        names = {f"stage {k} {kind}" for k in (0, 1) for kind in ("forward", "backward")}
        assert names | {"stage 0 step", "stage 1 step", "trainer step"} == set(r["trace"]), r["trace"]
        for name in names:  # a step every batch: every timed batch's microbatches, through both stages
            parts = r["trace"][name]
            assert parts["count"] == r["batches"] * r["counts"][0], (name, parts, r["counts"])
            assert all(parts[p] >= 0 for p in gpu.TRACE_PARTS), (name, parts)
        assert all(r["trace"][f"{who} step"]["count"] == r["batches"] for who in ("stage 0", "stage 1", "trainer"))


def test_gpu_harness_reports_failed_runs(cpu_run):
    """A run whose processes fail is reported, and the benchmark goes on and exits 0."""
    runs = runs_of(cpu_run, "no-such-precision")
    assert sorted((r["kind"], str(r["microbatches"]), r["status"]) for r in runs) == [
        ("plain", "None", "failed"),
        ("swarm", "2", "failed"),
        ("swarm", "auto", "failed"),
    ], runs
    assert all("no-such-precision" in r["error"] for r in runs), runs
    text = (cpu_run / "RESULTS.md").read_text()
    for microbatches in ("2", "auto (not settled in 0 batches)"):
        assert f"| no-such-precision | synchronous | 4 | {microbatches} | failed | failed | - | - | - |" in text, text


def test_gpu_harness_reports_timed_out_runs(timed_out_run):
    """A swarm run past --timeout: reported with the samples/s of the batches it finished, its peers stopped."""
    (run,) = runs_of(timed_out_run)
    assert run["status"] == "timed out" and run["target"] == 4 and run["counts"] == [2], run
    assert 0 < run["batches"] < 1000 and run["samples_per_s"] > 0, run
    assert (
        f"| 4 | 2 | - | timed out ({run['samples_per_s']:.2f} over {run['batches']} batches) |"
        in (timed_out_run / "RESULTS.md").read_text()
    )


def test_gpu_budget_skips_the_runs_it_has_no_time_for(tmp_path, monkeypatch):
    """With no time left in --budget a run is not started: it is reported as skipped, and the benchmark goes on."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(sys, "argv", ["gpu.py", *CPU_RUN, "--budget", "0", "--out", str(tmp_path / "RESULTS.md")])
    monkeypatch.setattr(gpu.signal, "signal", lambda *args: None)  # this process's SIGTERM stays as it is
    gpu.main()
    runs = runs_of(tmp_path)
    assert sorted((r["kind"], str(r["microbatches"]), r["status"]) for r in runs) == [
        ("plain", "None", "skipped (budget)"),
        ("swarm", "2", "skipped (budget)"),
        ("swarm", "auto", "skipped (budget)"),
    ]
    assert "| skipped (budget) | skipped (budget) | - |" in (tmp_path / "RESULTS.md").read_text()


def test_a_run_the_budget_skipped_replaces_no_figures():
    """A later command that had no time for a configuration leaves its earlier figures; a new one is reported."""
    config = dict(device="H200", d_model=1024, n_layer=8, batch=8, block=512, precision="32-true", kind="swarm")
    config.update(updates="synchronous", target=8)
    measured = {**config, "microbatches": 4, "status": "ok", "samples_per_s": 60.0}
    skipped = {**config, "status": gpu.SKIPPED, "error": "no time left in --budget", "memory": {}}
    merged = gpu.merge([measured], [{**skipped, "microbatches": 4}, {**skipped, "microbatches": 8}])
    assert merged == [measured, {**skipped, "microbatches": 8}]
    assert gpu.merge(merged, [{**measured, "microbatches": 8}]) == [measured, {**measured, "microbatches": 8}]
    # a run with the backward not trailing is a configuration of its own; one from before --overlap had it on
    apart = {**measured, "overlap": False, "samples_per_s": 50.0}
    assert gpu.merge([measured], [apart]) == [measured, apart]
    assert gpu.merge([measured, apart], [{**measured, "overlap": True, "samples_per_s": 70.0}]) == [
        {**measured, "overlap": True, "samples_per_s": 70.0},
        apart,
    ]
    # nor does it get a loss curve: a plain run of another configuration has no swarm either
    plain = {**config, "precision": "bf16-mixed", "kind": "plain", "updates": None, "target": None, "losses": [1.0]}
    plain.update(microbatches=None, status="ok")
    assert all("loss_gap" not in r for r in gpu.with_loss_gaps([plain, {**skipped, "precision": "bf16-mixed"}]))


def test_each_swarm_reports_the_memory_of_its_latest_measured_run():
    """One memory row per swarm (updates, target, overlap): the latest of its runs with figures, whatever its
    microbatches (the budget skipped the 4-microbatch phases of a later command, 2026-11-28)."""
    config = dict(updates="synchronous", target=128, status="ok")
    old = {**config, "microbatches": 4, "date": "2026-11-26 09:24", "memory": {"stage 0": {"reserved": 1}}}
    skipped = {**config, "microbatches": 4, "date": None, "status": gpu.SKIPPED, "memory": {}}
    new = {**config, "microbatches": "auto", "date": "2026-11-28 04:08", "memory": {"stage 0": {"reserved": 2}}}
    apart = {**new, "overlap": False}
    assert gpu.latest_measured_swarms([old, skipped, new, apart]) == [new, apart]
    assert gpu.latest_measured_swarms([skipped]) == []


def test_the_peak_memory_of_an_exited_peer_is_none():
    """A peer that exited (a zombie not yet reaped, then reaped) has no peak memory to read: None, no error."""
    assert gpu.peak_rss(os.getpid()) > 0
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while psutil.Process(process.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert gpu.peak_rss(process.pid) is None
    process.wait()
    assert gpu.peak_rss(process.pid) is None


def test_gpu_plan_puts_every_configuration_at_the_first_target_first():
    """The GPU runs in order of priority, each target's timed batches at least one optimizer step's worth."""
    parser_defaults = dict(smoke=False, device="cuda", targets=None, d_model=None, no_plain=False, warmup=None)
    a = argparse.Namespace(**parser_defaults, batches=None, max_warmup=24, precision=["32-true", "bf16-mixed"])
    a.updates, a.mb, a.overlap = ["synchronous"], [4, 8, "auto"], ["on", "off"]
    runs = gpu.plan(a, "H100")
    order = [(s["kind"], s["target"], s["d_model"], s["precision"], s.get("overlap")) for s, _ in runs]
    configurations = [(d, p) for d in (2048, 1024) for p in ("32-true", "bf16-mixed")]
    first = [
        (("plain", None, d, p, None), ("swarm", 8, d, p, True), ("swarm", 8, d, p, False)) for d, p in configurations
    ]
    assert order == [x for runs_of_one in first for x in runs_of_one] + [
        ("swarm", 128, d, p, overlap) for d, p in configurations for overlap in (True, False)
    ]
    for settings, phases in runs:
        timed = 16 if settings["target"] == 128 else 5
        assert [p["microbatches"] for p in phases] == ([4, 8, "auto"] if phases else [])
        assert [(p["warmup"], p["batches"]) for p in phases] == [(3, timed), (2, timed), (2, timed)][: len(phases)]


def test_phase_figures_time_each_phase_from_the_end_of_its_warm_up():
    """A phase's samples/s and seconds in calls per timed batch run from the end of its last warm-up batch; a phase
    cut short keeps the batches it timed."""
    records = [
        dict(phase=0, timed=False, count=4, settled=4, end=10.0, calls={"0": 1.0, "1": 2.0}),
        dict(phase=0, timed=True, count=4, settled=4, end=11.0, calls={"0": 1.5, "1": 2.5}),
        dict(phase=0, timed=True, count=4, settled=4, end=13.0, calls={"0": 2.0, "1": 4.0}),
        dict(phase=1, timed=False, count=4, settled=None, end=14.0, calls={"0": 3.0, "1": 5.0}),
        dict(phase=1, timed=False, count=2, settled=2, end=15.0, calls={"0": 3.5, "1": 5.5}),
        dict(phase=1, timed=True, count=2, settled=2, end=15.5, calls={"0": 4.0, "1": 6.5}),
    ]
    phases = [{"microbatches": 4, "batches": 2}, {"microbatches": "auto", "batches": 3}, {"microbatches": 8}]
    first, second, third = gpu.phase_figures(records, phases, batch=8)
    assert first == dict(warmup=1, batches=2, samples_per_s=16 / 3, call_seconds=[0.5, 1.0], counts=[4])
    assert second == dict(warmup=2, batches=1, settled=2, samples_per_s=16.0, call_seconds=[0.5, 1.0], counts=[2])
    assert third == dict(warmup=0, batches=0)


def test_gpu_harness_stops_peers_on_sigterm(tmp_path):
    """SIGTERM (as from `timeout`) while a swarm trains: the benchmark stops every peer's process group and exits."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *CPU_RUN, "--no-plain", "--microbatches", "2"]
    command += ["--out", str(tmp_path / "RESULTS.md")]
    mark = str(tmp_path)
    env = {**os.environ, "GPU_BENCH_TEST": mark, "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob("gpu_bench_*/*/trainer.log")):  # the swarm's peers are up
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


def merge_into(out, files: list[str], monkeypatch) -> None:
    """``gpu.py --out out --merge files``, in this process (the command line's code, without a process start)."""
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", ["gpu.py", "--out", str(out), "--merge", *files])
        gpu.main()


def test_gpu_report(cpu_run, timed_out_run, tmp_path, monkeypatch):
    """Merging the results of separate commands, here the measured runs of the tests above: a run replaces the
    earlier one of its configuration (the timed-out swarm replaces the finished one, and the other way round), the
    swarm / plain ratio is that of the merged runs' own figures, a failed configuration is reported beside them, and
    the stage peers' share of plain training's memory is the larger stage's reserved memory over plain's."""
    plain = next(r for r in runs_of(cpu_run) if r["kind"] == "plain")
    finished = next(r for r in runs_of(cpu_run) if r["microbatches"] == 2)
    (timed_out,) = runs_of(timed_out_run)
    failed = runs_of(cpu_run, "no-such-precision")
    files = {"ok.json": runs_of(cpu_run), "timed_out.json": [timed_out], "failed.json": failed}
    for name, runs in files.items():
        (tmp_path / name).write_text(json.dumps({"runs": runs}))
    label = f"{LABEL} 32-true | synchronous | 4 | 2 |"
    for order, swarm in ((["ok", "timed_out"], timed_out), (["timed_out", "ok"], finished)):
        out = tmp_path / "-".join(order) / "RESULTS.md"
        out.parent.mkdir()
        merge = [str(tmp_path / f"{name}.json") for name in [*order, "failed"]]
        merge_into(out, merge, monkeypatch)
        merged = runs_of(out.parent)
        assert len(merged) == 3 and plain in merged, merged  # one run per configuration
        (kept,) = [r for r in merged if r["microbatches"] == 2]
        assert kept == {**swarm, "loss_gap": gpu.loss_gap(swarm["losses"], plain["losses"])}, kept
        assert runs_of(out.parent, "no-such-precision") == failed
        text = out.read_text()
        if swarm is timed_out:
            cells = f"{plain['samples_per_s']:.2f} | timed out ({swarm['samples_per_s']:.2f} over {swarm['batches']} "
            assert f"{label} {cells}batches) | - |" in text, text
        else:
            ratio = swarm["samples_per_s"] / plain["samples_per_s"]
            cells = f"{plain['samples_per_s']:.2f} | {swarm['samples_per_s']:.2f} | {ratio:.3f} |"
            assert f"{label} {cells}" in text, text
        assert "| no-such-precision | synchronous | 4 | 2 | failed | failed | - | - | - |" in text, text

    # a later command's plain run replaces this one's, but the swarm's ratio stays against its own command's plain run
    assert finished["plain_samples_per_s"] == plain["samples_per_s"], finished
    later = {**plain, "samples_per_s": 2 * plain["samples_per_s"]}
    (tmp_path / "later.json").write_text(json.dumps({"runs": [later]}))
    out = tmp_path / "later" / "RESULTS.md"
    out.parent.mkdir()
    merge_into(out, [str(tmp_path / "ok.json"), str(tmp_path / "later.json")], monkeypatch)
    ratio = finished["samples_per_s"] / plain["samples_per_s"]
    cells = f"{plain['samples_per_s']:.2f} | {finished['samples_per_s']:.2f} | {ratio:.3f} |"
    assert f"{label} {cells}" in out.read_text() and later in runs_of(out.parent), out.read_text()

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
    merge_into(out, [str(tmp_path / "gpu.json")], monkeypatch)
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


def test_run_on_gpu_stops_after_the_import_check_without_cuda(tmp_path, monkeypatch):
    """benchmarks/run_on_gpu.sh without a GPU: its first step finds no CUDA device, records it, and nothing else
    runs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    script = tmp_path / "checkout" / "benchmarks" / "run_on_gpu.sh"  # a checkout without carried wheels (.whl/)
    script.parent.mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "run_on_gpu.sh", script)
    command = ["bash", str(script), str(tmp_path / "out")]
    result = subprocess.run(command, timeout=120, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["imports", "rc=2"], ["imports", "failed:"]], summary
    assert "FAILED  torch: AssertionError('no CUDA device')" in (tmp_path / "out" / "imports.log").read_text()


def test_out_of_core_smoke_skips_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    command = [sys.executable, str(ROOT / "benchmarks" / "out_of_core.py"), "--smoke", "--out", str(tmp_path / "R.md")]
    result = subprocess.run(command, timeout=120, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped: no CUDA device" in result.stdout and not (tmp_path / "R.md").exists()


def test_out_of_core_on_cpu(tmp_path):
    """The out-of-core benchmark on the CPU (a small stage, the plan's budget alone makes it swap): every run
    trains, the swapped ones within their plan and on the resident run's loss curve; each run's time is split into
    its forward and backward passes and its optimizer step, which add up to it."""
    script = ROOT / "benchmarks" / "out_of_core.py"
    command = [sys.executable, str(script), "--device", "cpu", "--warmup", "1", "--batches", "2", "--step-every", "2"]
    command += ["--out", str(tmp_path / "RESULTS.md")]
    result = subprocess.run(command, timeout=300, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "To be measured on a lent GPU" in text and "python3 benchmarks/out_of_core.py --out $OUT/RESULTS.md" in text
    runs = {}
    figures = r"([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([^|]+) \|[^|]+\|[^|]+\|[^|]+\| ([0-9.e-]+)"
    for kind in ("resident", "recompute", "out of core 2x", "out of core 4x"):
        row = re.search(rf"^\| cpu \| 24 x 128 \(\d+ MiB\) \| 2x32 \| float32 \| {kind} \| {figures} \|$", text, re.M)
        assert row, text
        runs[kind] = row.groups()
    assert all(float(speed) > 0 and float(loss) == 0 for speed, *_, loss in runs.values()), text
    assert all(float(compute) > 0 and float(step) > 0 for _, _, compute, step, _, _ in runs.values()), text
    for kind in ("out of core 2x", "out of core 4x"):  # blocks resident in the plan / most on the device at once
        resident, peak = map(int, runs[kind][4].split(" / "))
        assert peak <= resident + 2 < 24, text
    data = json.loads((tmp_path / "results" / "out_of_core.json").read_text())
    assert [r["kind"] for r in data["results"][0]["runs"]] == ["resident", "recompute", "out of core", "out of core"]
    for r in data["results"][0]["runs"]:  # 2 timed batches, one step among them
        assert r["compute_s_per_batch"] + r["step_s"] / 2 == pytest.approx(r["s_per_batch"], rel=1e-9), r
