"""transformers' LlamaForCausalLM, from a small config, trained on a swarm on the Python standard library's own source.

The model stays as transformers builds it: the strategy finds its decoder layers (``model.model.layers``, an
``nn.ModuleList``) and serves them on the swarm's stages, where transformers' own loop calls them with its side
inputs (rotary cos and sin, position ids, ``use_cache=False``). Every peer runs this same script; ``SWARM_*``
variables configure the swarm (README.md), 2 stages by default:

    python examples/hf_llama.py --single                # plain training in one process, for comparison
    SWARM_STAGE=0 python examples/hf_llama.py           # starts a swarm and logs the address others join with
    SWARM_STAGE=1 SWARM_INITIAL_PEERS=/ip4/... python examples/hf_llama.py --data-seed 1   # joins: training starts
    SWARM_NUM_STAGES=1 python examples/hf_llama.py      # one peer serving every layer

Across machines, add ``SWARM_HOST_MADDRS=/ip4/0.0.0.0/tcp/31337`` (docs/multi_machine.md).
"""

import argparse

import lightning as L
import torch
from gpt import CharDataModule
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_swarm  # noqa: F401  (registers strategy="swarm")


class LlamaModule(L.LightningModule):
    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 4, hidden: int = 128, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=n_layer,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped-query attention
            max_position_embeddings=block_size,
            use_cache=False,  # no KV cache in training: the layers live on other peers
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch  # the targets are x moved by one: transformers shifts the labels itself
        loss = self.model(input_ids=x, labels=x).loss
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
    model = LlamaModule(dm.vocab_size, args.block_size)
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
