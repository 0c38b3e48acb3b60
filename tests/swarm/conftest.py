"""Fixtures of the swarm tests that run peer scripts other than examples/gpt.py."""

from __future__ import annotations

import pytest
from helpers import PEER_ENV
from helpers.model_peer import SCRIPT


@pytest.fixture
def model_swarm(tmp_path, request):
    """A LocalSwarm running tests/helpers/model_peer.py peers, stopped (by process group) when the test ends."""
    from lightning_swarm.launch import LocalSwarm

    run_id = "t" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")[-40:]
    with LocalSwarm([SCRIPT], tmp_path, run_id=run_id, env=PEER_ENV) as local_swarm:
        yield local_swarm
        for peer in local_swarm.peers.values():
            if peer.process.poll() not in (None, 0, -9):  # a peer that failed, even one the test never waited for
                print(f"---- {peer.name} exited {peer.process.returncode}:\n{peer.log()[-4000:]}")
