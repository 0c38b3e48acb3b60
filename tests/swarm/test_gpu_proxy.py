"""The CPU proxy of the GPU path (benchmarks/gpu_proxy.py): its emulated device's timeline, and a short run of the
whole benchmark whose figures must add up."""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import ROOT

sys.path.append(str(ROOT / "benchmarks"))  # after everything else: its scripts shadow nothing
import emulated_device as emu  # noqa: E402


def device(tmp_path, proc: int = 0) -> emu.EmulatedDevice:
    timeline = emu.Timeline.create(tmp_path / "timeline", capacity=1000)
    return emu.EmulatedDevice(timeline, proc, emu.Calibration(1e-3, 2e-3))


def test_a_sync_waits_until_the_work_enqueued_is_done(tmp_path):
    """A kernel launch returns after its launch cost, not its duration; a sync returns once the device did it, and
    a kernel launched behind it starts where it ended."""
    dev = device(tmp_path)
    start = time.monotonic()
    dev.kernel(0.2, emu.BLOCK_FORWARD, launch=1e-3)
    launched = time.monotonic()
    dev.kernel(0.1, emu.BLOCK_BACKWARD, launch=1e-3)
    dev.synchronize()
    synced = time.monotonic()
    first, second = dev.timeline.records()[:2]
    assert launched - start < 0.1  # the launch did not wait for the kernel
    assert second["t0"] == pytest.approx(first["t1"]) and second["t1"] - first["t0"] == pytest.approx(0.3)
    assert synced >= second["t1"] == dev.tail  # the sync returned once the last kernel ended
    dev.synchronize()  # nothing left: returns at once
    assert time.monotonic() - synced < 0.05
    # a blocking copy waits for the queued work first, then for itself; an asynchronous one only holds the stream
    dev.kernel(0.1, emu.CODEC, launch=0.0)
    dev.blocking(0.05, emu.HOST_H2D)
    waited, codec = last(dev, emu.HOST_WAIT), last(dev, emu.CODEC)
    assert waited["t0"] >= codec["t1"] and waited["t1"] - waited["t0"] >= 0.05
    dev.copy_async(25_000_000)  # 1 ms on the stream
    dev.kernel(0.01, emu.CODEC, launch=0.0)
    copy, kernel = last(dev, emu.COPY), last(dev, emu.CODEC)
    assert copy["t0"] >= waited["t1"] and kernel["t0"] >= copy["t1"] - 1e-9


def last(dev: emu.EmulatedDevice, kind: int):
    """The latest record of ``kind``."""
    records = dev.timeline.records()
    return records[records["kind"] == kind][-1]


def test_recording_and_copies_never_wait_for_another_process_and_all_records_are_read_back(tmp_path):
    """Another process holding the device's lock (its ``flock``) delays a kernel launch, and nothing else: a record
    of the swarm's and a copy on a stream go to this process's own log. Reading back gives both logs' records."""
    dev = device(tmp_path)
    other = os.open(dev.timeline.path, os.O_RDWR)  # another open file: its flock excludes this process's
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        recorder = threading.Thread(target=lambda: (dev.timeline.record(1.0, 2.0, 0, emu.ARRIVE), dev.copy_async(8)))
        launcher = threading.Thread(target=lambda: dev.kernel(1e-3, emu.CODEC, launch=0.0))
        recorder.start()
        recorder.join(timeout=10)
        assert not recorder.is_alive()
        launcher.start()
        launcher.join(timeout=0.5)
        assert launcher.is_alive()  # the kernel waits for the device's lock
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
        os.close(other)
    launcher.join(timeout=10)
    assert not launcher.is_alive()
    kinds = list(dev.timeline.records()["kind"])
    assert sorted(kinds) == sorted([emu.ARRIVE, emu.COPY, emu.CODEC])


def test_a_side_stream_is_ordered_by_marks_and_waits_for_its_own_work(tmp_path):
    """A stage server's reply copy on its side stream: after the mark of its request's compute, not behind the next
    request's kernels queued on the compute stream since; a mark's time is when its stream reaches it."""
    dev, cpu = device(tmp_path), torch.device("cpu")
    dev.kernel(0.2, emu.BLOCK_FORWARD, launch=0.0)
    done = dev.mark(cpu)
    dev.kernel(1.0, emu.BLOCK_FORWARD, launch=0.0)  # the next request, queued at once
    first, second = dev.timeline.records()[:2]
    assert done.event == pytest.approx(first["t1"])
    with dev.side_stream(cpu):
        assert dev.tail == 0.0  # a stream of its own
        dev.wait_for(done)
        dev.copy_async(25_000_000)  # 1 ms on the side stream
        dev.synchronize()
        side = dev.tail
    assert side == pytest.approx(first["t1"] + 1e-3 + dev.cal.copy_latency) and side < second["t1"]
    assert dev.tail == second["t1"]  # the compute stream's work is its own
    start = dev.mark(cpu)
    assert dev.seconds_between(start, dev.mark(cpu)) is None  # the device has not reached it yet
    dev.synchronize(every_stream=True)
    assert dev.seconds_between(done, start) == pytest.approx(second["t1"] - first["t1"])


