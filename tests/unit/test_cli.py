"""The command line in-process: LightningCLI configs and flags (examples/gpt_cli.py), and the ``lightning-swarm``
command's status formatting, usage errors, plot, arguments and demo."""

from __future__ import annotations

import inspect
import math
import re

import docstring_parser
import pytest
import yaml
from helpers import LOCAL_YAML, ROOT

from lightning_swarm import SwarmStrategy, cli, settings

MULTI_YAML = ROOT / "examples" / "swarm_multi_machine.yaml"
PEER_A = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWGzD56qtvNW5e7xdvMCaSFU5zZUJPpdVRDtp4Af7LwoA3"
PEER_B = "/ip4/127.0.0.1/tcp/31338/p2p/12D3KooWHnEYFEZtcDzTL25H6CBcb86A4B1WRCn5yJo94JMboaN7"

pytestmark = pytest.mark.usefixtures("no_swarm_env")


def build(args: list[str]) -> SwarmStrategy:
    """Parse and instantiate examples/gpt_cli.py without fitting; the Trainer's strategy."""
    from gpt_cli import cli_main

    strategy = cli_main(args, run=False).trainer.strategy
    assert isinstance(strategy, SwarmStrategy)
    return strategy


# ---- LightningCLI --------------------------------------------------------------------------------------------------


def test_yaml_configs_build_the_strategy():
    local = build(["--config", str(LOCAL_YAML)])
    assert (local.run_id, local.num_stages, local.role, local.compression) == ("gpt-local", 2, "both", "8bit")
    assert (local.target_batch_size, local.microbatches, local.matchmaking_time) == (32, 1, 1.0)
    assert local.host_maddrs == ["/ip4/127.0.0.1/tcp/0"] and local.initial_peers == []
    assert local.node is None  # nothing starts before fit

    multi = build(["--config", str(MULTI_YAML), "--model.n_layer", "2", "--model.d_model", "64"])
    assert (multi.run_id, multi.num_stages, multi.microbatches) == ("gpt-multi", 4, 4)
    assert multi.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"] and multi.identity_path == "swarm_identity.key"


def test_yaml_leaves_the_rest_to_the_environment(monkeypatch):
    monkeypatch.setenv("SWARM_INITIAL_PEERS", f"{PEER_A},{PEER_B}")
    monkeypatch.setenv("SWARM_STAGE", "1")
    monkeypatch.setenv("SWARM_NUM_STAGES", "7")  # the config's num_stages wins over the environment
    strategy = build(["--config", str(LOCAL_YAML)])
    assert strategy.initial_peers == [PEER_A, PEER_B] and strategy.stage == 1 and strategy.num_stages == 2


def test_strategy_name_configured_from_the_environment(monkeypatch):
    monkeypatch.setenv("SWARM_RUN_ID", "from-env")
    monkeypatch.setenv("SWARM_NUM_STAGES", "3")
    monkeypatch.setenv("SWARM_ROLE", "serve")
    monkeypatch.setenv("SWARM_INITIAL_PEERS", PEER_A)
    monkeypatch.setenv("SWARM_COMPRESSION", "float16")
    monkeypatch.setenv("SWARM_DELAYED_UPDATES", "1")
    strategy = build(["--trainer.strategy=swarm"])
    assert (strategy.run_id, strategy.num_stages, strategy.role) == ("from-env", 3, "serve")
    assert strategy.initial_peers == [PEER_A] and strategy.compression == "float16" and strategy.delayed_updates


@pytest.mark.parametrize(
    "args",
    [
        ["--trainer.strategy=SwarmStrategy", "--trainer.strategy.num_stages=3", "--trainer.strategy.role=drive"],
        [
            "--trainer.strategy.class_path=lightning_swarm.SwarmStrategy",
            "--trainer.strategy.init_args.num_stages=3",
            "--trainer.strategy.init_args.role=drive",
        ],
        ['--trainer.strategy={"class_path": "lightning_swarm.SwarmStrategy", "init_args": {"num_stages": 3}}'],
    ],
    ids=["short-name", "class-path", "json"],
)
def test_strategy_flags(args, monkeypatch):
    monkeypatch.setenv("SWARM_NUM_STAGES", "5")  # flags win over the environment
    monkeypatch.setenv("SWARM_ROLE", "drive")
    strategy = build([*args, f"--trainer.strategy.initial_peers=[{PEER_A}, {PEER_B}]", "--trainer.strategy.linger=7"])
    assert strategy.num_stages == 3 and strategy.role == "drive" and strategy.linger == 7.0
    assert strategy.initial_peers == [PEER_A, PEER_B]


