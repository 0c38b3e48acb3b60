"""What the tests share: paths, the settings of test swarms, and ways to read what a run recorded.

``helpers.stage`` builds stage servers in-process, ``helpers.raw_client`` talks to one over the wire, and
``helpers/event_peer.py`` is a peer script that records swarm events. Nothing here imports hivemind: the root
conftest imports this module before it configures hivemind's environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPT_SCRIPT = str(ROOT / "examples" / "gpt.py")
LOCAL_YAML = ROOT / "examples" / "swarm_local.yaml"
EVENT_PEER = str(Path(__file__).with_name("event_peer.py"))

CALL_FAILED = pytest.StashKey[bool]()  # set on each test item by the root conftest once its call phase is reported


def running(process: psutil.Process) -> bool:
    """Whether ``process`` still runs: a zombie has exited already, only not yet reaped (init may reap it late)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def report_peers(request: pytest.FixtureRequest, peers) -> None:
    """At a swarm fixture's teardown, print the tail of every peer's log if the test failed (a test killed by its
    timeout included, whose own assertion message never came), else of each peer that exited with an error."""
    failed = request.node.stash.get(CALL_FAILED, False)
    for peer in peers:
        code = peer.process.poll()
        if failed or code not in (None, 0, -9):
            log = peer.log()
            print(f"---- {peer.name} (exit code {code}), its log:\n{log_digest(log)}\n-- its tail:\n{log[-1500:]}")


def late_receipts(log: str) -> int:
    """Chained forwards whose receipt failed after their output had come, in a trainer's ``log``: a failed call to
    the peer that died (counted), but no failover, as the microbatch was done."""
    return log.count("A chain's receipt, read after its parcel came")


LOG_LINE = re.compile(r"^\w{3} +\d+ ([\d:.]+) \[(\w+)\] \[[^\]]*\] ?(.*)$")


def log_digest(log: str, lines: int = 40) -> str:
    """The last ``lines`` lines that a peer's loggers wrote (tracebacks and other output left out) as time, level
    and message cut to 160 characters; a message that repeats the one before is counted instead of printed again.
    What a failed test's report shows of a whole run, where a log's tail shows only its end."""
    kept: list[list] = []
    for line in log.splitlines():
        match = LOG_LINE.match(line)
        if match is None:
            continue
        time, level, message = match.groups()
        if kept and kept[-1][1] == message:
            kept[-1][2] += 1
            continue
        kept.append([f"{time} {level} {message[:160]}", message, 1])
    return "\n".join(text + (f"  (x{count})" if count > 1 else "") for text, _, count in kept[-lines:])


# settings that keep test swarms fast and quiet; every timeout stays finite
PEER_ENV = {
    "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor",
    "HIVEMIND_LOGLEVEL": "WARNING",
    "PYTHONWARNINGS": "ignore",
}
SMALL_GPT = ["--d-model", "32", "--n-layer", "2", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]

FAST = {  # short timeouts so that a test swarm reacts within seconds
    "SWARM_MATCHMAKING_TIME": "1.0",
    "SWARM_AVERAGING_TIMEOUT": "4.0",
    "SWARM_UPDATE_PERIOD": "1.0",
    "SWARM_REQUEST_TIMEOUT": "20.0",
    "SWARM_BAN_TIMEOUT": "30.0",
    "SWARM_JOIN_TIMEOUT": "120.0",
    "SWARM_LINGER": "120.0",
}


def history(path) -> dict:
    """The losses a run recorded with examples/gpt.py --history."""
    with open(path) as f:
        return json.load(f)


def run_script(argv: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python *argv`` as a test swarm's peer starts: forked from the template (:mod:`lightning_swarm.prefork`) whose
    torch and Lightning imports the peers share, in a session of its own, with :data:`PEER_ENV`. Its
    output (stdout and stderr) goes to the file ``log`` and comes back as ``stdout``; past ``timeout`` seconds its
    process group is killed and :class:`subprocess.TimeoutExpired` raised."""
    from lightning_swarm import prefork

    env = {**os.environ, **PEER_ENV, "PYTHONUNBUFFERED": "1"}
    process = prefork.spawn([str(a) for a in argv], env, os.getcwd(), str(log))
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        raise
    return subprocess.CompletedProcess(argv, code, Path(log).read_text(errors="replace"), "")


def plain_training(args: list[str], tmp_path, script: str = GPT_SCRIPT) -> tuple[dict, dict]:
    """``script`` (examples/gpt.py, or a script with its options) with the same arguments, trained in one process
    without a swarm (``--single``): (state dict, history)."""
    out = Path(tmp_path) / "plain"
    argv = [script, "--single", *args, "--save", f"{out}.ckpt", "--history", f"{out}.json"]
    done = run_script(argv, Path(tmp_path) / "plain.log", timeout=300)
    assert done.returncode == 0, f"plain training {args} exited {done.returncode}:\n{done.stdout[-4000:]}"
    return torch.load(f"{out}.ckpt", map_location="cpu", weights_only=False)["state_dict"], history(f"{out}.json")


# one serve-only examples/gpt.py peer serving the only stage of a run, for tests that talk to it over the wire
D_MODEL, BLOCK = 32, 32  # from SMALL_GPT
MAX_REQUEST_BYTES = 1_000_000  # small cap, so that a streamed request above it costs ~1 MB, not 256 MiB
SERVE_ENV = {
    "SWARM_NUM_STAGES": "1",
    "SWARM_ROLE": "serve",
    "SWARM_STAGE": "0",
    "SWARM_COMPRESSION": "none",
    "SWARM_TARGET_BATCH_SIZE": "100000",  # no optimizer step can happen during the test
    "SWARM_UPDATE_PERIOD": "1.0",
    "SWARM_MATCHMAKING_TIME": "1.0",
    "SWARM_AVERAGING_TIMEOUT": "4.0",
    "SWARM_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
}


def activation(*shape: int, dtype=torch.float32) -> torch.Tensor:
    """A random activation, by default the shape the served stage takes."""
    return torch.randn(*(shape or (4, BLOCK, D_MODEL)), dtype=dtype)