def test_a_side_streams_codec_kernel_runs_beside_the_compute_queued_before_it(tmp_path):
    """A reply's quantization on a side stream, after the mark of its request's compute: it runs from the end of the
    kernel running then, not behind the next requests' kernels queued since, and delays none of them; on the
    compute stream, the same kernel waits for everything queued before it."""
    dev, cpu = device(tmp_path), torch.device("cpu")
    dev.kernel(0.2, emu.BLOCK_FORWARD, launch=0.0)
    done = dev.mark(cpu)
    for _ in range(3):  # the next request's blocks, queued at once
        dev.kernel(0.1, emu.BLOCK_FORWARD, launch=0.0)
    time.sleep(max(0.0, done.event + 0.05 - time.monotonic()))  # the reply is encoded while the second block runs
    blocks = dev.timeline.records()[:4]
    with dev.side_stream(cpu):
        dev.wait_for(done)
        dev.kernel(1e-3, emu.CODEC, launch=0.0)
    beside = dev.timeline.records()[-1]
    assert beside["key2"] == 1 and beside["t0"] == pytest.approx(blocks[1]["t1"])
    assert dev.timeline.busy_until == pytest.approx(blocks[3]["t1"])  # the queued blocks were not delayed
    dev.kernel(1e-3, emu.CODEC, launch=0.0)
    in_order = dev.timeline.records()[-1]
    assert in_order["key2"] == 0 and in_order["t0"] == pytest.approx(blocks[3]["t1"])


def test_a_launch_uses_its_cpu_and_releases_the_gil_for_its_share(tmp_path):
    """A block's launch uses its cost of the launching thread's CPU. Holding the GIL throughout (a share of 1), it
    keeps every other thread of the process out; with a share of 0.14 (a backward's), a thread waking every
    millisecond runs during it, as beside autograd's engine."""
    dev = device(tmp_path)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # no forced switch: only a released GIL lets the other thread in
    try:
        wakeups = {}
        for gil in (1.0, 0.14):
            woke, stop = [], threading.Event()

            def wake(woke=woke, stop=stop):
                while not stop.is_set():
                    time.sleep(1e-3)
                    woke.append(time.monotonic())

            waker = threading.Thread(target=wake)
            waker.start()
            time.sleep(0.05)
            cpu, began = time.thread_time(), time.monotonic()
            dev.kernel(0.0, emu.BLOCK_BACKWARD, launch=0.2, gil=gil)
            used, ended = time.thread_time() - cpu, time.monotonic()
            stop.set()
            waker.join()
            assert used >= 0.2
            wakeups[gil] = sum(began < t < ended for t in woke)
    finally:
        sys.setswitchinterval(switch)
    assert wakeups[1.0] <= 1 and wakeups[0.14] >= 20, wakeups