def test_help_documents_every_strategy_argument(capsys):
    from gpt_cli import cli_main

    with pytest.raises(SystemExit) as exited:
        cli_main(["fit", "--trainer.strategy.help", "SwarmStrategy"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    documented = {p.arg_name: p.description for p in docstring_parser.parse(SwarmStrategy.__doc__).params}
    for name in inspect.signature(SwarmStrategy.__init__).parameters:
        if name == "self":
            continue
        assert documented.get(name), f"SwarmStrategy's docstring has no Args entry for {name!r}"
        assert f"--trainer.strategy.{name} " in text, f"--help lacks {name}"
        first_words = " ".join(documented[name].split()[:6])
        assert first_words in text, f"--help lacks the description of {name}: {first_words!r}"


def test_print_config(capsys):
    from gpt_cli import cli_main

    with pytest.raises(SystemExit) as exited:
        cli_main(["fit", "--config", str(LOCAL_YAML), "--trainer.strategy.init_args.stage=1", "--print_config"])
    assert exited.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_swarm.SwarmStrategy"
    assert strategy["init_args"]["run_id"] == "gpt-local" and strategy["init_args"]["stage"] == 1
    assert config["seed_everything"] == 0 and config["model"]["d_model"] == 64


# ---- lightning-swarm status ---------------------------------------------------------------------------------------


class FakeNode:
    """The DHT as status reads it: key -> {subkey: value}, no network."""

    def __init__(self, records: dict) -> None:
        self.records = records

    def dht_get(self, key: str, timeout=None):
        return self.records.get(key)


def test_status_read_and_formatted_without_a_network():
    from lightning_swarm.discovery import PeerRecord, PeerState

    def record(peer, stage, state=PeerState.SERVING, throughput=0.0, queue=0, training=False):
        return PeerRecord(peer, stage, state, throughput, queue, training).to_value()

    def progress(epoch):  # hivemind's LocalTrainingProgress, as its ProgressTracker stores it
        return {"peer_id": b"x", "epoch": epoch, "samples_accumulated": 0, "samples_per_second": 1.0,
                "time": 0.0, "client_mode": False}  # fmt: skip

    records = {
        "r_meta": {"a": {"num_stages": 3, "spans": [[0, 1], [1, 2], [2, 3]]}},
        "r_stage0": {"a": record("a", 0, throughput=10.0, queue=2, training=True), "b": record("b", 0, throughput=5.0)},
        "r_stage1": {"c": record("c", 1, PeerState.JOINING)},
        "r_drivers": {"d": record("d", None, training=True), "junk": ("not", "a", "record")},
        "r_stage0_progress": {"a": progress(7), "b": progress(6), "bad": {"epoch": "7"}},
        "r_local_progress": {"d": progress(12)},
    }
    status = cli.read_status(FakeNode(records), "r")
    assert (status.num_stages, status.num_stages_source) == (3, "meta")
    assert [s.step for s in status.stages] == [7, None, None] and status.local_step == 12
    assert set(status.stages[0].peers) == {"a", "b"} and set(status.drivers) == {"d"}  # the malformed one dropped
    text = cli.format_status(status)
    print(text)
    assert "run 'r': 3 stages, 3 stage peers (2 serving), 1 drive-only, 2 training, trainers' step 12" in text
    assert re.search(r"^ +0 +7 +2 +15\.0 +2$", text, re.MULTILINE)  # stage 0: step 7, 2 peers, 15 samples/s, queue 2
    assert re.search(r"^ +1 +- +1 +0\.0 +0  <- no serving peer$", text, re.MULTILINE)  # only joining
    assert re.search(r"^ +2 +- +0 +0\.0 +0  <- no serving peer$", text, re.MULTILINE)
    assert re.search(r"^c +1 +joining +0\.0 +0 +no$", text, re.MULTILINE)
    assert re.search(r"^d +- +driving +- +- +yes$", text, re.MULTILINE)
    as_json = cli.status_dict(status)
    assert as_json["stages"][0]["peers"][0]["state"] == "serving" and as_json["drivers"][0]["training"] is True

    moving = {"m_stage0": {"p": record("p", 0)}, "m_stage1": {"p": record("p", 1, PeerState.JOINING)}}
    moving_text = cli.format_status(cli.read_status(FakeNode(moving), "m", num_stages=2))
    assert "2 stages, 1 stage peer (1 serving)" in moving_text  # a peer moving between stages counts once

    del records["r_meta"]  # the layout record expired: count the stages from the live ones
    status = cli.read_status(FakeNode(records), "r")
    assert (status.num_stages, status.num_stages_source) == (2, "probed")
    assert "guessed from live stages" in cli.format_status(status)
    assert cli.read_status(FakeNode(records), "r", num_stages=4).num_stages == 4


def test_status_usage_errors(capsys):
    assert cli.main(["status"]) == cli.EXIT_USAGE  # no initial peers, none in the environment
    assert "--initial-peers" in capsys.readouterr().err
    assert cli.main(["status", "--initial-peers", PEER_A, "--run-id", "no spaces"]) == cli.EXIT_USAGE
    with pytest.raises(SystemExit) as exited:
        cli.main(["status", "--num-stages", "two"])
    assert exited.value.code == cli.EXIT_USAGE


# ---- lightning-swarm plot -----------------------------------------------------------------------------------------


COLUMNS = [
    "epoch", "step", "train_loss", "swarm/stage", "swarm/peers", "swarm/step", "swarm/stage0_throughput",
    "swarm/stage1_throughput", "swarm/stage0_peers", "swarm/stage1_peers", "swarm/queue", "swarm/bytes_sent",
    "swarm/bytes_received", "swarm/compression_ratio", "swarm/failovers", "swarm/rebalances",
]  # fmt: skip


def write_recorded_run(path, steps: int = 60, failover_at: int = 20, rebalance_at: int = 40) -> None:
    """A metrics.csv as Lightning's CSVLogger writes it for a peer with SwarmMonitor: sparse rows, one per log."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for step in range(steps):
            writer.writerow({"epoch": 0, "step": step, "train_loss": 4.2 * math.exp(-step / 30) + 1.0})
            if step % 5 == 4:
                moved = step >= rebalance_at
                writer.writerow(
                    {
                        "epoch": 0,
                        "step": step,
                        "swarm/stage": 1 if moved else 0,
                        "swarm/peers": 4 if step < failover_at else 3,
                        "swarm/step": step // 2,
                        "swarm/stage0_throughput": 120.0 + step,
                        "swarm/stage1_throughput": 80.0 if step < failover_at else 40.0,
                        "swarm/stage0_peers": 1 if moved else 2,
                        "swarm/stage1_peers": (2 if step < failover_at else 1) + moved,
                        "swarm/queue": step % 3,
                        "swarm/bytes_sent": 1000 * step,
                        "swarm/bytes_received": 900 * step,
                        "swarm/compression_ratio": 3.9,
                        "swarm/failovers": 0 if step < failover_at else 1,
                        "swarm/rebalances": 0 if step < rebalance_at else 1,
                    }
                )


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_a_recorded_run(tmp_path, capsys):
    for peer in ("peer0", "peer1"):
        write_recorded_run(tmp_path / "logs" / peer / "version_0" / "metrics.csv")
    out = tmp_path / "run.png"
    assert cli.main(["plot", str(tmp_path / "logs"), "-o", str(out)]) == 0
    assert "from 2 metrics file(s)" in capsys.readouterr().out
    width, height = png_size(out)
    assert width >= 600 and height >= 600

    columns = cli.load_metrics(tmp_path / "logs" / "peer0" / "version_0" / "metrics.csv")
    assert cli.event_points(columns, columns["step"], "swarm/failovers") == [24.0]  # first logged at or after 20
    assert cli.event_points(columns, columns["step"], "swarm/rebalances") == [44.0]


def test_plot_what_is_present(tmp_path, capsys):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train_loss\n0,0,4.1\n0,1,3.9\n0,2,3.5\n")
    out = tmp_path / "loss_only.png"
    assert cli.main(["plot", str(metrics), "-o", str(out)]) == 0
    assert "no throughput per stage in the metrics" in capsys.readouterr().err
    png_size(out)

    assert cli.main(["plot", str(tmp_path / "missing"), "-o", str(out)]) == cli.EXIT_ERROR
    assert "no such file or directory" in capsys.readouterr().err
    assert cli.main(["plot", str(metrics), "--x", "time", "-o", str(out)]) == cli.EXIT_ERROR
    assert "no wall-time column" in capsys.readouterr().err


# ---- lightning-swarm arguments -------------------------------------------------------------------------------------


def test_arguments_are_listed_and_documented(capsys):
    parsed = {p.arg_name: " ".join(p.description.split()) for p in docstring_parser.parse(SwarmStrategy.__doc__).params}
    assert settings.descriptions() == parsed  # the command reads what jsonargparse reads
    arguments = {a["name"]: a for a in cli.strategy_arguments()}
    assert arguments.keys() == set(inspect.signature(SwarmStrategy.__init__).parameters) - {"self"}
    assert arguments["num_stages"]["env"] == "SWARM_NUM_STAGES" and arguments["num_stages"]["default"] == "2"
    assert arguments["role"]["type"] == "'both' | 'serve' | 'drive'" and arguments["run_id"]["default"] == "swarm"

    assert cli.main(["arguments", "--markdown"]) == 0
    table = capsys.readouterr().out
    docs = (ROOT / "docs" / "arguments.md").read_text()
    for name in arguments:
        row = f"| `{name}` ("
        assert row in table
        assert row in docs, f"docs/arguments.md lacks {name}: lightning-swarm arguments --markdown > docs/arguments.md"


# ---- lightning-swarm demo ------------------------------------------------------------------------------------------


def test_demo_runs_the_checkout_demo(capfd):
    assert cli.main(["demo", "--help"]) == 0  # examples/demo.py --help, in a child process
    out = capfd.readouterr().out
    assert "usage: demo.py" in out and "--peers" in out


def test_demo_outside_a_checkout(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli.demo, "demo_candidates", lambda: [tmp_path / "examples" / "demo.py"])
    assert cli.main(["demo"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "checkout" in err and err.count("\n") == 1
