"""A small character-level GPT trained on the Python standard library's own source.

nanoGPT-style: a corpus, a datamodule, a transformer block and a LightningModule.
The transformer blocks live in one ``nn.Sequential`` (``GPT.blocks``), the part a
pipeline strategy cuts into stages.
"""

import argparse
import atexit
import dataclasses
import importlib.util
import json
import os
import resource
import threading
import time
from typing import Optional

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_swarm  # noqa: F401  (registers strategy="swarm")
from lightning_swarm import RouterStats, SwarmStrategy
from lightning_swarm.callbacks import SwarmCallback


class StdlibCorpus:
    """Concatenated source of pure-Python stdlib modules (~580 KB); no download needed."""

    MODULES: tuple[str, ...] = (
        "textwrap",
        "string",
        "difflib",
        "argparse",
        "calendar",
        "json.decoder",
        "json.encoder",
        "configparser",
        "fractions",
        "heapq",
        "bisect",
        "shlex",
        "csv",
        "pprint",
        "functools",
        "statistics",
        "random",
        "cmd",
        "queue",
    )

    def __init__(self) -> None:
        parts = []
        for name in self.MODULES:
            with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
                parts.append(f.read())
        self.text: str = "\n".join(parts)
        self.chars: list[str] = sorted(set(self.text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor(self.encode(self.text), dtype=torch.long)
        n = int(0.9 * len(data))
        self.train_data: torch.Tensor = data[:n]
        self.val_data: torch.Tensor = data[n:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class RandomBlocks(Dataset):
    """``num_samples`` (x, y) windows at random offsets; item i depends only on (seed, i)."""

    def __init__(self, data: torch.Tensor, block_size: int, num_samples: int, seed: int) -> None:
        self.data = data
        self.block_size = block_size
        g = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(len(data) - block_size, (num_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = int(self.offsets[i])
        chunk = self.data[o : o + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(L.LightningDataModule):
    """Random character windows from ``StdlibCorpus``, identical in every process with the same seed."""

    def __init__(self, block_size: int = 64, batch_size: int = 16, num_batches: int = 10_000, seed: int = 0) -> None:
        super().__init__()
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.seed = seed
        self.corpus = StdlibCorpus()

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size

    def train_dataloader(self) -> DataLoader:
        ds = RandomBlocks(self.corpus.train_data, self.block_size, self.num_batches * self.batch_size, self.seed)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        num_samples = max(1, self.num_batches // 10) * self.batch_size
        ds = RandomBlocks(self.corpus.val_data, self.block_size, num_samples, self.seed)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, num_workers=0)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then MLP, each with a residual."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(L.LightningModule):
    """Character-level GPT; ``self.blocks`` is the ``nn.Sequential`` pipeline of transformer blocks."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        d_model: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        x = self.blocks(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class History(SwarmCallback):
    """Records the training loss, timing and swarm events of this peer, and writes them to ``path`` as JSON."""

    def __init__(self, path: Optional[str] = None, save: Optional[str] = None, every: int = 5) -> None:
        self.path, self.save, self.every = path, save, every
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.times: list[float] = []  # when each step ended, to measure steady-state throughput
        self.call_seconds: list[dict] = []  # after each step: seconds spent so far in calls to each stage
        self.stage_changes: list[dict] = []  # rebalancing moves this peer made or saw
        self.samples, self.start = 0, time.time()

    def on_swarm_stage_changed(self, trainer, pl_module, event) -> None:
        self.stage_changes.append(dataclasses.asdict(event))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.times.append(time.time())
        self.call_seconds.append(router_stats(trainer.strategy).seconds)
        self.samples += len(batch[0])
        if self.path and len(self.losses) % self.every == 0:
            self.write(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))
            if self.path:
                self.write(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.path:
            self.write(trainer)
        if self.save:  # while the swarm is still up: the checkpoint gathers every stage from it
            trainer.save_checkpoint(self.save)

    def write(self, trainer: L.Trainer) -> None:
        strategy = trainer.strategy
        stats = router_stats(strategy)
        metrics = strategy.swarm_metrics() if isinstance(strategy, SwarmStrategy) else {}
        summary = dict(
            steps=len(self.losses),
            samples=self.samples,
            seconds=time.time() - self.start,
            losses=self.losses,
            val_losses=self.val_losses,
            times=self.times,
            stage=getattr(strategy, "served_stage", None),
            failovers=stats.failovers,
            calls_per_peer=stats.chosen,
            failed_calls_per_peer=stats.failed,
            bytes_sent=stats.bytes_sent,
            direct_calls=stats.direct_calls,
            p2p_calls=stats.p2p_calls,
            call_seconds=self.call_seconds,
            recomputed=stats.recomputed,
            chained=stats.chained,
            chain_breaks=stats.chain_breaks,
            trailing=stats.trailing,
            stage_changes=self.stage_changes,
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            # gradient all-reduce rounds, those that failed (this peer stepped alone), and the time they held it up
            rounds=int(metrics.get("rounds", 0)),
            failed_rounds=int(metrics.get("failed_rounds", 0)),
            failed_round_seconds=metrics.get("failed_round_seconds", 0.0),
        )
        with open(self.path + ".tmp", "w") as f:
            json.dump(summary, f)
        os.replace(self.path + ".tmp", self.path)


def router_stats(strategy: object) -> RouterStats:
    """The swarm strategy's counters of calls to the stages (plain strategies make none)."""
    return strategy.router_stats if isinstance(strategy, SwarmStrategy) else RouterStats()


def report_cuda_memory(directory: str, role: str, every: float = 1.0) -> None:
    """Keep ``<directory>/<pid>.json`` up to date with this process's peak CUDA memory (torch's
    ``max_memory_allocated`` and ``max_memory_reserved``, bytes; null without CUDA), rewritten every ``every``
    seconds and at exit, so that a benchmark reads it even from a peer it had to kill."""
    pid, stage = os.getpid(), os.environ.get("SWARM_STAGE")
    path = os.path.join(directory, f"{pid}.json")

    def write() -> None:
        if os.getpid() != pid:  # a forked helper (DHT, averager) exiting
            return
        cuda = torch.cuda.is_available()  # the peaks read 0 until this process first uses CUDA, without starting it
        figures = dict(
            pid=pid,
            role=role,
            stage=int(stage) if stage else None,
            allocated=torch.cuda.max_memory_allocated() if cuda else None,
            reserved=torch.cuda.max_memory_reserved() if cuda else None,
        )
        with open(path + ".tmp", "w") as f:
            json.dump(figures, f)
        os.replace(path + ".tmp", path)

    def keep_writing() -> None:
        while True:
            write()
            time.sleep(every)

    threading.Thread(target=keep_writing, name="cuda-memory", daemon=True).start()
    atexit.register(write)


def main() -> None:
    """Train the GPT on the swarm. Every peer runs this same script; the swarm is configured by SWARM_* variables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation: the same on every peer")
    parser.add_argument("--data-seed", type=int, default=0, help="order of this peer's batches")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: never)")
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--single", action="store_true", help="plain single-process training, for comparison")
    parser.add_argument(
        "--accumulate", type=int, default=1, help="with --single: batches per optimizer step (in a swarm: its target)"
    )
    parser.add_argument("--precision", default="32-true", help="the Trainer's precision, e.g. bf16-mixed")
    parser.add_argument("--history", help="write this peer's loss history here (JSON)")
    parser.add_argument("--save", help="save the complete model here at the end (a normal Lightning checkpoint)")
    parser.add_argument("--resume", help="continue training from this checkpoint (trainer.fit(ckpt_path=...))")
    args = parser.parse_args()
    if directory := os.environ.get("GPT_CUDA_MEMORY_DIR"):  # set by benchmarks/gpu.py
        report_cuda_memory(directory, "single" if args.single else os.environ.get("SWARM_ROLE", "both"))

    torch.set_num_threads(1)
    L.seed_everything(args.seed)
    dm = CharDataModule(block_size=args.block_size, batch_size=args.batch_size, seed=args.data_seed)
    model = GPT(dm.vocab_size, args.block_size, args.d_model, args.n_layer, args.n_head, lr=args.lr)
    history = History(args.history, args.save)
    trainer = L.Trainer(
        strategy="auto" if args.single else "swarm",
        accelerator="auto",
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate if args.single else 1,
        callbacks=[history],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        val_check_interval=args.val_every or None,
        limit_val_batches=args.val_batches if args.val_every else 0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
    )
    trainer.fit(model, dm, ckpt_path=args.resume)
    if args.val_every:
        trainer.validate(model, dm)  # after fit, the same Trainer rejoins the swarm to evaluate


if __name__ == "__main__":
    main()
