"""Per-rank memory of training a model with each sharding strategy, before you try it.

What DeepSpeed's ZeRO estimators do, for our engine: parameters, gradients and optimizer state per rank, plus the
working set of gathered (unsharded) units that forward and backward need at once. The steady-state figures
(parameters, gradients, optimizer state) are exact up to dim-0 padding, which is at most W - 1 rows per parameter;
the working set assumes the default prefetch (the unit in use, one prefetched unit, and the root kept through
backward), and activations are not counted -- they depend on batch and sequence length, not on sharding.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from torch import nn

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD", "DDP")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds: on the compute device, and in CPU memory under offload."""

    strategy: str
    params: int
    grads: int
    optimizer_state: int
    unsharded_working_set: int
    cpu_offloaded: int

    @property
    def steady(self) -> int:
        """Parameters + gradients + optimizer state kept on the device between steps."""
        return self.params + self.grads + self.optimizer_state

    @property
    def peak(self) -> int:
        return self.steady + self.unsharded_working_set


def estimate_memory(
    model_or_param_count: nn.Module | int,
    world_size: int,
    sharding_strategy: str = "FULL_SHARD",
    *,
    largest_unit: int | None = None,
    root_unit: int = 0,
    shard_size: int | None = None,
    bytes_per_param: int = 4,
    param_dtype_bytes: int | None = None,
    optimizer_states: int = 2,
    cpu_offload: bool = False,
) -> MemoryEstimate:
    """Estimate one rank's bytes for ``sharding_strategy`` (or ``"DDP"`` for comparison).

    ``largest_unit`` and ``root_unit`` are parameter counts (default: a tenth of the model, and none);
    ``shard_size`` is HYBRID_SHARD's shard group size (default: ``world_size``); ``optimizer_states`` is the
    number of per-parameter state tensors (AdamW: 2, SGD with momentum: 1); ``param_dtype_bytes`` the size of a
    gathered parameter under mixed precision.
    """
    strategy = sharding_strategy.upper()
    if strategy not in STRATEGIES:
        raise ValueError(f"sharding_strategy={sharding_strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if isinstance(model_or_param_count, nn.Module):
        numel = sum(p.numel() for p in {id(p): p for p in model_or_param_count.parameters()}.values())
    else:
        numel = int(model_or_param_count)
    gathered_bytes = param_dtype_bytes or bytes_per_param
    unit = largest_unit if largest_unit is not None else -(-numel // 10)
    shards = {"FULL_SHARD": world_size, "SHARD_GRAD_OP": world_size, "HYBRID_SHARD": shard_size or world_size}
    per_rank = -(-numel // shards.get(strategy, 1))
    working = {
        # the unit in use and one prefetched, each with its unsharded gradient, plus the root kept through backward
        "FULL_SHARD": (2 * unit + root_unit) * (2 * gathered_bytes),
        "HYBRID_SHARD": (2 * unit + root_unit) * (2 * gathered_bytes),
        # every unit stays gathered from its forward to the end of its backward
        "SHARD_GRAD_OP": numel * gathered_bytes + unit * gathered_bytes,
        # replicas compute in place; a half-precision copy only under mixed precision
        "NO_SHARD": numel * gathered_bytes if param_dtype_bytes else 0,
        "DDP": 0,
    }[strategy]
    states = per_rank * bytes_per_param * (2 + optimizer_states)
    if cpu_offload and strategy != "DDP":
        return MemoryEstimate(strategy, 0, 0, 0, working, states)
    params, grads = per_rank * bytes_per_param, per_rank * bytes_per_param
    return MemoryEstimate(strategy, params, grads, per_rank * bytes_per_param * optimizer_states, working, 0)


def largest_trainable(budget_bytes: int, world_size: int, sharding_strategy: str, **kwargs: int) -> int:
    """The largest parameter count whose estimated peak fits ``budget_bytes`` per rank (bisection on the count)."""
    low, high = 0, 1
    while estimate_memory(high, world_size, sharding_strategy, **kwargs).peak <= budget_bytes:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        fits = estimate_memory(middle, world_size, sharding_strategy, **kwargs).peak <= budget_bytes
        low, high = (middle, high) if fits else (low, middle)
    return low


def format_table(estimates: list[MemoryEstimate]) -> str:
    gib = 1024**3
    header = (
        f"{'strategy':<14}{'params':>10}{'grads':>10}{'optim':>10}{'gathered':>10}{'peak':>10}{'cpu':>10}  (GiB/rank)"
    )
    rows = [
        f"{e.strategy:<14}{e.params / gib:>10.3f}{e.grads / gib:>10.3f}{e.optimizer_state / gib:>10.3f}"
        f"{e.unsharded_working_set / gib:>10.3f}{e.peak / gib:>10.3f}{e.cpu_offloaded / gib:>10.3f}"
        for e in estimates
    ]
    return "\n".join([header, *rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp estimate", description="Estimate per-rank training memory for each sharding strategy."
    )
    parser.add_argument("--params", type=float, required=True, help="parameter count, e.g. 1.3e9")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--largest-unit", type=float, default=None, help="parameters of the largest unit")
    parser.add_argument("--shard-size", type=int, default=None, help="HYBRID_SHARD's shard group size")
    parser.add_argument("--bytes-per-param", type=int, default=4)
    parser.add_argument("--param-dtype-bytes", type=int, default=None, help="2 under bf16/fp16 mixed precision")
    parser.add_argument("--cpu-offload", action="store_true")
    args = parser.parse_args(argv)
    _validate(parser, args)
    largest = int(args.largest_unit) if args.largest_unit is not None else None
    estimates = [
        estimate_memory(
            int(args.params),
            args.world_size,
            strategy,
            largest_unit=largest,
            shard_size=args.shard_size,
            bytes_per_param=args.bytes_per_param,
            param_dtype_bytes=args.param_dtype_bytes,
            cpu_offload=args.cpu_offload,
        )
        for strategy in STRATEGIES
    ]
    print(format_table(estimates))


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2) that name the bad value, before anything is computed."""
    if not math.isfinite(args.params) or args.params < 1:
        parser.error(f"--params {args.params:g} must be a positive parameter count, e.g. 1.3e9")
    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size} must be at least 1 (the number of ranks)")
    if args.largest_unit is not None and not 0 <= args.largest_unit <= args.params:
        parser.error(f"--largest-unit {args.largest_unit:g} must lie between 0 and --params {args.params:g}")
    if args.shard_size is not None and (args.shard_size < 1 or args.world_size % args.shard_size):
        parser.error(
            f"--shard-size {args.shard_size} must divide --world-size {args.world_size}: HYBRID_SHARD splits the "
            "ranks into shard groups of that size"
        )
    for flag, value in (("--bytes-per-param", args.bytes_per_param), ("--param-dtype-bytes", args.param_dtype_bytes)):
        if value is not None and value not in (1, 2, 4, 8):
            parser.error(f"{flag} {value} must be the byte size of a dtype: 1, 2, 4 or 8")


if __name__ == "__main__":
    main()
