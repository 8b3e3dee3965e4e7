"""A small GPT (pre-LN blocks, head tied to the embedding unless asked otherwise): every example and test uses it.

It is deliberately the shape that stresses a sharding engine: the token embedding is shared with the output
head (a parameter used by two modules) and every block is a natural sharding unit. All initialisation lives in
each module's own ``reset_parameters`` (``GPTLinear`` and ``GPTEmbedding`` carry GPT-2's normal(0, 0.02), the
residual projections scaled down by depth), so a model built on the meta device and materialised module by
module, in module order, gets exactly the values an eager build from the same seed gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    # The head shares the embedding's weight (GPT-2). Untied, the root holds two vocabulary-sized tensors, as most
    # LLMs do (Llama, Mistral): the benchmarks' default.
    tie_weights: bool = True


INIT_STD = 0.02


class GPTLinear(nn.Linear):
    """A linear layer initialised as GPT-2 does: normal(0, std) weights, zero bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float = INIT_STD) -> None:
        self.std = std  # set before nn.Linear.__init__, which calls reset_parameters
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class GPTEmbedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


def residual_std(config: GPTConfig) -> float:
    """GPT-2 scales the projections that write into the residual stream down by the depth."""
    return INIT_STD / math.sqrt(2 * config.n_layer)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = GPTLinear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = GPTLinear(config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embd = x.shape
        q, k, v = self.qkv(x).split(embd, dim=2)
        # (batch, seq, embd) -> (batch, head, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, embd // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq, embd)
        return F.dropout(self.proj(y), p=dropout)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = GPTLinear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = GPTLinear(4 * config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LN transformer block: the natural unit of sharding."""

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
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = GPTEmbedding(config.vocab_size, config.n_embd)
        self.wpe = GPTEmbedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.tie_weights:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight  # weight tying: one parameter, two modules
        else:
            self.lm_head = GPTLinear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab), or the mean cross-entropy loss when ``targets`` is given."""
        seq = idx.size(1)
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds the model's block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
