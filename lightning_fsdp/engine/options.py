"""The engine's options as enums and one frozen dataclass, validated once with messages that name the fix."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class ShardingStrategy(Enum):
    FULL_SHARD = "FULL_SHARD"  # parameters re-gathered in backward; ZeRO-3
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # parameters kept unsharded from forward to the end of backward; ZeRO-2
    NO_SHARD = "NO_SHARD"  # replicated parameters, all-reduced gradients; DDP
    HYBRID_SHARD = "HYBRID_SHARD"  # FULL_SHARD inside each shard group, replicated across groups
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"  # SHARD_GRAD_OP inside each shard group, replicated across groups

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class BackwardPrefetch(Enum):
    BACKWARD_PRE = "BACKWARD_PRE"  # gather the next unit when the current one's backward starts
    BACKWARD_POST = "BACKWARD_POST"  # gather the next unit when the current one's backward ends


def parse_sharding_strategy(value: object) -> ShardingStrategy:
    """Ours, torch's ``ShardingStrategy`` (by member name) or a name in any case; the one validation of the value."""
    return _parse_enum(ShardingStrategy, value, "sharding_strategy")  # type: ignore[return-value]


def parse_backward_prefetch(value: object) -> BackwardPrefetch | None:
    """As ``parse_sharding_strategy``, for ``backward_prefetch`` (None: gather on demand)."""
    return None if value is None else _parse_enum(BackwardPrefetch, value, "backward_prefetch")  # type: ignore[return-value]


def _parse_enum(enum: type[Enum], value: object, argument: str) -> Enum:
    if isinstance(value, enum):
        return value
    if isinstance(value, Enum):  # torch's own enums, by member name
        value = value.name
    if isinstance(value, str) and value.upper() in enum.__members__:
        return enum[value.upper()]
    choices = ", ".join(repr(name) for name in enum.__members__)
    raise ValueError(f"{argument}={value!r} is not supported; use one of {choices}.")


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtypes the gathered parameters, the gradient reduction and the buffers use.

    The sharded parameters -- what the optimizer steps -- always stay in their own dtype (fp32 master weights);
    ``param_dtype`` is the dtype of the all-gather and of the full parameters forward and backward compute with,
    so bf16 halves the gathered bytes. Gradients are reduced in ``reduce_dtype`` (``param_dtype`` when None) and
    accumulated into the shards' ``.grad`` in the shards' dtype. Floating-point buffers are cast to
    ``buffer_dtype`` once, at the first forward. ``cast_forward_inputs`` casts floating-point tensors passed to
    each unit's forward to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecision.{name}={value!r} must be a floating-point torch.dtype or None.")

    @staticmethod
    def coerce(config: object) -> MixedPrecision | None:
        """Ours as is, or the fields of ``torch.distributed.fsdp.MixedPrecision`` (read, never wrapped).

        torch's ``cast_root_forward_inputs`` (on by default there) maps onto ``cast_forward_inputs``, which casts the
        inputs of every unit -- the root's included -- to ``param_dtype``; its ``keep_low_precision_grads`` and
        ``_module_classes_to_ignore`` must keep their defaults, since the engine has no such modes.
        """
        if config is None or isinstance(config, MixedPrecision):
            return config
        if not _is_torch_fsdp_object(config, "MixedPrecision"):
            raise TypeError(
                f"mixed_precision must be a lightning_fsdp.MixedPrecision or torch.distributed.fsdp.MixedPrecision, "
                f"got {type(config).__name__}."
            )
        if getattr(config, "keep_low_precision_grads", False):
            raise ValueError(
                "MixedPrecision(keep_low_precision_grads=True) has no meaning here: gradients are always accumulated "
                "into the fp32 shards the optimizer steps; drop the flag."
            )
        return MixedPrecision(
            param_dtype=config.param_dtype,  # type: ignore[attr-defined]
            reduce_dtype=config.reduce_dtype,  # type: ignore[attr-defined]
            buffer_dtype=config.buffer_dtype,  # type: ignore[attr-defined]
            cast_forward_inputs=bool(config.cast_forward_inputs or config.cast_root_forward_inputs),  # type: ignore[attr-defined]
        )

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


