"""The demo GPT under each implementation (ours, torch FSDP2, DDP, the plain module), and one training step."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_fsdp.demos.gpt import GPT

from .config import BenchArgs


@dataclass
class Trainee:
    """A model under one implementation, and how to clip its gradients and run its forward."""

    model: nn.Module
    clip: Callable[[Iterable[torch.Tensor], float], Any]
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    num_params: int  # of the whole model, counted before sharding


def build(impl: str, args: BenchArgs) -> Trainee:
    """The demo GPT, identical on every rank (same seed), parallelised by ``impl``, compiled if asked."""
    trainee = _parallelised(impl, args)
    if args.compile is not None:
        trainee.model = torch.compile(trainee.model, backend=args.compile)
    return trainee


def _parallelised(impl: str, args: BenchArgs) -> Trainee:
    torch.manual_seed(args.seed)
    model = GPT(args.gpt_config())
    num_params = sum(p.numel() for p in model.parameters())
    bf16 = args.precision == "bf16"
    no_autocast = contextlib.nullcontext

    def autocast() -> contextlib.AbstractContextManager[Any]:  # DDP and the plain module: bf16 by autocast
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    if impl == "ours":
        from lightning_fsdp import clip_grad_norm_, fully_shard

        kwargs: dict[str, Any] = {
            "policy": args.wrapped(),
            "sharding_strategy": args.sharding_strategy,
            "forward_prefetch": args.forward_prefetch,
        }
        if bf16:
            if "mixed_precision" not in inspect.signature(fully_shard).parameters:
                raise RuntimeError("ours: fully_shard takes no mixed_precision yet; run with --precision fp32")
            from lightning_fsdp import MixedPrecision

            kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model, **kwargs)
        return Trainee(model, clip_grad_norm_, no_autocast, num_params)
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs = {"mp_policy": policy} if policy is not None else {}
        units = [m for m in model.modules() if isinstance(m, tuple(args.wrapped()))]
        for unit in units:
            fsdp2_fully_shard(unit, **kwargs)
        fsdp2_fully_shard(model, **kwargs)
        if args.forward_prefetch:
            for unit, next_unit in zip(units, units[1:], strict=False):
                unit.set_modules_to_forward_prefetch([next_unit])
        return Trainee(model, torch.nn.utils.clip_grad_norm_, no_autocast, num_params)
    if impl == "ddp":
        # The demo's only buffers are constant causal masks: broadcasting them every forward (DDP's default)
        # would add traffic the FSDP implementations do not have.
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
        return Trainee(ddp, torch.nn.utils.clip_grad_norm_, autocast, num_params)
    if impl == "plain":
        return Trainee(model, torch.nn.utils.clip_grad_norm_, autocast, num_params)
    raise ValueError(f"unknown implementation {impl!r}")


def train_step(
    trainee: Trainee, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor], args: BenchArgs
) -> float:
    """One optimizer step; gradients are freed at the start, so they are alive (and counted) after it."""
    optimizer.zero_grad(set_to_none=True)
    inputs, targets = batch
    with trainee.autocast():
        loss = trainee.model(inputs, targets)
    loss.backward()
    if args.max_grad_norm > 0:
        trainee.clip(trainee.model.parameters(), args.max_grad_norm)
    optimizer.step()
    return loss.item()
