"""Single-process checks: registration, configuration, the codecs, partitioning and peer choice."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from hivemind.proto import runtime_pb2
from torch import nn

import lightning_swarm
from lightning_swarm import compression, partitioning
from lightning_swarm.client.routing import PeerLoad, StageRouter
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.strategy import SwarmStrategy


def test_swarm_string_resolves_to_swarm_strategy(monkeypatch):
    monkeypatch.setenv("SWARM_RUN_ID", "envrun")
    monkeypatch.setenv("SWARM_INITIAL_PEERS", "/ip4/127.0.0.1/tcp/1/p2p/A, /ip4/127.0.0.1/tcp/2/p2p/B")
    monkeypatch.setenv("SWARM_NUM_STAGES", "3")
    monkeypatch.setenv("SWARM_COMPRESSION", "float16")
    trainer = L.Trainer(strategy="swarm", accelerator="cpu", logger=False, enable_checkpointing=False)
    strategy = trainer.strategy
    assert isinstance(strategy, lightning_swarm.SwarmStrategy)
    assert strategy.run_id == "envrun" and strategy.num_stages == 3 and strategy.compression == "float16"
    assert strategy.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/A", "/ip4/127.0.0.1/tcp/2/p2p/B"]
    assert strategy.node is None, "the constructor must not start the network"


def test_arguments_win_over_environment(monkeypatch):
    monkeypatch.setenv("SWARM_NUM_STAGES", "3")
    assert SwarmStrategy(num_stages=4).num_stages == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(run_id="a.b"), "run_id"),
        (dict(num_stages=0), "num_stages"),
        (dict(microbatches=0), "microbatches"),
        (dict(delayed_updates="maybe"), "boolean"),
        (dict(role="boss"), "role"),
        (dict(num_stages=2, stage=2), "stage=2"),
        (dict(compression="4bit"), "compression"),
    ],
)
def test_bad_arguments_are_refused_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SwarmStrategy(**kwargs)


@pytest.mark.parametrize("codec", ["none", "float16", "8bit"])
@pytest.mark.parametrize("shape", [(3, 7), (2, 64, 96), (5000,)])
def test_codec_round_trips_within_its_bound(codec, shape):
    tensor = torch.randn(*shape) * torch.logspace(-2, 2, shape[-1])
    wire = compression.serialize(tensor, codec).SerializeToString()  # the bytes that cross the network
    decoded = compression.deserialize(runtime_pb2.Tensor.FromString(wire))
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    error = (decoded - tensor).abs()
    assert (error <= compression.error_bound(tensor, codec)).all()
    ratio = len(wire) / (tensor.numel() * 4)
    if codec == "none":
        assert torch.equal(decoded, tensor)
    elif codec == "8bit":
        # one byte per value, an fp32 scale per block of 4096, the 256-entry code table and a small header
        blocks = -(-tensor.numel() // compression.BLOCK_SIZE)
        assert len(wire) <= tensor.numel() + 4 * blocks + 4 * 256 + 128
        assert error.mean() < 0.02 * tensor.abs().mean()
    else:
        assert ratio <= 0.5 + 128 / (tensor.numel() * 4)


def test_error_bound_is_tight_enough_to_catch_a_broken_codec():
    tensor = torch.randn(4096)
    wrong = tensor + compression.error_bound(tensor, "8bit") * 3
    assert not ((wrong - tensor).abs() <= compression.error_bound(tensor, "8bit")).all()


def test_balance_by_parameters_minimises_the_largest_stage():
    blocks = [nn.Linear(10, 10), nn.Linear(10, 100), nn.Linear(100, 10), nn.Linear(10, 10)]
    spans = partitioning.balance_by_parameters(blocks, 2)
    assert [(s.start, s.end) for s in spans] == [(0, 2), (2, 4)]
    equal = partitioning.balance_by_parameters([nn.Linear(8, 8) for _ in range(6)], 3)
    assert [(s.start, s.end) for s in equal] == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="3 blocks into 4 stages"):
        partitioning.balance_by_parameters(blocks[:3], 4)


class TwoSequentials(L.LightningModule):
    def __init__(self, big: int, small: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(big, big), nn.Linear(big, big))
        self.head = nn.Sequential(nn.Linear(small, small))


def test_find_pipeline_by_name_and_automatically():
    assert partitioning.find_pipeline(TwoSequentials(8, 4)) == "body"
    assert partitioning.find_pipeline(TwoSequentials(8, 4), "head") == "head"
    with pytest.raises(ValueError, match="nn.Sequential"):
        partitioning.find_pipeline(TwoSequentials(8, 4), "missing")
    with pytest.raises(ValueError, match="pipeline=<name>"):
        partitioning.find_pipeline(_tied())


def _tied() -> L.LightningModule:
    module = L.LightningModule()
    module.a = nn.Sequential(nn.Linear(4, 4))
    module.b = nn.Sequential(nn.Linear(4, 4))
    return module


def test_stage_state_keys_map_back_to_the_model():
    span = partitioning.StageSpan(index=1, start=2, end=4)
    assert partitioning.stage_state_key("blocks", span, "1.qkv.weight") == "blocks.3.qkv.weight"


def _router_with(loads: dict) -> StageRouter:
    """A router over one stage whose peer loads are given (no network: the DHT is never refreshed)."""
    router = StageRouter(node=None, run_id="unit", num_stages=1, refresh_period=float("inf"))
    router._peers[0] = loads
    return router


def _shares(router, draws: int = 20000) -> dict:
    counts: dict = {}
    for _ in range(draws):
        peer = router.choose(0, batch=8)
        counts[peer] = counts.get(peer, 0) + 1
    return {peer: n / draws for peer, n in counts.items()}


def test_stochastic_wiring_shares_work_by_throughput_and_load():
    def load(throughput=None, **kwargs) -> PeerLoad:
        record = PeerRecord("p", 0, PeerState.SERVING, 0.0, kwargs.pop("queue", 0))
        return PeerLoad(record, throughput, measured_at=time.monotonic(), **kwargs)

    shares = _shares(_router_with({"fast": load(300.0), "slow": load(100.0)}))
    assert abs(shares["fast"] - 0.75) < 0.02  # idle peers: in proportion to throughput

    shares = _shares(_router_with({"a": load(100.0, in_flight=24), "b": load(100.0)}))
    assert abs(shares["b"] - 0.8) < 0.02  # 8 samples to do on b, 32 on a: b is 4x as likely

    shares = _shares(_router_with({"known": load(100.0), "new": load(None)}))
    assert abs(shares["new"] - 0.5) < 0.02  # a newcomer is assumed as fast as the fastest, so it gets tried

    banned = load(1000.0, banned_until=time.monotonic() + 60)
    assert _shares(_router_with({"banned": banned, "ok": load(1.0)}), draws=100) == {"ok": 1.0}
    assert _router_with({"banned": banned}).choose(0, batch=8) is None
