"""Swarms across emulated hosts: each peer in a network namespace of its own, on a 100 Mbit/s link, listening on
its host's address (tests/helpers/emulated_hosts.py). They need root and the ``ip`` command, and skip without."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import FAST, GPT_SCRIPT, PEER_ENV, SMALL_GPT, history, late_receipts, report_peers
from helpers.emulated_hosts import PORT, EmulatedHosts, HostSwarm, namespaces, unavailable_reason

RATE_MBIT = 100
ENV = {**FAST, "SWARM_NUM_STAGES": "2", "SWARM_TARGET_BATCH_SIZE": "8"}
SERVE = {**ENV, "SWARM_ROLE": "serve", "SWARM_REBALANCE_PERIOD": "0"}  # peers stay where the test puts them


@pytest.fixture
def hosts():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with EmulatedHosts() as made:
        yield made
    assert not namespaces(made.switch.removesuffix("switch")), "namespaces left behind"


@pytest.fixture
def host_swarm(hosts, tmp_path, request):
    """A swarm of examples/gpt.py peers, each on the emulated host of its name (add the hosts first)."""
    run_id = "t" + request.node.name[-40:]
    with HostSwarm(hosts, [GPT_SCRIPT], tmp_path, run_id, PEER_ENV) as swarm:
        yield swarm
        report_peers(request, swarm.peers.values())
    assert not hosts.processes(), "processes left running on the emulated hosts"


def needs_nat() -> None:
    reason = unavailable_reason(nat=True)
    if reason:
        pytest.skip(reason)


def wait_for_steps(record, swarm, name: str, steps: int, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while not (record.exists() and history(record)["steps"] >= steps):
        assert time.monotonic() < deadline and swarm.peers[name].alive(), swarm.peers[name].log()[-3000:]
        time.sleep(0.2)
    return history(record)


def test_four_hosts_train_and_fail_over(hosts, host_swarm, tmp_path):
    """4 peers on hosts of their own (100 Mbit/s): serve-only peers of both stages, a second one of stage 1, and a
    drive-only trainer. Each listens on and announces its host's address, and the trainer calls the stages over
    the direct path; killing the stage-1 peer doing the work (its whole host's processes, as a machine lost) costs
    only retries on the other."""
    for name in ("stage0", "stage1_a", "stage1_b", "trainer"):
        hosts.add_host(name, RATE_MBIT)
    steps, record = 16, tmp_path / "trainer.json"
    host_swarm.start_together(
        {
            "stage1_a": (SMALL_GPT, {**SERVE, "SWARM_STAGE": "1"}),
            "stage1_b": (SMALL_GPT, {**SERVE, "SWARM_STAGE": "1"}),
            "stage0": (SMALL_GPT, {**SERVE, "SWARM_STAGE": "0"}),
        }
    )
    for name, peer in host_swarm.peers.items():
        own = f"/ip4/{hosts.hosts[name].ip}/tcp/{PORT}/p2p/"
        assert peer.addresses() and all(a.startswith(own) for a in peer.addresses()), (name, peer.addresses())
    args = [*SMALL_GPT, "--max-steps", str(steps), "--history", str(record)]
    host_swarm.start("trainer", args, {**ENV, "SWARM_ROLE": "drive"})

    calls = wait_for_steps(record, host_swarm, "trainer", 4)["calls_per_peer"]
    stage1 = {host_swarm.peers[name].addresses()[0].rsplit("/", 1)[-1]: name for name in ("stage1_a", "stage1_b")}
    victim = max(stage1, key=lambda peer: calls.get(peer, 0))
    assert calls.get(victim, 0) > 0, "no stage-1 peer served work before the kill"
    os.killpg(host_swarm.peers[stage1[victim]].process.pid, signal.SIGKILL)

    assert host_swarm.wait("trainer", timeout=300) == 0, host_swarm.peers["trainer"].log()[-3000:]
    final = history(record)
    failed, breaks = final["failed_calls_per_peer"].get(victim, 0), final["chain_breaks"]
    print(
        f"hosts: {final['direct_calls']} direct calls, {final['p2p_calls']} over libp2p, {final['failovers']} "
        f"failovers, {failed} failed calls to the killed peer, {breaks} chain breaks, {final['seconds']:.1f}s"
    )
    assert final["steps"] == steps
    # each failed call to the killed peer was retried on the other, except a chain's receipt that failed after its
    # parcel had come (the microbatch was done; 4 failed calls and 3 failovers in one CI run); the other failovers
    # are chains that the stage-0 peer could not hand on, relayed by the trainer
    late = late_receipts(host_swarm.peers["trainer"].log())
    counts = (final["failovers"], breaks, failed, late, final["failed_calls_per_peer"])
    assert final["failovers"] - breaks <= failed <= final["failovers"] - breaks + late, counts
    # a stage server that cannot hand on stops the microbatches in flight (4 at most), then the trainer relays for a
    # ban_timeout (30s), then twice as long. Before that pause, one CI run took 144s (16s here otherwise), with 52
    # failovers for 11 failed calls: its stage-0 peer saw no live stage-1 peer for minutes after the kill and held
    # each chain for its wait for one (10s) before the trainer relayed it
    assert breaks <= 3 * 4, counts
    assert final["direct_calls"] > 0  # the hosts reach each other's direct path


def test_drive_only_trainer_behind_nat(hosts, host_swarm, tmp_path):
    """A drive-only trainer on a private host behind a masquerading router trains with public stage servers: its
    DHT and averagers in client mode, it only dials out, and calls the stages over their direct path."""
    needs_nat()
    for name in ("stage0", "stage1"):
        hosts.add_host(name, RATE_MBIT)
    hosts.add_nat("trainer", rate_mbit=RATE_MBIT)
    steps, record = 8, tmp_path / "trainer.json"
    host_swarm.start_together(
        {
            "stage0": (SMALL_GPT, {**SERVE, "SWARM_STAGE": "0"}),
            "stage1": (SMALL_GPT, {**SERVE, "SWARM_STAGE": "1"}),
        }
    )
    args = [*SMALL_GPT, "--max-steps", str(steps), "--history", str(record)]
    host_swarm.start("trainer", args, {**ENV, "SWARM_ROLE": "drive", "SWARM_CLIENT_MODE": "1"})
    assert host_swarm.wait("trainer", timeout=300) == 0, host_swarm.peers["trainer"].log()[-3000:]
    final = history(record)
    assert final["steps"] == steps and final["failovers"] == 0
    assert final["direct_calls"] > 0  # outbound connections pass the NAT


def test_stage_server_behind_nat(hosts, host_swarm, tmp_path):
    """A stage-1 server behind NAT, in client mode: it advertises no direct path and dials every reachable peer of
    the swarm (at the addresses they publish), so that a trainer that joins after it calls it over libp2p, on the
    connection the server opened; the trainer never fails over."""
    needs_nat()
    for name in ("stage0", "trainer"):
        hosts.add_host(name, RATE_MBIT)
    hosts.add_nat("stage1", rate_mbit=RATE_MBIT)
    steps, record = 8, tmp_path / "trainer.json"
    host_swarm.start("stage0", SMALL_GPT, {**SERVE, "SWARM_STAGE": "0"})
    stage1 = host_swarm.start("stage1", SMALL_GPT, {**SERVE, "SWARM_STAGE": "1", "SWARM_CLIENT_MODE": "1"})
    args = [*SMALL_GPT, "--max-steps", str(steps), "--history", str(record)]
    host_swarm.start("trainer", args, {**ENV, "SWARM_ROLE": "drive"})
    assert host_swarm.wait("trainer", timeout=300) == 0, host_swarm.peers["trainer"].log()[-3000:]
    final = history(record)
    nated = stage1.addresses()[0].rsplit("/", 1)[-1]
    assert final["steps"] == steps and final["failovers"] == 0
    # no failed call: every call to the server behind NAT went over libp2p (it advertises no direct path), or is
    # still on its way: the receipts of the last backwards, which the trainer goes on without
    answered = final["direct_calls"] + final["p2p_calls"] + sum(final["failed_calls_per_peer"].values())
    unanswered = sum(final["calls_per_peer"].values()) - answered
    assert 0 <= unanswered and 0 < final["calls_per_peer"][nated] <= final["p2p_calls"] + unanswered, final
    assert final["direct_calls"] > 0  # stage 0's
