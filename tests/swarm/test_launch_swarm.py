"""LocalSwarm, the launcher of the demo and the benchmarks: its peers never outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
from helpers import ROOT

PEER = """
import os, sys, time
with open(os.environ["SWARM_ADDRESS_FILE"], "w") as f:
    f.write("/ip4/127.0.0.1/tcp/1/p2p/peer\\n")
time.sleep(300)
"""

LAUNCHER = """
import sys, time
from pathlib import Path
from lightning_swarm.launch import LocalSwarm

workdir = Path(sys.argv[1])
with LocalSwarm([str(workdir / "peer.py")], workdir, run_id="sigterm") as swarm:
    peer = swarm.start("peer", wait=60)
    (workdir / "peer.pid").write_text(str(peer.process.pid))
    time.sleep(300)
"""


def test_peers_are_stopped_when_the_launcher_gets_sigterm(tmp_path):
    """``timeout`` or a job scheduler stops the launcher with SIGTERM: it stops its peers (each in its own session,
    which a signal to the launcher alone does not reach) as it does on Ctrl-C, and exits."""
    (tmp_path / "peer.py").write_text(textwrap.dedent(PEER))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], env=env, start_new_session=True)
    pid_file = tmp_path / "peer.pid"
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < deadline and launcher.poll() is None, "the launcher did not start its peer"
            time.sleep(0.1)
        peer = psutil.Process(int(pid_file.read_text()))
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) != 0
        peer.wait(timeout=15)  # raises psutil.TimeoutExpired while the peer outlives its launcher
    finally:
        for pid in (launcher.pid, int(pid_file.read_text()) if pid_file.exists() else None):
            if pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        launcher.wait(timeout=10)
