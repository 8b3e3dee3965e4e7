"""Optimizers written here, which the product cannot know, each reading a different part of what it updates.

Their users would write them just so: ``torch.optim.Optimizer`` subclasses with a ``step`` of their own. They test that
what the engine learns about an optimizer comes from asking it (``engine/optimizers/scope.py``), not from a list.
"""

from __future__ import annotations

import torch
from torch import nn

# Newton-Schulz's quintic coefficients, as Muon's authors and torch.optim.Muon use them.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


class MuonFP32(torch.optim.Optimizer):
    """Muon (momentum, then each matrix's update orthogonalised by five Newton-Schulz iterations) in fp32 throughout,
    so a parity test sees the layout and not bf16's rounding (``torch.optim.Muon`` orthogonalises in bf16)."""

    def __init__(self, params: object, lr: float = 0.02, momentum: float = 0.95) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        a, b, c = NS_COEFFICIENTS
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                momentum.mul_(group["momentum"]).add_(p.grad)
                x = p.grad.add(momentum, alpha=group["momentum"])
                x = x / x.norm().clamp_min(1e-7)
                tall = x.shape[0] > x.shape[1]
                if tall:
                    x = x.T
                for _ in range(5):
                    gram = x @ x.T
                    x = a * x + (b * gram + c * gram @ gram) @ x
                if tall:
                    x = x.T
                p.add_(x, alpha=-group["lr"] * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)


class SignSGD(torch.optim.Optimizer):
    """Element-wise: each element moves by the sign of its own gradient."""

    def __init__(self, params: object, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class NormalizedSGD(torch.optim.Optimizer):
    """Reads the whole tensor: every step has the length ``lr`` in each tensor."""

    def __init__(self, params: object, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=-group["lr"])


class GlobalNormSGD(torch.optim.Optimizer):
    """Reads across tensors: the gradients are scaled by their norm over all parameters together."""

    def __init__(self, params: object, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / total, alpha=-group["lr"])


class LatePreconditioner(torch.optim.Optimizer):
    """Element-wise for its first steps, as a Shampoo grafted onto SGD is before preconditioning starts, but keeping
    a row statistic from the first step on: the probe must not be fooled by the early steps."""

    def __init__(self, params: object, lr: float = 0.01, start: int = 100) -> None:
        super().__init__(params, {"lr": lr, "start": start})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                rows = p.grad.reshape(p.shape[0], -1).pow(2).sum(dim=1)
                state["rows"] = state.get("rows", torch.zeros_like(rows)) + rows
                update = p.grad if state["step"] < group["start"] else p.grad / state["rows"].sqrt().view(-1, 1)
                p.add_(update, alpha=-group["lr"])


def hidden_matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The blocks' 2-D weights (Muon's) and everything else (AdamW's): the recipe of Muon's authors."""
    hidden, rest = [], []
    for name, param in model.named_parameters():
        (hidden if param.ndim == 2 and name.startswith("blocks.") else rest).append(param)
    return hidden, rest
