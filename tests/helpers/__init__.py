"""What the tests share: paths, the settings of test swarms, and ways to read what a run recorded.

``helpers.stage`` builds stage servers in-process, ``helpers.raw_client`` talks to one over the wire, and
``helpers/event_peer.py`` is a peer script that records swarm events. Nothing here imports hivemind: the root
conftest imports this module before it configures hivemind's environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
            print(f"---- {peer.name} (exit code {code}):\n{peer.log()[-4000:]}")


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


def plain_training(args: list[str], tmp_path) -> tuple[dict, dict]:
    """examples/gpt.py with the same arguments, trained in one process without a swarm: (state dict, history)."""
    out = tmp_path / "plain"
    subprocess.run(
        [sys.executable, GPT_SCRIPT, "--single", *args, "--save", f"{out}.ckpt", "--history", f"{out}.json"],
        check=True,
        timeout=300,
        capture_output=True,
        start_new_session=True,
    )
    return torch.load(f"{out}.ckpt", weights_only=False)["state_dict"], history(f"{out}.json")


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
