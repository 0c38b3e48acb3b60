"""Warm starts (lightning_swarm.prefork): a peer forked from a template runs its script as ``python script.py``
would, and LocalSwarm falls back to fresh interpreters when no template can start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lightning_swarm import prefork
from lightning_swarm.launch import LocalSwarm

SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, random, sys, time
    import lightning  # preloaded: already in sys.modules
    out = sys.argv[1]
    print("to stdout"); print("to stderr", file=sys.stderr)
    record = {
        "argv": sys.argv[1:], "name": __name__, "cwd": os.getcwd(), "path": sys.path,
        "variable": os.environ.get("SWARM_PROBE"), "session": os.getsid(0) == os.getpid(),
        "random": random.random(), "hivemind": "hivemind" in sys.modules,
    }
    atexit.register(lambda: json.dump(record, open(out, "w")))
    if len(sys.argv) > 2:
        {"exit": lambda: sys.exit(3), "raise": lambda: 1 / 0, "sleep": lambda: time.sleep(600)}[sys.argv[2]]()
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return str(path)


def env(**extra: str) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def test_a_forked_peer_runs_its_script_as_a_fresh_interpreter_would(script, tmp_path):
    try:
        first = prefork.spawn(
            [script, str(tmp_path / "a.json")], env(SWARM_PROBE="a"), str(tmp_path), str(tmp_path / "a.log")
        )
        second = prefork.spawn(
            [script, str(tmp_path / "b.json"), "exit"], env(SWARM_PROBE="b"), "/", str(tmp_path / "b.log")
        )
        assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 3
        a, b = (json.loads((tmp_path / f"{k}.json").read_text()) for k in "ab")  # written by atexit handlers
        assert a["argv"] == [str(tmp_path / "a.json")] and a["name"] == "__main__" and a["session"]
        assert a["cwd"] == str(tmp_path) and b["cwd"] == "/" and a["path"][0] == str(tmp_path / "scripts")
        assert (a["variable"], b["variable"]) == ("a", "b")  # SWARM_* differ per peer within one template
        assert first.template is second.template and not a["hivemind"]  # one template; hivemind imported per peer
        assert a["random"] != b["random"]  # reseeded in each peer, as fresh interpreters are
        assert (tmp_path / "a.log").read_text() == "to stdout\nto stderr\n"
        subprocess.run([sys.executable, script, str(tmp_path / "fresh.json")], env=env(), check=True, timeout=120)
        assert a["path"] == json.loads((tmp_path / "fresh.json").read_text())["path"]  # a fresh interpreter's path

        failing = prefork.spawn([script, str(tmp_path / "c.json"), "raise"], env(), "/", str(tmp_path / "c.log"))
        assert failing.wait(timeout=60) == 1 and "ZeroDivisionError" in (tmp_path / "c.log").read_text()
        sleeper = prefork.spawn([script, str(tmp_path / "d.json"), "sleep"], env(), "/", str(tmp_path / "d.log"))
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=0.5)
        assert sleeper.poll() is None
        os.killpg(sleeper.pid, signal.SIGKILL)  # its own session: the group is the peer's alone
        assert sleeper.wait(timeout=30) == -signal.SIGKILL

        other = prefork.spawn(
            [script, str(tmp_path / "e.json")], env(PROBE_IMPORT_TIME="1"), "/", str(tmp_path / "e.log")
        )
        assert other.wait(timeout=60) == 0 and other.template is not first.template  # another environment
    finally:
        prefork.close_templates()


def test_without_a_template_peers_start_as_fresh_interpreters(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "lightning.py").write_text("raise ImportError('no lightning here')\n")  # the template's import fails
    peer = tmp_path / "peer.py"
    peer.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n")
    try:
        with LocalSwarm([str(peer)], tmp_path, run_id="fallback", env={"PYTHONPATH": str(broken)}) as swarm:
            process = swarm._launch(
                [str(peer), str(tmp_path / "out")], env(PYTHONPATH=str(broken)), tmp_path / "p.log", ()
            )
            assert isinstance(process, subprocess.Popen) and not swarm.warm_start
            assert process.wait(timeout=60) == 0 and (tmp_path / "out").read_text() == "ran"
    finally:
        prefork.close_templates()
