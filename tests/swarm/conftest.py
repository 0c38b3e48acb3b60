"""Fixtures of the swarm tests that run peer scripts other than examples/gpt.py."""

from __future__ import annotations

import pytest
from helpers import PEER_ENV, report_peers
from helpers.model_peer import SCRIPT


@pytest.fixture
def model_swarm(tmp_path, request):
    """A LocalSwarm running tests/helpers/model_peer.py peers, stopped (by process group) when the test ends."""
    from lightning_swarm.launch import LocalSwarm

    run_id = "t" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")[-40:]
    with LocalSwarm([SCRIPT], tmp_path, run_id=run_id, env=PEER_ENV) as local_swarm:
        yield local_swarm
        report_peers(request, local_swarm.peers.values())