PROCESS = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import emulated_device as emu
    dev = emu.EmulatedDevice(emu.Timeline(sys.argv[2]), int(sys.argv[3]), emu.Calibration(1e-3, 2e-3))
    time.sleep(max(0.0, float(sys.argv[4]) - time.time() - 0.05))
    while time.time() < float(sys.argv[4]):  # both start together
        pass
    for _ in range(int(sys.argv[5])):
        dev.kernel(0.05, emu.BLOCK_FORWARD, launch=1e-4)
    dev.synchronize()
    print(time.monotonic(), dev.tail)
    """
)


def test_two_processes_share_the_timeline(tmp_path):
    """Kernels launched by two processes at once run one at a time on the one device; each process's sync waits for
    its own work."""
    timeline = emu.Timeline.create(tmp_path / "timeline", capacity=1000)
    start = time.time() + 2.0
    counts = {0: 3, 1: 4}
    processes = {
        proc: subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(ROOT / "benchmarks"), timeline.path, str(proc), str(start), str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for proc, n in counts.items()
    }
    ends = {}
    for proc, process in processes.items():
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0
        ends[proc] = tuple(map(float, out.split()))
    records = sorted(timeline.records(), key=lambda r: r["t0"])
    kernels = [r for r in records if r["kind"] == emu.BLOCK_FORWARD]
    assert sorted(r["proc"] for r in kernels) == [0] * 3 + [1] * 4
    for before, after in zip(kernels, kernels[1:]):  # serialised: none starts before the one before it ended
        assert after["t0"] >= before["t1"] - 1e-9
    assert kernels[-1]["t1"] - kernels[0]["t0"] >= 7 * 0.05 - 1e-9
    for proc, (synced, tail) in ends.items():
        last = max(r["t1"] for r in kernels if r["proc"] == proc)
        assert tail == pytest.approx(last) and synced >= last


def test_a_helper_that_exits_keeps_its_cpu_in_the_helpers_sum():
    """The proxy's CPU sampler counts a peer's helpers (the processes of its session); a helper that burned CPU and
    exited keeps it in the sum, which never falls (a full run once showed a negative helpers' figure)."""
    from gpu_proxy import CpuSampler

    burner = "import time\nt = time.process_time()\nwhile time.process_time() - t < 2.5: pass"  # seen by 2 reads
    leader = f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {burner!r}])\ntime.sleep(30)"
    peer = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    sampler = CpuSampler(period=0.05)
    sampler.watch("peer", peer.pid)
    try:
        with sampler:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(sampler._members.get("peer", [])) == 0:
                time.sleep(0.05)
            while time.monotonic() < deadline and sampler._members.get("peer"):
                time.sleep(0.05)  # until the burner has exited and the members were read again
            time.sleep(0.5)
    finally:
        peer.kill()
        peer.wait()
    helpers = [sample[2] for sample in sampler.series["peer"]]
    assert all(later >= earlier for earlier, later in zip(helpers, helpers[1:])), helpers
    assert helpers[-1] - helpers[0] >= 1.0, helpers  # the burner's 2.5 s, less what it ran before it was seen


def test_gpu_proxy_quick(tmp_path):
    """``gpu_proxy.py --quick``, with 10 ms added to every message between peers: the device was busy exactly for
    the kernels the run launched, the blocks for the calibrated time of the samples the trainer trained (each stage
    computed each sample forward and backward), and each phase's figures add up: busy and idle time make its wall
    time, the idle parts its idle time; each end of the pipeline took at least the one message it waits for."""
    out = tmp_path / "RESULTS.md"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_proxy.py"), "--quick", "--out", str(out)]
    command += ["--latency-ms", "10"]
    result = subprocess.run(command, timeout=400, capture_output=True, text=True, start_new_session=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = json.loads((tmp_path / "results" / "gpu_proxy.json").read_text())["runs"][-1]
    (check,) = run["checks"]
    assert check["busy"] == pytest.approx(check["kernel_sum"], rel=1e-9)  # kernels in order never overlapped
    assert check["kernels_beside"] > 0  # the stages' decoding and encoding, on their side streams
    assert check["samples"] > 0
    for stage in range(2):
        for kind in ("forward", "backward"):
            assert check[f"{kind} samples, stage {stage}"] == check["samples"], check
    assert check["block_busy"] == pytest.approx(check["block_expected"], rel=1e-3), check
    assert [row["microbatches"] for row in run["rows"]] == [2, 4]
    for row in run["rows"]:
        assert 0 < row["E"] <= 1, row
        idle = row["idle"]
        assert sum(idle[k] for k in ("queued", "step", "between_batches", "in_flight")) == pytest.approx(idle["total"])
        assert row["ideal"] + row["recompute"] + idle["total"] == pytest.approx(row["actual"]), row
        assert row["E"] == pytest.approx(row["ideal"] / row["actual"])
        gaps = row["queued_gaps"]
        assert gaps["at_worker"] + gaps["in_queue"] + gaps["decoding"] == pytest.approx(idle["queued"], abs=1e-9)
        assert row["hops"]["count"] > 0 and row["hops"]["p50"] > 0, row
        assert 0 <= row["hops"]["idle_p50"] <= row["hops"]["p50"], row  # each hop's idle part is within it
        assert all(0.010 <= end < row["actual"] for end in row["ends"].values()), row  # the parcel's way back
        assert set(row["cpu"]) == {"stage0", "stage1", "trainer"}
        assert all(math.isfinite(c["framework"]) and c["holds"] >= 0 for c in row["cpu"].values()), row
    text = out.read_text()
    assert "## GPU proxy" in text and "| 1024 | 8 | 4 |" in text, text
