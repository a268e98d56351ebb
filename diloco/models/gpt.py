"""A small GPT (nanoGPT-like) for tests and demos, and ``build_model``, which builds the model
``model.*`` names (``ModelConfig``, ``config.py``).

The GPT: pre-norm transformer blocks, learned positions, and an output head tied to the token
embedding. The defaults are the "baby" model, about 0.8M parameters, small enough to train on a
laptop CPU while still showing a real loss curve. ``model.kind=hf`` builds a Hugging Face causal
LM instead (``diloco/models/hf.py``). Either way the vocabulary is the data's: 256 byte-level
tokens, or the tokenizer's (``Corpus.vocab_size``).

Usage::

    from diloco.models.config import ModelConfig
    from diloco.models.gpt import build_model

    model = build_model(ModelConfig(n_layer=2), vocab_size=corpus.vocab_size)
    logits, loss = model(x, targets=y)  # x, y: int64 [batch, time]
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from diloco.data.source import BYTE_VOCAB_SIZE
from diloco.models.config import MODEL_KINDS, ModelConfig
from diloco.models.hf import build_hf_model, validate_hf_model_config

logger = logging.getLogger(__name__)


def validate_model_config(cfg: ModelConfig) -> None:
    """Raise ``ValueError`` naming the offending ``model.*`` setting and what to change."""
    if cfg.kind not in MODEL_KINDS:
        raise ValueError(f"model.kind={cfg.kind!r} is not one of {', '.join(MODEL_KINDS)}")
    if cfg.kind == "hf":
        if cfg.block_size <= 0:
            raise ValueError(f"model.block_size must be a positive integer, got {cfg.block_size}")
        validate_hf_model_config(cfg)
        return
    if cfg.hf_config or cfg.hf_weights:
        raise ValueError("model.hf_config and model.hf_weights apply to model.kind=hf only")
    for name in ("n_layer", "n_head", "n_embd", "block_size"):
        value = getattr(cfg, name)
        if value <= 0:
            raise ValueError(f"model.{name} must be a positive integer, got {value}")
    if cfg.n_embd % cfg.n_head != 0:
        raise ValueError(
            f"model.n_embd ({cfg.n_embd}) must be divisible by model.n_head ({cfg.n_head}); "
            f"change one of them, e.g. model.n_head=4 with model.n_embd=128"
        )
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"model.dropout must be in [0, 1), got {cfg.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)  # residual projection
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # [B, T, C] -> [B, n_head, T, head_dim]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)  # residual projection
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int = BYTE_VOCAB_SIZE) -> None:
        super().__init__()
        validate_model_config(cfg)
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)  # token embedding
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # learned position embedding
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        # Weight tying: one tensor serves as input embedding and output projection.
        self.lm_head.weight = self.wte.weight

        self.apply(self._init_weights)
        # GPT-2: scale residual projections so the residual stream's variance does not grow
        # with depth (each block adds two of them).
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=resid_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of trainable values; the tied embedding / head tensor is counted once."""
        # Module.parameters() already yields a shared Parameter only once.
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``, ``targets``: int64 [B, T] with T <= block_size.

        Returns logits [B, T, vocab_size] and the mean cross-entropy (None without targets).
        """
        seq_len = idx.shape[1]
        if seq_len > self.cfg.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds model.block_size ({self.cfg.block_size})")
        pos = torch.arange(seq_len, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(cfg: ModelConfig, vocab_size: int = BYTE_VOCAB_SIZE) -> nn.Module:
    """Validate ``cfg`` and build a freshly initialised :class:`GPT`, or the ``model.kind=hf`` model;
    ``vocab_size`` is the data's (``Corpus.vocab_size``)."""
    if cfg.kind == "hf":
        validate_model_config(cfg)
        return build_hf_model(cfg, vocab_size=vocab_size)
    model = GPT(cfg, vocab_size)
    logger.info(
        "model: %d layers, %d heads, width %d, context %d, vocabulary %d -> %.2fM parameters",
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.block_size,
        vocab_size,
        model.num_parameters() / 1e6,
    )
    return model
