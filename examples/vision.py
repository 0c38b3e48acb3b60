"""A small convolutional image classifier trained on a swarm: which shape is in the picture?

nanoGPT-style, like gpt.py, but a different kind of model and data: 32x32 grey images of a circle, square, triangle
or cross at a random place, size and brightness over noise, drawn procedurally (no download; image i depends only
on (seed, i)). The residual conv blocks live in one ``nn.Sequential`` (``ShapeNet.blocks``), the pipeline the
strategy cuts into stages; the stem and the classifier head stay on the trainer.

    python examples/vision.py --single                    # plain training, for comparison
    SWARM_NUM_STAGES=2 SWARM_STAGE=0 python examples/vision.py          # then, with the address it logs:
    SWARM_NUM_STAGES=2 SWARM_STAGE=1 SWARM_INITIAL_PEERS=/ip4/... python examples/vision.py
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_swarm  # noqa: F401  (registers strategy="swarm")
from lightning_swarm.callbacks import SwarmMonitor

SHAPES = ("circle", "square", "triangle", "cross")


def draw(shape: int, size: int, g: torch.Generator) -> torch.Tensor:
    """One (1, size, size) image of ``SHAPES[shape]`` over noise, at a random centre, radius and brightness."""
    r = size * (0.15 + 0.2 * torch.rand((), generator=g))
    cx, cy = (r + (size - 2 * r) * torch.rand(2, generator=g)).tolist()
    y, x = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    dx, dy = x - cx, y - cy
    if SHAPES[shape] == "circle":
        mask = dx**2 + dy**2 <= r**2
    elif SHAPES[shape] == "square":
        mask = (dx.abs() <= 0.8 * r) & (dy.abs() <= 0.8 * r)
    elif SHAPES[shape] == "triangle":  # pointing up: narrow at the top, wide at the bottom
        mask = (dy.abs() <= r) & (dx.abs() <= (dy + r) / 2)
    else:
        mask = ((dx.abs() <= r / 4) & (dy.abs() <= r)) | ((dy.abs() <= r / 4) & (dx.abs() <= r))
    brightness = 0.6 + 0.4 * torch.rand((), generator=g)
    noise = 0.2 * torch.randn(size, size, generator=g)
    return (mask.float() * brightness + noise).unsqueeze(0)


class Shapes(Dataset):
    """``num_samples`` labelled images; item i depends only on (seed, i)."""

    def __init__(self, num_samples: int, size: int = 32, seed: int = 0) -> None:
        self.num_samples, self.size, self.seed = num_samples, size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(len(SHAPES), (), generator=g))
        return draw(label, self.size, g), label


class ShapesDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 32, num_batches: int = 10_000, size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_batches, self.size, self.seed = batch_size, num_batches, size, seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Shapes(self.num_batches * self.batch_size, self.size, self.seed), self.batch_size)

    def val_dataloader(self) -> DataLoader:  # another seed: images no peer trains on
        return DataLoader(Shapes(8 * self.batch_size, self.size, 10_000 + self.seed), self.batch_size)


class ResBlock(nn.Module):
    """conv-norm-relu-conv-norm with a residual: the same shape in and out, so blocks can be cut anywhere."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(8, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(8, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


class ShapeNet(L.LightningModule):
    """Stem (stride 2) -> ``blocks`` (the pipeline) -> global max pool (where is the shape?) -> linear head."""

    def __init__(self, channels: int = 32, n_blocks: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, stride=2, padding=1), nn.GroupNorm(8, channels), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(channels) for _ in range(n_blocks)])
        self.head = nn.Linear(channels, len(SHAPES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(images))
        return self.head(x.amax(dim=(2, 3)))

    def step(self, batch: tuple[torch.Tensor, torch.Tensor], name: str) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.log(f"{name}_loss", loss, prog_bar=True)
        self.log(f"{name}_acc", (logits.argmax(-1) == labels).float().mean(), prog_bar=True)
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self.step(batch, "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    """Every peer runs this same script; the swarm is configured by SWARM_* environment variables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--n-blocks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation: the same on every peer")
    parser.add_argument("--data-seed", type=int, default=0, help="which images this peer trains on")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: never)")
    parser.add_argument("--log-dir", help="write metrics.csv (CSVLogger, with the swarm's state) under this directory")
    parser.add_argument("--single", action="store_true", help="plain single-process training, for comparison")
    args = parser.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(args.seed)
    dm = ShapesDataModule(batch_size=args.batch_size, seed=args.data_seed)
    model = ShapeNet(args.channels, args.n_blocks, args.lr)
    trainer = L.Trainer(
        strategy="auto" if args.single else "swarm",
        accelerator="auto",
        max_steps=args.max_steps,
        logger=CSVLogger(args.log_dir, name="vision") if args.log_dir else False,
        callbacks=[SwarmMonitor()] if args.log_dir and not args.single else [],  # lightning-swarm plot draws these
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        val_check_interval=args.val_every or None,
        limit_val_batches=4 if args.val_every else 0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
    )
    trainer.fit(model, dm)


if __name__ == "__main__":
    main()
