"""Tensors a callback keeps rank by rank (``ShardedEMA``'s averaged rows), in both checkpoint forms.

A callback's state dict may hold, under ``"sharded_tensors"``, a dict of tensors by name: ``Shard(0)`` DTensors for
rows spread over the ranks, plain tensors for what every rank holds whole. Lightning hands callback states to the
strategy as part of the checkpoint dict, which rank 0 alone would write; so the strategy moves these tensors. The full
form gathers them into full tensors on rank 0 (``gather_callback_tensors``); the sharded form writes each rank's rows
into the DCP folder (``pop_callback_tensors``). A load checks them against each callback's ``sharded_tensors()``
(names, full shapes) before anything is loaded, and the callback gets back what it saved, at any world size. A
callback missing from the folder is left as it is (as Lightning does with a callback state a checkpoint lacks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

SHARDED_TENSORS = "sharded_tensors"  # the entry of a callback's state dict that holds its per-rank tensors
CALLBACKS = "callbacks"  # Lightning's checkpoint key for callback states (and the DCP key of the first layout)
CALLBACK_TENSORS = "callback_tensors"  # the DCP folder's key for them, and a Lightning-consolidated file's
SAVED_UNDER = (CALLBACK_TENSORS, CALLBACKS)  # the DCP keys they may be under: this layout's, the first one's


def gather_callback_tensors(checkpoint: dict[str, Any]) -> None:
    """Replace every callback's DTensors by full tensors on rank 0's CPU, in place (a collective: every rank).

    One tensor at a time; the full file then holds full tensors, which any world size (the callback takes its rows)
    and ``convert`` read.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for state in checkpoint.get(CALLBACKS, {}).values():
        tensors = state.get(SHARDED_TENSORS) if isinstance(state, dict) else None
        if not isinstance(tensors, dict):
            continue
        full = {}
        for name, value in tensors.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if rank0:
                full[name] = value.detach().to("cpu", copy=True)
        state[SHARDED_TENSORS] = full


def pop_callback_tensors(checkpoint: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
    """Take every callback's per-rank tensors out of ``checkpoint``, by state key, for the DCP folder.

    They go into the folder under ``callback_tensors.<state_key>.<name>``, each rank writing its own rows as it does
    for optimizer state; ``meta.pt`` keeps the rest of the callback's state under ``callbacks``. The tensors' top-level
    key is not ``callbacks`` because Lightning's own consolidation (``_load_distributed_checkpoint``,
    ``python -m lightning.pytorch.utilities.consolidate_checkpoint``) reads the folder into one dict and then updates it
    with ``meta.pt``, whose ``callbacks`` would replace them; a consolidated file therefore holds ``callback_tensors``
    beside ``callbacks`` (see ``fold_callback_tensors``).
    """
    popped = {}
    for key, state in checkpoint.get(CALLBACKS, {}).items():
        if isinstance(state, dict) and isinstance(state.get(SHARDED_TENSORS), dict):
            popped[key] = state.pop(SHARDED_TENSORS)
    return popped


def callback_tensor_targets(callbacks: Iterable[Any]) -> dict[str, dict[str, Tensor]]:
    """Every callback's per-rank tensors to load into, by state key (callbacks with a ``sharded_tensors()``)."""
    return {
        callback.state_key: callback.sharded_tensors()
        for callback in callbacks
        if callable(getattr(callback, "sharded_tensors", None))
    }


def recorded_callback_tensors(
    metadata: Metadata, targets: Mapping[str, dict[str, Tensor]], path: Path
) -> dict[str, dict[str, dict[str, Tensor]]]:
    """The targets of the callbacks a sharded folder records, after checking their names and shapes against it,
    under the DCP key the folder has them under (``SAVED_UNDER``), as ``dcp.load`` takes them.

    A target is the callback's ``sharded_tensors()`` (DTensors aliasing its rows), which DCP loads into in place, at
    any world size. Folders of the first layout hold the tensors under ``callbacks.<state_key>.<name>``; loading and
    ``convert`` read both.
    """
    saved: dict[str, dict[str, dict[str, tuple[int, ...]]]] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        parts = (metadata.planner_data or {}).get(fqn, ())
        if len(parts) == 3 and parts[0] in SAVED_UNDER and hasattr(item, "size"):
            saved.setdefault(parts[0], {}).setdefault(parts[1], {})[parts[2]] = tuple(item.size)
    recorded = {key: _fitting(by_callback, targets, path) for key, by_callback in saved.items()}
    return {key: tensors for key, tensors in recorded.items() if tensors}


def fold_callback_tensors(checkpoint: dict[str, Any]) -> None:
    """Put a Lightning-consolidated file's top-level ``callback_tensors`` back into each callback's state, in place,
    where a full checkpoint keeps them (``callbacks[<state_key>]["sharded_tensors"]``); other files are unchanged."""
    tensors = checkpoint.pop(CALLBACK_TENSORS, None) if isinstance(checkpoint, dict) else None
    if isinstance(tensors, dict):
        merge_callback_tensors(checkpoint, tensors)


def check_full_callback_tensors(
    checkpoint: Mapping[str, Any], targets: Mapping[str, dict[str, Tensor]], path: object
) -> None:
    """Refuse a full checkpoint whose callbacks' tensors do not fit this run's (before anything is loaded); each
    callback takes its rows in its ``load_state_dict``."""
    saved = {
        key: {name: tuple(value.shape) for name, value in state[SHARDED_TENSORS].items()}
        for key, state in checkpoint.get(CALLBACKS, {}).items()
        if isinstance(state, dict) and isinstance(state.get(SHARDED_TENSORS), dict)
    }
    _fitting(saved, targets, path)


def _fitting(
    saved: Mapping[str, Mapping[str, tuple[int, ...]]], targets: Mapping[str, dict[str, Tensor]], path: object
) -> dict[str, dict[str, Tensor]]:
    """The targets whose callback ``saved`` records (full shapes by name), each checked to have exactly those."""
    recorded = {}
    for key, tensors in targets.items():
        if key not in saved:
            continue
        expected = {name: tuple(value.shape) for name, value in tensors.items()}
        if dict(saved[key]) != expected:
            differ = sorted(set(saved[key]) ^ set(expected)) or [n for n in expected if saved[key][n] != expected[n]]
            raise ValueError(
                f"the checkpoint at {path} holds the state of callback {key} for other tensors than this run's "
                f"(first difference: {differ[:3]}); resume with the model and callbacks it was saved with."
            )
        recorded[key] = dict(tensors)
    return recorded


def merge_callback_tensors(checkpoint: dict[str, Any], loaded: Mapping[str, dict[str, Tensor]]) -> None:
    """Put loaded per-rank tensors back into the callback states ``checkpoint`` holds (its ``meta.pt`` part), so a
    callback's ``load_state_dict`` sees what it saved."""
    states = checkpoint.get(CALLBACKS, {})
    for key, tensors in loaded.items():
        if isinstance(states.get(key), dict):
            states[key][SHARDED_TENSORS] = tensors
