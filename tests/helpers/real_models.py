"""LightningModules around real language models, written as their users write them, for the swarm tests.

Nothing here is reshaped for the swarm: the blocks stay where each library keeps them (an ``nn.ModuleList`` or an
``nn.ModuleDict`` some levels down) and are called in the library's own Python loop with its side inputs (rotary
tables, masks, position ids, keyword flags). Every model is tiny (4 layers, width 64, 4 heads, vocabulary 96,
sequences of at most 32 tokens), built from a config on the CPU, without dropout, downloading nothing.

    build(name, seed)            # one of MODELS, initialised from ``seed``
    TokenData(seed=..., vary_seq=True)   # batches of 8 token sequences; lengths 16, 24, 32, 16, ... with vary_seq

The data is a random "language" every seed shares: each token is followed by one of two successors picked for it
once (``SUCCESSORS``), so that the loss falls clearly within a few dozen steps (from ~4.6 towards ln 2).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ_LEN, BATCH_SIZE, LR = 96, 32, 8, 3e-3
N_LAYER, N_EMBD, N_HEAD, N_KV_HEAD, INTERMEDIATE = 4, 64, 4, 2, 128
SUCCESSORS = torch.randint(VOCAB, (VOCAB, 2), generator=torch.Generator().manual_seed(1234))

# where each model keeps its blocks, as SWARM_PIPELINE names them
PIPELINES = {
    "litgpt": "model.transformer.h",
    "llama": "model.model.layers",
    "gpt2": "model.transformer.h",
    "qwen2": "model.model.layers",
    "titan": "model.layers",
}


# ---- data ------------------------------------------------------------------------------------------------------------


class MarkovTokens(Dataset):
    """``num_samples`` token sequences; sequence i depends only on (seed, i). With ``lengths``, the sequences of
    batch k (items ``k * batch_size`` on, read in order) all have length ``lengths[k % len(lengths)]``."""

    def __init__(self, num_samples: int, seq_len: int, seed: int, lengths: tuple[int, ...] = (), batch_size: int = 1):
        self.num_samples, self.seq_len, self.seed = num_samples, seq_len, seed
        self.lengths, self.batch_size = lengths, batch_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        length = self.lengths[(i // self.batch_size) % len(self.lengths)] if self.lengths else self.seq_len
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        token = int(torch.randint(VOCAB, (), generator=g))
        choices = torch.randint(2, (length - 1,), generator=g).tolist()
        tokens = [token]
        for c in choices:
            tokens.append(int(SUCCESSORS[tokens[-1], c]))
        return torch.tensor(tokens)


class TokenData(L.LightningDataModule):
    """Batches of ``batch_size`` token sequences (one ``(B, T)`` tensor each); with ``vary_seq``, T cycles through
    ``seq_len`` / 2, 3 / 4 and 1 of it (16, 24, 32) from one batch to the next."""

    def __init__(
        self,
        seq_len: int = SEQ_LEN,
        batch_size: int = BATCH_SIZE,
        vary_seq: bool = False,
        num_batches: int = 10_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.vary_seq = seq_len, batch_size, vary_seq
        self.num_batches, self.seed = num_batches, seed

    def train_dataloader(self) -> DataLoader:
        lengths = (self.seq_len // 2, 3 * self.seq_len // 4, self.seq_len) if self.vary_seq else ()
        ds = MarkovTokens(self.num_batches * self.batch_size, self.seq_len, self.seed, lengths, self.batch_size)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, num_workers=0)


# ---- the LightningModules --------------------------------------------------------------------------------------------


class CausalLM(L.LightningModule):
    """What the modules share: ``self.model``, a loss per batch of tokens, AdamW."""

    def __init__(self, lr: float = LR) -> None:
        super().__init__()
        self.save_hyperparameters()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class LitGPTModule(CausalLM):
    """``litgpt.GPT`` from a LLaMA-style config: RMSNorm, full rotary, grouped-query attention, LLaMAMLP, no bias."""

    def __init__(self, lr: float = LR) -> None:
        super().__init__(lr)
        import litgpt

        config = litgpt.Config(
            name="tiny-llama",
            block_size=SEQ_LEN,
            vocab_size=VOCAB,
            padded_vocab_size=VOCAB,
            n_layer=N_LAYER,
            n_embd=N_EMBD,
            n_head=N_HEAD,
            n_query_groups=N_KV_HEAD,
            rotary_percentage=1.0,
            parallel_residual=False,
            bias=False,
            norm_class_name="RMSNorm",
            mlp_class_name="LLaMAMLP",
            intermediate_size=INTERMEDIATE,
        )
        self.model = litgpt.GPT(config)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.model(tokens), tokens)


class LlamaModule(CausalLM):
    """``transformers.LlamaForCausalLM``, the loss from ``labels`` as HF users write it."""

    def __init__(self, lr: float = LR) -> None:
        super().__init__(lr)
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=N_EMBD,
            intermediate_size=INTERMEDIATE,
            num_hidden_layers=N_LAYER,
            num_attention_heads=N_HEAD,
            num_key_value_heads=N_KV_HEAD,
            max_position_embeddings=SEQ_LEN,
            use_cache=False,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss


class GPT2Module(CausalLM):
    """``transformers.GPT2LMHeadModel`` (the head tied to the token embedding), with the eager attention."""

    def __init__(self, lr: float = LR) -> None:
        super().__init__(lr)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ_LEN,
            n_embd=N_EMBD,
            n_layer=N_LAYER,
            n_head=N_HEAD,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            attn_implementation="eager",
        )
        self.model = GPT2LMHeadModel(config)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss


class Qwen2Module(CausalLM):
    """``transformers.Qwen2ForCausalLM`` whose first layer attends to everything before it and the other three to
    a window of 8 tokens: layers of one stage get different masks."""

    def __init__(self, lr: float = LR) -> None:
        super().__init__(lr)
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=N_EMBD,
            intermediate_size=INTERMEDIATE,
            num_hidden_layers=N_LAYER,
            num_attention_heads=N_HEAD,
            num_key_value_heads=N_KV_HEAD,
            max_position_embeddings=SEQ_LEN,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,  # layer_types: full, sliding, sliding, sliding
            use_cache=False,
            attn_implementation="sdpa",
        )
        assert set(config.layer_types) == {"full_attention", "sliding_attention"}, config.layer_types
        self.model = Qwen2ForCausalLM(config)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss


# ---- a torchtitan-shaped model: blocks in an nn.ModuleDict, called with the rotary table -----------------------------


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """The rotary table as real numbers: ``(end, head_dim // 2, 2)``, cos and sin of each position's angles."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, T, H, D)`` by the first T positions of the table."""
    freqs = freqs_cis[: x.size(1)].unsqueeze(0).unsqueeze(2)  # (1, T, 1, D / 2, 2)
    cos, sin = freqs[..., 0], freqs[..., 1]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        repeats = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden_dim: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden_dim)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama layout: ``layers`` is an ``nn.ModuleDict`` keyed "0", "1", ..., each layer called with
    the whole rotary table (a buffer of the model), which it cuts to the sequence's length."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, max_seq_len: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq_len), persistent=True)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(dim, n_heads, n_kv_heads, INTERMEDIATE) for i in range(n_layers)}
        )
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class TitanModule(CausalLM):
    def __init__(self, lr: float = LR) -> None:
        super().__init__(lr)
        self.model = Transformer(VOCAB, N_EMBD, N_LAYER, N_HEAD, N_KV_HEAD, SEQ_LEN)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.model(tokens), tokens)


MODELS: dict[str, type[CausalLM]] = {
    "litgpt": LitGPTModule,
    "llama": LlamaModule,
    "gpt2": GPT2Module,
    "qwen2": Qwen2Module,
    "titan": TitanModule,
}


def build(name: str, seed: int = 0, lr: float = LR) -> CausalLM:
    """The LightningModule ``name`` (one of ``MODELS``), initialised from ``seed``: the same weights in every
    process."""
    L.seed_everything(seed, verbose=False)
    return MODELS[name](lr)
