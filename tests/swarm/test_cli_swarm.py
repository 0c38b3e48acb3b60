"""The command line with real peers: examples/gpt_cli.py fits from its YAML config, and ``lightning-swarm status``
reads a live swarm, a private one, and fails clearly on none."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from helpers import LOCAL_YAML, PEER_ENV, ROOT, SMALL_GPT

from lightning_swarm import cli
from lightning_swarm.launch import LocalSwarm

GPT_CLI = str(ROOT / "examples" / "gpt_cli.py")

pytestmark = pytest.mark.usefixtures("no_swarm_env")


# ---- LightningCLI --------------------------------------------------------------------------------------------------


def test_cli_trains_from_the_yaml_config(tmp_path):
    """examples/gpt_cli.py fits from examples/swarm_local.yaml (one stage, so one peer is a whole swarm)."""
    overrides = [
        "--trainer.strategy.init_args.num_stages=1",
        "--trainer.strategy.init_args.target_batch_size=8",
        "--trainer.max_steps=6",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--model.d_model=32",
        "--model.n_layer=2",
        "--model.n_head=2",
        "--data.block_size=32",
        "--data.batch_size=8",
    ]
    with LocalSwarm([GPT_CLI], tmp_path, run_id="tcli_yaml", env=PEER_ENV) as swarm:
        swarm.start("peer", ["fit", "--config", str(LOCAL_YAML), *overrides])
        assert swarm.wait("peer", timeout=240) == 0, swarm.peers["peer"].log()[-3000:]
        log = swarm.peers["peer"].log()
        # run_id from the YAML (which wins over SWARM_RUN_ID); address_file, left out of it, from SWARM_ADDRESS_FILE
        assert "Swarm 'gpt-local' started" in log and "Serving stage 0 of 1" in log
    (metrics,) = tmp_path.rglob("metrics.csv")
    losses = [float(row["train_loss"]) for row in _csv_rows(metrics) if row.get("train_loss")]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses), losses
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())  # LightningCLI's record of the run
    assert saved["trainer"]["strategy"]["init_args"]["target_batch_size"] == 8


# ---- lightning-swarm status ---------------------------------------------------------------------------------------


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m lightning_swarm ARGS`` (what the lightning-swarm script runs), in its own process group."""
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_swarm", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **PEER_ENV},
    )
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        _kill_group(process)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the DHT child and its p2pd, should the command have left them
    except ProcessLookupError:
        pass
    process.wait()


