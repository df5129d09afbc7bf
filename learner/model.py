"""A small GPT for byte-level language modelling: the model every learner trains by default.

A decoder-only transformer in the manner of nanoGPT: token + learned position embeddings,
pre-norm blocks of causal self-attention and an MLP, a final LayerNorm, and an output head that
reuses the token embedding matrix (one parameter, so a fragment holds it exactly once).

    from ddiloco.learner.model import build_model
    torch.manual_seed(0)                       # same seed -> same initial model on every learner
    model = build_model("tiny")                # or "small", "base", "gpt2"
    logits, loss = model(x, y)                 # x, y: LongTensor[B, T], T <= block_size

Parameter names are stable and flat (``wte.weight``, ``wpe.weight``, ``blocks.0.attn.qkv.weight``,
...); ``is_embedding_param`` tells the embedding ones apart, since the synchronizer merges those by
plain averaging (the paper). Tests: ``pytest tests/unit/test_model_data.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn

EMBEDDING_MODULES: Final = frozenset({"wte", "wpe"})
"""Names of the embedding modules: ``wte`` (tokens, tied to the output head) and ``wpe``."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT. Every learner of a job must use the same one."""

    vocab_size: int = 256
    """Number of token ids. 256 for byte-level tokens (the default corpus and text files)."""
    block_size: int
    """Context length T in tokens: the longest sequence ``GPT.forward`` accepts."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Width of the residual stream (model dimension)."""
    dropout: float = 0.0
    """Dropout probability in [0, 1) on attention weights and residual branches while training."""
    bias: bool = False
    """Whether Linear and LayerNorm layers carry a bias (nanoGPT: False is slightly better)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by "
                f"GPTConfig.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


PRESETS: Final[dict[str, GPTConfig]] = {
    # Debug size: ~100 inner steps of batch 8 x 64 tokens take a few seconds on one CPU core.
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),
    # Still CPU-friendly, learns visibly more per step.
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    # nanoGPT's "baby GPT" shape (shakespeare-char): a GPU or a patient CPU.
    "base": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    # GPT-2 small's shape (124M with its 50k vocab; ~85M with bytes): GPUs only.
    "gpt2": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def is_embedding_param(name: str) -> bool:
    """True for the token and position embedding parameters of ``GPT`` (``wte.*``, ``wpe.*``).

    Accepts prefixed names too (``module.wte.weight`` from a wrapper such as DDP).
    """
    return any(part in EMBEDDING_MODULES for part in name.split(".")[:-1])


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> three (B, n_head, T, head_dim) tensors
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over ``config.vocab_size`` tokens.

    State: the parameters only. The output head is ``wte.weight`` itself (weight tying), so
    ``named_parameters()`` and ``state_dict()`` both list it once, under ``wte.weight``.
    Initialisation draws from torch's global generator: seed it for identical models.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.apply(self._init_weights)
        # GPT-2: scale the init of the projections that write into the residual stream, so its
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, the tied head counted once; optionally without embeddings."""
        return sum(
            p.numel()
            for name, p in self.named_parameters()
            if not (exclude_embeddings and is_embedding_param(name))
        )

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, T, vocab_size]`` for ``idx [B, T]``; with ``targets`` also the mean
        cross-entropy over all B*T positions (computed in float32, also under autocast)."""
        B, T = idx.shape
        if idx.size(1) > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds GPTConfig.block_size {self.config.block_size}"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)  # tied output head
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss


def build_model(preset: str) -> GPT:
    """A fresh ``GPT`` of the named preset (seed torch first for a reproducible init)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; allowed: {', '.join(PRESETS)}")
    return GPT(PRESETS[preset])
