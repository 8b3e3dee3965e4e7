"""Lightning's weight-averaging callbacks, refused under ``myfsdp`` on more than one rank before anything trains.

``WeightAveraging`` (and its ``EMAWeightAveraging``) and ``StochasticWeightAveraging`` copy the whole LightningModule
in their ``setup``, before the strategy shards it, and then average that full copy against the model's parameters,
which by then are each rank's shards. Run on 2 gloo ranks, all three fail at their first update (after a training
step, or at the SWA epoch) with torch's "The size of tensor a (61) must match the size of tensor b (31)"; and each
rank would hold the full model again, which is what sharding is for avoiding. ``ShardedEMA`` is the sharded EMA;
a ``torch.optim.swa_utils.AveragedModel`` built in the LightningModule's ``__init__`` or ``configure_model`` is
sharded with the model and averages shard against shard, which gives ddp's result (docs/weight-averaging.md says how).

On one rank nothing is sharded (each parameter's shard is the whole parameter), so the callbacks are allowed there and
train and average as under Lightning's default strategy.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging

_ALTERNATIVES = {
    WeightAveraging: "use lightning_fsdp.ShardedEMA(decay=...) for an EMA that averages each rank's own shard",
    StochasticWeightAveraging: (
        "build torch.optim.swa_utils.AveragedModel(...) in your LightningModule's configure_model, where it is "
        "sharded with the model, and call its update_parameters(...) at the end of each epoch"
    ),
}


def refuse_unsharded_averaging(callbacks: Iterable[Callback], world_size: int) -> None:
    """Raise ``ValueError`` naming the supported alternative if a callback averages an unsharded copy of the model
    against shards, which it does on more than one rank."""
    if world_size == 1:
        return
    for callback in callbacks:
        for kind, alternative in _ALTERNATIVES.items():
            if isinstance(callback, kind):
                raise ValueError(
                    f"{type(callback).__name__} averages a full, unsharded copy of the model against each rank's "
                    f"shards, which strategy='myfsdp' cannot support; {alternative}."
                )
