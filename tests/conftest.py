"""Fixtures of every test (unit/ and swarm/): peers are real processes on loopback, and no process may outlive
the suite. What tests share besides fixtures is in helpers/."""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from multiprocessing import resource_tracker

import psutil
import pytest
from helpers import CALL_FAILED, GPT_SCRIPT, PEER_ENV, ROOT, report_peers, running

# before anything imports hivemind: its default, file_system sharing, starts a torch_shm_manager that outlives tests
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
# every process this suite starts (peers, their p2pd daemons) inherits this mark: the leftover check looks only at
# those, and never touches another run's processes on the same machine
SESSION_MARK = ("LIGHTNING_SWARM_TEST_SESSION", uuid.uuid4().hex)
os.environ[SESSION_MARK[0]] = SESSION_MARK[1]

sys.path.insert(0, str(ROOT / "examples"))


def p2pd_processes() -> set[int]:
    """Running p2pd daemons started by this suite (zombies are dead already, only not yet reaped by init)."""
    found = psutil.process_iter(["name", "status"])
    daemons = [p for p in found if p.info["name"] == "p2pd" and p.info["status"] != psutil.STATUS_ZOMBIE]
    return {p.pid for p in daemons if _environ(p).get(SESSION_MARK[0]) == SESSION_MARK[1]}


def _environ(process: psutil.Process) -> dict:
    try:
        return process.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def leftover_namespaces() -> list[str]:
    """Remove this session's network namespaces that are still there (and the processes in them); their names."""
    from helpers import emulated_hosts

    if os.geteuid() != 0 or shutil.which("ip") is None:  # none could be made
        return []
    found = emulated_hosts.namespaces(emulated_hosts.session_prefix())
    for name in found:
        emulated_hosts.remove_namespace(name)
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Note whether a test's call failed, for its fixtures' teardown (:func:`helpers.report_peers`)."""
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    """Fail the run if any p2pd daemon or peer started during the suite is still alive at its end."""
    from lightning_swarm import prefork

    before = p2pd_processes()
    yield
    prefork.close_templates()  # the templates that forked peers (kept for the next swarm); the peers are gone
    deadline = time.monotonic() + 15
    while (left := p2pd_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    # multiprocessing's own helper, not a leftover: locks made under forkserver (Python 3.14's default) start it. It
    # keeps running: stopped here, it unlinked the semaphores of hivemind's locks, whose finalizers then failed at exit
    tracker = resource_tracker._resource_tracker._pid
    # CUDA's stack symbolizer runs short-lived addr2line children, some still running when the suite ends: a child
    # that exits within a few seconds is not a leftover, and a zombie has exited already
    children = [c for c in psutil.Process().children(recursive=True) if c.pid != tracker]
    _, alive = psutil.wait_procs(children, timeout=5)
    children = [c for c in alive if running(c)]
    for process in [*children, *(psutil.Process(pid) for pid in left if psutil.pid_exists(pid))]:
        process.kill()
    namespaces = leftover_namespaces()  # emulated hosts (helpers/emulated_hosts.py) whose test did not remove them
    assert not left, f"p2pd daemons left behind by the suite: {sorted(left)}"
    assert not namespaces, f"network namespaces left behind by the suite (now removed): {namespaces}"
    assert not children, f"processes left behind by the suite: {[c.pid for c in children]}"


@pytest.fixture
def swarm(tmp_path, request):
    """A LocalSwarm running examples/gpt.py peers, stopped (by process group) when the test ends."""
    from lightning_swarm.launch import LocalSwarm

    run_id = "t" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")[-40:]
    with LocalSwarm([GPT_SCRIPT], tmp_path, run_id=run_id, env=PEER_ENV) as local_swarm:
        yield local_swarm
        report_peers(request, local_swarm.peers.values())


@pytest.fixture
def no_swarm_env(monkeypatch):
    """Tests set the SWARM_* variables they mean; none may leak in from the shell."""
    for name in list(os.environ):
        if name.startswith("SWARM_"):
            monkeypatch.delenv(name)
