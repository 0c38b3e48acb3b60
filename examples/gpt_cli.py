"""The GPT of examples/gpt.py, configured with LightningCLI: every Trainer and strategy argument from YAML or flags.

    python examples/gpt_cli.py fit --config examples/swarm_local.yaml
    SWARM_NUM_STAGES=2 python examples/gpt_cli.py fit --trainer.strategy=swarm --trainer.max_steps=100
    python examples/gpt_cli.py fit --config examples/swarm_local.yaml --print_config
    python examples/gpt_cli.py fit --trainer.strategy.help SwarmStrategy     # every strategy argument, documented

Needs jsonargparse: pip install "lightning_swarm[cli]".
"""

import sys
from pathlib import Path

import torch
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPT, CharDataModule  # noqa: E402

import lightning_swarm  # noqa: E402, F401  (registers strategy="swarm"; SwarmStrategy resolves by its short name)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def cli_main(args=None, run: bool = True) -> GPTCLI:
    torch.set_num_threads(1)
    return GPTCLI(
        GPT,
        CharDataModule,
        # the model must start from the same initialisation on every peer: a fixed seed, not a random one
        seed_everything_default=0,
        trainer_defaults={"strategy": "swarm", "enable_model_summary": False},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    cli_main()
