"""A peer of the GPT example for tests: it trains on the swarm (serving a stage too) until SIGTERM, and records every
swarm event it receives, beside SwarmMonitor, a CSV logger, ModelCheckpoint and EarlyStopping; after each batch it
writes its step (``steps``) and the calls its router sent to each peer (``calls.json``).

    python tests/helpers/event_peer.py OUT_DIR     # configured by SWARM_* variables, like examples/gpt.py
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, CharDataModule  # noqa: E402

from lightning_swarm.callbacks import SwarmCallback, SwarmMonitor  # noqa: E402


class Recorder(SwarmCallback):
    """Writes every swarm event, with the hook that received it, to ``path`` (JSON lines), as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _record(self, trainer, pl_module, event) -> None:
        assert trainer.lightning_module is pl_module
        with open(self.path, "a") as f:
            f.write(json.dumps({"hook": event.hook, "type": type(event).__name__, **dataclasses.asdict(event)}) + "\n")

    on_swarm_peer_joined = on_swarm_peer_left = on_swarm_stage_changed = _record
    on_swarm_stage_step = on_swarm_failover = _record

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # each replaced at once: tests read them while training goes on
        written = self.path.parent / "steps.tmp"
        written.write_text(str(trainer.global_step))
        written.replace(self.path.parent / "steps")
        calls = self.path.parent / "calls.tmp"  # calls this peer's router sent to each peer so far
        calls.write_text(json.dumps(trainer.strategy.router_stats.chosen))
        calls.replace(self.path.parent / "calls.json")


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    L.seed_everything(0)
    dm = CharDataModule(block_size=32, batch_size=8, num_batches=10)  # 10 steps per epoch: EarlyStopping checks
    model = GPT(dm.vocab_size, block_size=32, d_model=32, n_layer=2, n_head=2, lr=1e-2)
    early_stopping = EarlyStopping(monitor="train_loss", patience=1000, check_on_train_epoch_end=True)
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=10, save_top_k=-1)
    trainer = L.Trainer(
        strategy="swarm",
        max_steps=100_000,  # until SIGTERM
        callbacks=[Recorder(out / "events.jsonl"), SwarmMonitor(), early_stopping, checkpoints],
        logger=CSVLogger(out, name="log"),
        log_every_n_steps=1,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(model, dm)
    finally:  # SIGTERM ends fit with Lightning's SIGTERMException (a SystemExit with code 0)
        summary = dict(
            early_stopping_best=float(early_stopping.best_score),
            checkpoints=sorted(os.listdir(out / "checkpoints")),
            steps=trainer.global_step,
        )
        (out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
