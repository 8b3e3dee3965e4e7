"""LoRA adapters (Hu et al., 2021) that keep the adapted layer's own parameter names.

``add_lora`` turns chosen ``nn.Linear`` layers into ``LoRALinear``: the base ``weight`` (and ``bias``) stay where they
were, under the same names -- so pretrained weights load into them by name -- and are frozen, while two small
matrices ``lora_a`` (rank x in) and ``lora_b`` (out x rank) train beside them inside the same sharding unit. The
output is ``base(x) + scale * x A^T B^T`` with ``scale = alpha / rank``; ``lora_b`` starts at zero, so an adapted
model starts exactly as the pretrained one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoRALinear", "add_lora"]


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        if rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {rank}.")
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **factory))
        self.scale = alpha / rank
        self.reset_lora()

    def reset_parameters(self) -> None:
        """The base layer's init and the adapters' (a model built on the meta device is initialised with this)."""
        super().reset_parameters()
        if hasattr(self, "lora_a"):  # nn.Linear.__init__ calls this before the adapters exist
            self.reset_lora()

    def reset_lora(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def add_lora(model: nn.Module, targets: Iterable[str], rank: int = 8, alpha: float = 16.0) -> list[str]:
    """Replace every ``nn.Linear`` whose name ends with one of ``targets`` (``"q_proj"``, ...) by a ``LoRALinear``,
    and freeze every other parameter of ``model``. Returns the names of the adapted layers."""
    targets = tuple(targets)
    adapted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not isinstance(module, LoRALinear) and name.endswith(targets):
            parent_name, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attribute, LoRALinear(module, rank, alpha))
            adapted.append(name)
    if not adapted:
        raise ValueError(f"no nn.Linear in the model has a name ending with one of {list(targets)}; nothing to adapt.")
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(("lora_a", "lora_b")))
    return adapted
