"""Gradient clipping over shards: the norm of the whole, unsharded gradient, computed from local pieces."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.runtime.registry import fsdp_param_of


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by the norm of the whole model's gradient and return that norm, on every rank.

    Each shard group contributes the sum of its shards' p-th powers (the max, for the inf norm) once, summed
    over the group's ranks; replicated (unsharded) parameters contribute locally. Every gradient is then scaled by
    the same factor, which is what ``torch.nn.utils.clip_grad_norm_`` does on the unsharded model. Must be called on
    every rank with the same parameters.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    sharded: dict[int, tuple[ProcessGroup, list[torch.Tensor]]] = {}
    local: list[torch.Tensor] = []
    for param in params:
        fsdp_param = fsdp_param_of(param)
        if fsdp_param is None or fsdp_param.layout.world_size == 1:
            if param.grad is not None:
                local.append(param.grad)
            continue
        group = fsdp_param.group
        entry = sharded.setdefault(id(group), (group, []))
        if param.grad is not None:
            entry[1].append(param.grad)
    device = params[0].device if params else torch.device("cpu")
    total = _local_norm_power(local, norm_type, device)
    for group, grads in sharded.values():
        piece = _local_norm_power(grads, norm_type, device)
        dist.all_reduce(piece, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM, group=group)
        total = torch.maximum(total, piece) if norm_type == float("inf") else total + piece
    total_norm = total if norm_type == float("inf") else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total_norm.item()}); "
            "lower the learning rate or use error_if_nonfinite=False to skip the check."
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm


def _local_norm_power(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The local pieces' norm raised to the p-th power (the plain max for the inf norm), in fp32."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norm = torch.nn.utils.get_total_norm(grads, norm_type).float().to(device)
    return norm if norm_type == float("inf") else norm**norm_type


def clip_grad_value_(parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``; element-wise, so the shards clip alone."""
    torch.nn.utils.clip_grad_value_(parameters, clip_value)
