"""SwarmStrategy in-process: registration, its arguments (precedence over the environment, refusals, defaults read
from the run), and the router's counters it hands out."""

from __future__ import annotations

import importlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers.stage import InProcessNode, ask, blocks
from torch import nn

import lightning_swarm
from lightning_swarm import compression, discovery
from lightning_swarm import strategy as strategy_module
from lightning_swarm.client.routing import PeerLoad, RouterStats, StageRouter
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.events import EventQueue
from lightning_swarm.node import SwarmNode
from lightning_swarm.server.stage_host import StageHost
from lightning_swarm.server.stage_server import StageServer
from lightning_swarm.settings import SwarmSettings
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
        (dict(microbatches="some"), "microbatches"),
        (dict(delayed_updates="maybe"), "boolean"),
        (dict(role="boss"), "role"),
        (dict(num_stages=2, stage=2), "stage=2"),
        (dict(compression="4bit"), "compression"),
    ],
)
def test_bad_arguments_are_refused_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SwarmStrategy(**kwargs)


def test_microbatches_default_to_auto_from_arguments_or_environment(monkeypatch):
    assert SwarmStrategy().microbatches == "auto"
    assert SwarmStrategy(microbatches=3).microbatches == 3
    monkeypatch.setenv("SWARM_MICROBATCHES", " Auto ")
    assert SwarmStrategy().microbatches == "auto"
    monkeypatch.setenv("SWARM_MICROBATCHES", "5")
    assert SwarmStrategy().microbatches == 5 and SwarmStrategy(microbatches="auto").microbatches == "auto"
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv("SWARM_MICROBATCHES", bad)
        with pytest.raises(ValueError, match="microbatches must be 'auto' or at least 1"):
            SwarmStrategy()


class _Regression(L.LightningModule):
    def __init__(self, loader_batch_size: int) -> None:
        super().__init__()
        self.layer, self.loader_batch_size = nn.Linear(2, 1), loader_batch_size

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(12, 2))
        return torch.utils.data.DataLoader(data, batch_size=self.loader_batch_size)


class _NoNetwork:
    """What the strategy's setup asks of its SwarmNode, without starting one."""

    dht, daemon_pid, policy = None, None, None

    def __init__(self, *args, **kwargs) -> None:
        pass

    def start(self) -> _NoNetwork:
        return self

    def publish_addresses(self, address_file=None) -> list[str]:
        return []

    def shutdown(self) -> None:
        pass


class _Wrapped(Exception):
    """Raised where the strategy wraps the local optimizer, with the target batch size it computed."""


@pytest.mark.parametrize("given", ["module", "fit", "datamodule"])
def test_target_batch_size_defaults_to_the_train_dataloaders_batch_size(given, monkeypatch, no_swarm_env):
    """Without target_batch_size, a peer starts from its batch size, read when the swarm strategy sets up (as it
    wraps the local optimizer) from its datamodule's ``batch_size`` or else from its train DataLoader, however
    ``fit`` got it. The Trainer runs the swarm strategy; only its network (the node, cutting and serving the
    pipeline, hivemind's optimizer) is left out. The local optimizer's rounds expect every trainer of the run, read
    under its records' keys."""

    def swarm_optimizer(dht, prefix, optimizer, target, *timing, delayed=False, trainer_keys=None):
        raise _Wrapped(target, trainer_keys)

    monkeypatch.setattr(strategy_module, "SwarmNode", _NoNetwork)
    monkeypatch.setattr(SwarmStrategy, "_partition_and_serve", lambda self, trainer, fitting: None)
    monkeypatch.setattr(strategy_module, "swarm_optimizer", swarm_optimizer)
    module = _Regression(loader_batch_size=3)
    trainer = L.Trainer(strategy=SwarmStrategy(), max_steps=1, logger=False, enable_checkpointing=False, barebones=True)
    with pytest.raises(_Wrapped) as wrapped:
        if given == "module":
            trainer.fit(module)
        elif given == "fit":
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(torch.zeros(8, 2), batch_size=5))
        else:
            datamodule = L.LightningDataModule.from_datasets(
                torch.utils.data.TensorDataset(torch.zeros(8, 2)), batch_size=6
            )
            trainer.fit(module, datamodule=datamodule)
    expected = {"module": 3, "fit": 5, "datamodule": 6}[given]
    target, trainer_keys = wrapped.value.args
    assert target == expected and trainer.strategy.target_batch_size == expected
    assert trainer_keys == discovery.record_keys(trainer.strategy.run_id, trainer.strategy.num_stages) != {}


