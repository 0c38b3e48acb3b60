"""LitGPT's GPT, from a small LLaMA-style config, trained on a swarm on the Python standard library's own source.

The model stays as LitGPT builds it: the strategy finds its blocks (``model.transformer.h``, an ``nn.ModuleList``)
and serves them on the swarm's stages, where LitGPT's own loop calls them with its rotary tables (cos, sin). Every
peer runs this same script; ``SWARM_*`` variables configure the swarm (README.md), 2 stages by default:

    python examples/litgpt_swarm.py --single                # plain training in one process, for comparison
    SWARM_STAGE=0 python examples/litgpt_swarm.py           # starts a swarm and logs the address others join with
    SWARM_STAGE=1 SWARM_INITIAL_PEERS=/ip4/... python examples/litgpt_swarm.py --data-seed 1   # joins: training starts
    SWARM_NUM_STAGES=1 python examples/litgpt_swarm.py      # one peer serving every block

Across machines, add ``SWARM_HOST_MADDRS=/ip4/0.0.0.0/tcp/31337`` (docs/multi_machine.md).
"""

import argparse

import lightning as L
import litgpt
import torch
import torch.nn.functional as F
from gpt import CharDataModule

import lightning_swarm  # noqa: F401  (registers strategy="swarm")


class LitGPTModule(L.LightningModule):
    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 4, n_embd: int = 128, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        config = litgpt.Config(
            block_size=block_size,
            vocab_size=vocab_size,
            padded_vocab_size=vocab_size,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=4,
            n_query_groups=2,  # grouped-query attention
            rotary_percentage=1.0,
            parallel_residual=False,
            bias=False,
            norm_class_name="RMSNorm",
            mlp_class_name="LLaMAMLP",
            intermediate_size=4 * n_embd,
        )
        self.model = litgpt.GPT(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--data-seed", type=int, default=0, help="order of this peer's batches: one per peer")
    parser.add_argument("--single", action="store_true", help="plain single-process training, for comparison")
    args = parser.parse_args()

    L.seed_everything(0)  # every peer starts from the same model
    dm = CharDataModule(block_size=args.block_size, batch_size=args.batch_size, seed=args.data_seed)
    model = LitGPTModule(dm.vocab_size, args.block_size)
    trainer = L.Trainer(
        strategy="auto" if args.single else "swarm",
        max_steps=args.max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, dm)


if __name__ == "__main__":
    main()
