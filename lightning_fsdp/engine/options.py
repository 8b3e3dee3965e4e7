"""The engine's options as enums and one frozen dataclass, validated once with messages that name the fix."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ShardingStrategy(Enum):
    FULL_SHARD = "FULL_SHARD"  # parameters re-gathered in backward; ZeRO-3
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # parameters kept unsharded from forward to the end of backward; ZeRO-2
    NO_SHARD = "NO_SHARD"  # replicated parameters, all-reduced gradients; DDP


class BackwardPrefetch(Enum):
    BACKWARD_PRE = "BACKWARD_PRE"  # gather the next unit when the current one's backward starts
    BACKWARD_POST = "BACKWARD_POST"  # gather the next unit when the current one's backward ends


def _parse_enum(enum: type[Enum], value: object, argument: str) -> Enum:
    if isinstance(value, enum):
        return value
    if isinstance(value, str) and value.upper() in enum.__members__:
        return enum[value.upper()]
    choices = ", ".join(repr(name) for name in enum.__members__)
    raise ValueError(f"{argument}={value!r} is not supported; use one of {choices}.")


@dataclass(frozen=True)
class ShardingOptions:
    """Everything a unit needs to know about how it shards, shared by all units of one ``fully_shard`` call."""

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True

    @staticmethod
    def parse(
        sharding_strategy: str | ShardingStrategy,
        backward_prefetch: str | BackwardPrefetch | None,
        forward_prefetch: bool,
        limit_all_gathers: bool,
    ) -> ShardingOptions:
        strategy = _parse_enum(ShardingStrategy, sharding_strategy, "sharding_strategy")
        prefetch = (
            None if backward_prefetch is None else _parse_enum(BackwardPrefetch, backward_prefetch, "backward_prefetch")
        )
        return ShardingOptions(strategy, prefetch, bool(forward_prefetch), bool(limit_all_gathers))

    @property
    def shards_parameters(self) -> bool:
        return self.sharding_strategy is not ShardingStrategy.NO_SHARD

    @property
    def reshard_after_forward(self) -> bool:
        return self.sharding_strategy is ShardingStrategy.FULL_SHARD