def test_router_stats_are_a_copy_of_the_routers_counters():
    """Callbacks read the router's counters through the strategy, as a copy the router's threads do not change: a
    real router's counters after a call through it, unchanged in the copy by the calls that follow."""
    strategy = SwarmStrategy()
    assert strategy.router_stats == RouterStats()  # before fit: no router
    node = SimpleNamespace(peer_id="me", policy=None, run=InProcessNode.run, submit=InProcessNode.submit)
    router = StageRouter(node, "run", 1, refresh_period=float("inf"))
    router._peers[0] = {"me": PeerLoad(PeerRecord("me", 0, PeerState.SERVING, 1.0, 0))}
    router.local_server = StageServer("run", 0, nn.Linear(4, 4), torch.device("cpu"))
    strategy.router = router
    x = compression.encode(torch.randn(2, 4), "none")
    try:
        router.call(0, "forward", [x], {"codec": "none"}, 2)
        stats = strategy.router_stats
        assert (stats.calls, stats.chosen, stats.bytes_sent) == (1, {"me": 1}, 2 * 4 * 4), stats
        assert stats == router.stats and stats.seconds.keys() == {0}
        seconds = dict(stats.seconds)
        router.call(0, "forward", [x], {"codec": "none"}, 2)
        assert router.stats.calls == 2 and router.stats.chosen == {"me": 2} and router.stats.seconds != seconds
        assert (stats.calls, stats.chosen, stats.seconds, stats.bytes_sent) == (1, {"me": 1}, seconds, 32)
    finally:
        router.local_server.shutdown()


def test_the_demo_reports_the_failed_rounds_of_the_stage_and_the_local_optimizer(tmp_path, monkeypatch):
    """What the demo prints as failed all-reduces: ``swarm_metrics()`` sums the rounds, the failed ones and the seconds
    they held the peer up, of the stage optimizer this peer serves and of its local optimizer, and examples/gpt.py's
    History writes those figures (it once read an attribute gone since a redesign, and counted the local rounds
    only)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "examples"))
    gpt = importlib.import_module("gpt")
    node = SwarmNode().start()
    try:
        host = StageHost(node, SwarmSettings(), {}, torch.device("cpu"), EventQueue(), threading.Event(), print)
        host.stage = SimpleNamespace(
            index=1, optimizer=SimpleNamespace(rounds=9, failed_rounds=2, failed_round_seconds=3.0)
        )
        strategy = SwarmStrategy()
        strategy.host = host
        local = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        local.rounds, local.failed_rounds, local.failed_round_seconds = 4, 1, 1.5  # as its SwarmOptimizer counts them
        strategy.optimizers = [local]
        metrics = strategy.swarm_metrics()
        assert (metrics["stage"], metrics["rounds"], metrics["failed_rounds"]) == (1.0, 13.0, 3.0)
        assert metrics["failed_round_seconds"] == 4.5 and metrics["dropped_forwards"] == 0.0

        host.server = StageServer("run", 1, blocks(), torch.device("cpu"), max_activation_bytes=1)
        try:  # a kept forward over the cap is dropped: its backward will recompute it
            ask(host.server, "forward", [torch.randn(2, 16)], keep="k")
            assert strategy.swarm_metrics()["dropped_forwards"] == 1.0
        finally:
            host.server.shutdown()
            host.server = None
        history = gpt.History(str(tmp_path / "history.json"))
        history.write(SimpleNamespace(strategy=strategy))
        written = json.loads((tmp_path / "history.json").read_text())
        assert (written["rounds"], written["failed_rounds"], written["failed_round_seconds"]) == (13, 3, 4.5)
    finally:
        node.shutdown()
