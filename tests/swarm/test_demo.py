"""examples/demo.py, the README's first command, run as it is run by hand: its exit status says whether every peer
exited 0 (and nothing else: a failed all-reduce round is part of training, not a failure of the demo)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid

import psutil
import pytest
from helpers import FAST, PEER_ENV, ROOT, SMALL_GPT

DEMO = str(ROOT / "examples" / "demo.py")
SMALL_SWARM = ["--peers", "2", "--stages", "2"]
TIMEOUT = 200  # seconds for one demo run (about 30 on an idle 2-core machine); the pytest timeout is 300
MARK = "LIGHTNING_SWARM_TEST_DEMO"  # inherited by the demo, its peers and their daemons: what the cleanup looks for

pytestmark = pytest.mark.usefixtures("no_swarm_env")


def run_demo(*args: str) -> tuple[int, str]:
    """Run examples/demo.py with ``args`` until it exits: (exit status, what it printed). The FAST settings reach the
    peers through the environment (the demo's own SWARM_* settings win over them)."""
    mark, output = uuid.uuid4().hex, ""
    env = {**os.environ, **PEER_ENV, **FAST, MARK: mark}
    demo = subprocess.Popen(
        [sys.executable, DEMO, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = demo.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the demo then stops its peers (each in its own session, out of the demo's group)
        _signal_group(demo.pid, signal.SIGTERM)
        try:
            output, _ = demo.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            _signal_group(demo.pid, signal.SIGKILL)
            output, _ = demo.communicate()
        pytest.fail(f"examples/demo.py did not finish within {TIMEOUT}s:\n{output[-4000:]}")
    finally:
        _kill_marked(mark)
        # the demo removes its work directory only when it reaches its summary
        if workdir := re.search(r"\(logs in (\S+)\)", output or ""):
            shutil.rmtree(workdir.group(1), ignore_errors=True)
    return demo.returncode, output


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _kill_marked(mark: str) -> None:
    """Kill whatever this run started that is still alive (peers, DHT processes, p2pd daemons): nothing once the demo
    left normally, as it stops its peers itself."""
    left = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARK) == mark:
                process.kill()
                left.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    psutil.wait_procs(left, timeout=10)


def test_demo_exits_0_when_every_peer_does():
    status, output = run_demo(*SMALL_SWARM, "--steps", "8", "--model", " ".join(SMALL_GPT))
    assert status == 0, output[-4000:]
    assert "\nSummary\n" in output and "failed all-reduces" in output, output[-4000:]
    assert "exited with" not in output, output[-4000:]


def test_demo_exits_non_zero_when_a_peer_fails(tmp_path):
    """A peer fails once it trained: its --save path (passed to examples/gpt.py through --model) lies under a regular
    file. The one peer that claims the path fails to write it; the demo still reports on the run, then fails."""
    not_a_directory = tmp_path / "not_a_directory"
    not_a_directory.write_text("")
    model = f"{' '.join(SMALL_GPT)} --save {not_a_directory / 'model.ckpt'}"
    status, output = run_demo(*SMALL_SWARM, "--steps", "3", "--model", model)
    assert status != 0, output[-4000:]
    assert "exited with 1" in output and "\nSummary\n" in output, output[-4000:]
