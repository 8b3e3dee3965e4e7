"""Checkpoint formats of a sharded model -- one full file, a sharded folder, safetensors weights -- and conversions.

Layouts (the same as Lightning's own FSDP checkpoints, so Lightning's tools read ours):

- full: one ``torch.save`` file, a Lightning checkpoint whose ``state_dict`` holds full tensors and whose
  ``optimizer_states`` are standard ``Optimizer.state_dict()``s at full shapes, so any strategy -- ddp, a single
  device -- loads it as its own. The parameters' names ``convert`` needs lie beside them (``full.py``: the
  ``lightning_fsdp`` entry, or each group's ``param_names`` in the engine's form and in older files).
- sharded: a folder in ``torch.distributed.checkpoint`` format holding ``model`` (the state dict, shards as
  ``Shard(0)`` DTensors), ``optimizer_0``, ``optimizer_1``, ... (state keyed by parameter name) and, for callbacks
  that keep per-rank tensors (``ShardedEMA``), ``callbacks`` (see ``callback_tensors.py``), plus ``meta.pt`` with
  the rest of the checkpoint (loop state, schedulers, callbacks). Loads at any world size.

Every write is atomic: it appears under its final name only when complete.
"""