def parse_cpu_offload(value: object) -> bool:
    """``cpu_offload`` as a bool from the forms Lightning and torch accept: a bool, None (off) or
    ``torch.distributed.fsdp.CPUOffload(offload_params=...)``, read by field."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if _is_torch_fsdp_object(value, "CPUOffload") and isinstance(getattr(value, "offload_params", None), bool):
        return value.offload_params  # type: ignore[attr-defined]
    raise ValueError(
        f"cpu_offload must be True, False, None or torch.distributed.fsdp.CPUOffload(offload_params=...), got "
        f"{value!r}."
    )


def _is_torch_fsdp_object(value: object, class_name: str) -> bool:
    """Whether ``value`` is torch FSDP's config class ``class_name``, told by name: the engine never imports
    ``torch.distributed.fsdp``."""
    cls = type(value)
    return cls.__name__ == class_name and cls.__module__.startswith("torch.distributed.fsdp")


WIRE_FORMATS = {"gather": ("bf16", "int8"), "reduce": ("bf16",)}


@dataclass(frozen=True)
class CrossHostPrecision:
    """What crosses between hosts in fewer bits than the computation uses, the computation itself unchanged.

    ``gather="bf16"``: the all-gathers' part between hosts carries bf16 copies of the parameters; ``"int8"``: blockwise
    int8 with one fp32 scale per block of ``INT8_BLOCK`` elements (the quantized weights of ZeRO++'s qwZ). Every rank
    -- the one that owns a row included -- computes with the same rounded values, so the replicas stay identical; the
    optimizer's master weights stay exact. ``reduce="bf16"``: the gradient reductions' part between hosts carries
    bf16, summed in fp32 where it arrives. Inside a host nothing changes: shared memory moves the full precision. The
    strings ``"bf16"`` (bf16 both ways) and ``"int8"`` (int8 gathers, bf16 reductions) are shorthands. What each does
    to the loss is measured in docs/multi-node.md.
    """

    gather: str | None = None
    reduce: str | None = None

    def __post_init__(self) -> None:
        for field_name, formats in WIRE_FORMATS.items():
            value = getattr(self, field_name)
            if value is not None and value not in formats:
                raise ValueError(
                    f"CrossHostPrecision.{field_name}={value!r} is not supported; use one of {formats} or None."
                )

    @staticmethod
    def coerce(value: object) -> CrossHostPrecision | None:
        """Ours, None, a shorthand string, or a mapping of the fields (a config file's form)."""
        if value is None or isinstance(value, CrossHostPrecision):
            return value if value != CrossHostPrecision() else None
        if isinstance(value, str):
            shorthands = {"bf16": CrossHostPrecision("bf16", "bf16"), "int8": CrossHostPrecision("int8", "bf16")}
            if value.lower() not in shorthands:
                raise ValueError(
                    f"cross_host_precision={value!r} is not supported; use 'bf16', 'int8', None or "
                    "CrossHostPrecision(gather=..., reduce=...)."
                )
            return shorthands[value.lower()]
        if isinstance(value, dict) and set(value) <= {"gather", "reduce"}:
            return CrossHostPrecision.coerce(CrossHostPrecision(**value))
        raise ValueError(
            f"cross_host_precision must be 'bf16', 'int8', None, a CrossHostPrecision or a dict of its fields, got "
            f"{value!r}."
        )

    @property
    def gather_dtype(self) -> torch.dtype | None:
        """The dtype a gather's rows cross in, when that is a plain cast (bf16)."""
        return torch.bfloat16 if self.gather == "bf16" else None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.reduce == "bf16" else None


def parse_reshard_after_forward(value: object, strategy: ShardingStrategy) -> bool | int:
    """``reshard_after_forward`` as torch FSDP2 takes it: True (free the full parameters after forward; backward
    gathers them again), False (keep them until backward), or an int: the ranks to stay sharded over after forward
    (the ranks per host: backward then gathers inside the host only). None: what ``strategy`` does."""
    default = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    if value is None:
        return default
    if isinstance(value, bool):
        if value and not default:
            raise ValueError(
                f"reshard_after_forward=True contradicts sharding_strategy={strategy.value}, which keeps the full "
                "parameters after forward; use FULL_SHARD (or HYBRID_SHARD) to reshard them."
            )
        return value
    if isinstance(value, int) and value >= 1:
        if not default:
            raise ValueError(
                f"reshard_after_forward={value} needs sharding_strategy FULL_SHARD or HYBRID_SHARD, not "
                f"{strategy.value}, which keeps the full parameters after forward."
            )
        return value
    raise ValueError(
        f"reshard_after_forward must be True, False, None or a positive number of ranks (the ranks per host), got "
        f"{value!r}."
    )


@dataclass(frozen=True)
class ShardingOptions:
    """Everything a unit needs to know about how it shards, shared by all units of one ``fully_shard`` call."""

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool | None = None  # None: where the gathers cross hosts
    limit_all_gathers: bool = True
    mixed_precision: MixedPrecision = MixedPrecision()
    cpu_offload: bool = False
    # True, False, or the ranks to stay sharded over after forward: see ``parse_reshard_after_forward``.
    reshard_after_forward: bool | int = True
    cross_host_precision: CrossHostPrecision | None = None
    # Between hosts, an embedding's rows as its lookups read them (see embedding_rows.py).
    gather_embedding_by_rows: bool = True

    @staticmethod
    def parse(
        sharding_strategy: str | ShardingStrategy,
        backward_prefetch: str | BackwardPrefetch | None,
        forward_prefetch: bool | None,
        limit_all_gathers: bool,
        mixed_precision: object,
        cpu_offload: object,
        reshard_after_forward: object = None,
        cross_host_precision: object = None,
        gather_embedding_by_rows: bool = True,
    ) -> ShardingOptions:
        strategy = parse_sharding_strategy(sharding_strategy)
        return ShardingOptions(
            strategy,
            parse_backward_prefetch(backward_prefetch),
            None if forward_prefetch is None else bool(forward_prefetch),
            bool(limit_all_gathers),
            MixedPrecision.coerce(mixed_precision) or MixedPrecision(),
            parse_cpu_offload(cpu_offload),
            parse_reshard_after_forward(reshard_after_forward, strategy),
            CrossHostPrecision.coerce(cross_host_precision),
            bool(gather_embedding_by_rows),
        )

    @property
    def keeps_replicas_in_place(self) -> bool:
        """NO_SHARD in the parameters' own dtype: forward uses the registered parameters themselves, no copy."""
        return (
            self.sharding_strategy is ShardingStrategy.NO_SHARD
            and self.mixed_precision.param_dtype is None
            and not self.cpu_offload
        )
