"""Weight averaging on a sharded model: ``ShardedEMA``, and the refusal of Lightning's unsharded averaging."""

from lightning_fsdp.averaging.sharded_ema import ShardedEMA
from lightning_fsdp.averaging.unsupported import refuse_unsharded_averaging

__all__ = ["ShardedEMA", "refuse_unsharded_averaging"]
