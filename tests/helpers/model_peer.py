"""A peer that trains one of the real models of ``real_models.py`` (litgpt, HF Llama, GPT-2, Qwen2, a torchtitan-shaped
model) on the swarm, or alone with ``--single``: examples/gpt.py's ``main()`` for models left as their users wrote them.

    python tests/helpers/model_peer.py --model llama --single --max-steps 6 --history plain.json
    SWARM_NUM_STAGES=2 SWARM_STAGE=0 python tests/helpers/model_peer.py --model llama   # configured by SWARM_*

Tests import ``SCRIPT``, for a LocalSwarm of these peers and for ``helpers.plain_training``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpt import History, router_stats  # noqa: E402

import lightning_swarm  # noqa: E402, F401  (registers strategy="swarm")
from helpers.real_models import MODELS, TokenData, build  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


class TokenHistory(History):
    """examples/gpt.py's History for batches that are one ``(B, T)`` tensor of tokens rather than ``(x, y)``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, (batch,), batch_idx)

    def write(self, trainer: L.Trainer) -> None:
        """History's summary, and what crossed the wire besides activations: the blocks' side inputs."""
        super().write(trainer)
        stats = router_stats(trainer.strategy)
        with open(self.path) as f:
            summary = json.load(f)
        summary.update(
            side_bytes_sent=getattr(stats, "side_bytes_sent", None),
            raw_bytes_sent=stats.raw_bytes_sent,
            samples_sent=getattr(stats, "samples_sent", None),
        )
        with open(self.path + ".tmp", "w") as f:
            json.dump(summary, f)
        os.replace(self.path + ".tmp", self.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation: the same on every peer")
    parser.add_argument("--data-seed", type=int, default=0, help="order of this peer's batches")
    parser.add_argument("--vary-seq", action="store_true", help="sequence lengths cycle through 16, 24, 32")
    parser.add_argument("--single", action="store_true", help="plain single-process training, for comparison")
    parser.add_argument("--history", help="write this peer's loss history here (JSON)")
    parser.add_argument("--save", help="save the complete model here at the end (a normal Lightning checkpoint)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(args.seed)
    model = build(args.model, args.seed, lr=args.lr)
    data = TokenData(vary_seq=args.vary_seq, seed=args.data_seed)
    trainer = L.Trainer(
        strategy="auto" if args.single else "swarm",
        accelerator="auto",
        max_steps=args.max_steps,
        callbacks=[TokenHistory(args.history, args.save)],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
