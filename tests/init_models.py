"""Models whose ``__init__`` initialises the way real code does, for the meta-build tests: LitGPT's ``LoRALinear``
(a child created before the parent's own parameters, which the parent initialises last), a nanoGPT-style model that
initialises in one ``self.apply(self._init_weights)`` sweep (head tied to the embedding, residual projections
re-drawn by name, a ``trunc_normal_`` position table) and a rotary embedding whose non-persistent ``inv_freq`` only
``__init__`` computes."""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    """LitGPT 0.5's ``lora.LoRALinear``, reduced to its construction."""

    def __init__(self, in_features: int, out_features: int, r: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.lora_A = nn.Parameter(torch.empty((r, in_features)))
        self.lora_B = nn.Parameter(torch.empty((out_features, r)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if hasattr(self, "lora_A"):
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.normal_(self.lora_B)  # LitGPT zeroes it; a random draw makes the order visible

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + x @ self.lora_A.t() @ self.lora_B.t()


class LoRAStack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Rotary(nn.Module):
    """Llama's rotary embedding: ``inv_freq`` computed in ``__init__`` only, non-persistent; no reset_parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)


class NanoBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.rotary = Rotary(width // 2)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_c_proj = nn.Linear(4 * width, width)


class NanoGPT(nn.Module):
    """nanoGPT's construction: modules first, the tie, then one init sweep and a by-name re-draw."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 4, block_size: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Parameter(torch.zeros(1, block_size, width))
        self.blocks = nn.ModuleList(NanoBlock(width) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * depth))
        nn.init.trunc_normal_(self.wpe, std=0.02)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