def _csv_rows(path) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def wait_for_log(peer, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in peer.log():
        assert peer.alive() and time.monotonic() < deadline, peer.log()[-3000:]
        time.sleep(0.2)


def test_status_of_a_live_swarm(swarm, capsys):
    env = {"SWARM_NUM_STAGES": "2", "SWARM_UPDATE_PERIOD": "1.0", "SWARM_MATCHMAKING_TIME": "1.0"}
    env.update(SWARM_AVERAGING_TIMEOUT="4.0", SWARM_LINGER="5.0", SWARM_REBALANCE_PERIOD="0")
    serve = {**env, "SWARM_ROLE": "serve"}
    peers = [swarm.start(f"stage{k}", SMALL_GPT, env={**serve, "SWARM_STAGE": str(k)}) for k in range(2)]
    for k, peer in enumerate(peers):
        wait_for_log(peer, f"Serving stage {k} of 2")
    ids = [peer.addresses()[0].rsplit("/", 1)[-1] for peer in peers]
    address = peers[1].addresses()[0]

    # in this process (one start-up less, on a busy machine); exit codes and stderr of the real command are below
    assert cli.main(["status", "--initial-peers", address, "--run-id", swarm.run_id, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["num_stages"] == 2 and status["num_stages_source"] == "meta"  # read from the peers' metadata
    for k in range(2):
        (record,) = status["stages"][k]["peers"]
        assert record["peer_id"] == ids[k] and record["stage"] == k and record["state"] == "serving", status
        assert record["training"] is False and record["queue"] == 0

    started = time.monotonic()
    result = run_cli("status", "--initial-peers", address, "--run-id", swarm.run_id, "--num-stages", "2", "--full-ids")
    print(result.stdout)
    assert result.returncode == 0, result.stderr
    assert f"run {swarm.run_id!r}: 2 stages, 2 stage peers (2 serving)" in result.stdout
    assert re.search(r"STAGE +STEP +PEERS +SAMPLES/S +QUEUE", result.stdout)
    for k in range(2):
        assert re.search(rf"^{ids[k]} +{k} +serving +[\d.]+ +0 +no$", result.stdout, re.MULTILINE), result.stdout
    print(f"status took {time.monotonic() - started:.1f}s")

    assert cli.main(["status", "--initial-peers", address, "--run-id", "nobody_here"]) == cli.EXIT_NOT_FOUND
    assert "no peer of run 'nobody_here' found" in capsys.readouterr().err

    # a drive-only trainer takes a few steps: each stage's step is read from hivemind's signed progress records
    steps = 4
    swarm.start("trainer", [*SMALL_GPT, "--max-steps", str(steps)], env={**env, "SWARM_ROLE": "drive"})
    assert swarm.wait("trainer", timeout=240) == 0, swarm.peers["trainer"].log()[-3000:]
    assert cli.main(["status", "--initial-peers", address, "--run-id", swarm.run_id, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    print("stage steps after the trainer's", steps, "steps:", [s["step"] for s in status["stages"]])
    assert all(isinstance(s["step"], int) and 1 <= s["step"] <= steps for s in status["stages"]), status

    # --watch refreshes until Ctrl-C (SIGINT to the whole process group, as a terminal sends it), then exits 0
    watch = subprocess.Popen(
        [sys.executable, "-m", "lightning_swarm", "status", "--watch", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **PEER_ENV, "SWARM_INITIAL_PEERS": address, "SWARM_RUN_ID": swarm.run_id},
    )
    try:
        refreshes, deadline = 0, time.monotonic() + 120
        while refreshes < 2:
            line = watch.stdout.readline()
            assert line and time.monotonic() < deadline, watch.stderr.read() if watch.poll() is not None else "slow"
            refreshes += line.startswith("run ")
        os.killpg(watch.pid, signal.SIGINT)
        _, err = watch.communicate(timeout=60)
        assert watch.returncode == 0 and "Traceback" not in err, err
    finally:
        _kill_group(watch)


def test_status_of_a_private_swarm(swarm, tmp_path):
    """A swarm with a shared secret: its records read only with the secret; without it, a one-line hint."""
    secret = tmp_path / "swarm.secret"
    secret.write_text("correct horse battery staple\n")
    env = {"SWARM_NUM_STAGES": "1", "SWARM_ROLE": "serve", "SWARM_STAGE": "0", "SWARM_SECRET_PATH": str(secret)}
    peer = swarm.start("private", SMALL_GPT, env=env)
    wait_for_log(peer, "Serving stage 0 of 1")
    address, peer_id = peer.addresses()[0], peer.addresses()[0].rsplit("/", 1)[-1]
    common = ["status", "--initial-peers", address, "--run-id", swarm.run_id, "--timeout", "8"]

    result = run_cli(*common, "--json", "--secret-path", str(secret))
    assert result.returncode == 0, result.stderr
    assert [r["peer_id"] for r in json.loads(result.stdout)["stages"][0]["peers"]] == [peer_id]

    result = run_cli(*common)
    assert result.returncode == cli.EXIT_ERROR and "pass --secret-path" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr


def test_status_of_nothing_fails_clearly():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWGzD56qtvNW5e7xdvMCaSFU5zZUJPpdVRDtp4Af7LwoA3"
    result = run_cli("status", "--initial-peers", address, "--run-id", "gone", "--timeout", "10", timeout=90)
    elapsed = time.monotonic() - started
    print(f"exit {result.returncode} after {elapsed:.1f}s: {result.stderr.strip()}")
    assert result.returncode == cli.EXIT_ERROR and result.stdout == ""
    assert result.stderr.startswith("lightning-swarm: cannot reach the swarm through ") and address in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert elapsed < 60

    result = run_cli("status", "--initial-peers", "not-an-address", timeout=90)
    assert result.returncode == cli.EXIT_ERROR and result.stderr.count("\n") == 1, result.stderr
    assert "not-an-address" in result.stderr and "Traceback" not in result.stderr
