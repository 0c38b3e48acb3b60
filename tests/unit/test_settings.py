"""SwarmSettings: frozen, keyword-only, read from the environment."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_swarm.settings import SwarmSettings


def test_settings_are_frozen_keyword_only_and_read_the_environment(monkeypatch):
    monkeypatch.setenv("SWARM_NUM_STAGES", "3")
    monkeypatch.setenv("SWARM_INITIAL_PEERS", "/ip4/127.0.0.1/tcp/1/p2p/A,/ip4/127.0.0.1/tcp/2/p2p/B")
    settings = SwarmSettings.from_env(num_stages=None, linger="7")
    assert settings.num_stages == 3 and settings.linger == 7.0 and len(settings.initial_peers) == 2
    assert SwarmSettings.from_env(num_stages=4).num_stages == 4  # a value given wins over the environment
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.num_stages = 5
    with pytest.raises(TypeError):
        SwarmSettings(2)  # keyword-only
    with pytest.raises(TypeError, match="nmu_stages"):
        SwarmSettings.from_env(nmu_stages=2)
