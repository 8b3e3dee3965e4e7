"""The strategy names we register with Lightning (``"myfsdp"`` and its variants) and how an entry is written.

Its own module, apart from ``registration.py``: the strategy classes fill their registry entries in from here when
they are imported, while ``registration.py`` names those classes only by their import paths, so neither imports
the other.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (description, the strategy's arguments), for the Trainer's registry and for Fabric's.
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "myfsdp": ("lightning_fsdp: FULL_SHARD", {}),
    "myfsdp_shard_grad_op": (
        "lightning_fsdp: SHARD_GRAD_OP (parameters kept gathered from forward to backward)",
        {"sharding_strategy": "SHARD_GRAD_OP"},
    ),
    "myfsdp_cpu_offload": ("lightning_fsdp: FULL_SHARD with the sharded state in CPU memory", {"cpu_offload": True}),
}


def register_names(registry: Any, strategy: type) -> None:
    """Register every name of ``STRATEGY_NAMES`` in a Lightning strategy registry with the strategy class and its
    arguments, as Lightning registers its own; names someone else registered are kept, ours get the class."""
    for name, (description, init_params) in STRATEGY_NAMES.items():
        entry = dict.get(registry, name)  # the registry's own get() builds a strategy
        if isinstance(entry, ClassOnFirstRead):
            entry["strategy"] = strategy
        elif entry is None:
            registry.register(name, strategy, description=description, **init_params)


class ClassOnFirstRead(dict):
    """A registry entry as ``_StrategyRegistry.register`` writes it (``strategy``, ``strategy_name``, ``description``,
    ``init_params``) whose ``strategy``, the class, is imported when first read, if its module has not filled it in
    already: ``registry[name]["strategy"]`` is the class, as for Lightning's own strategies. Until that first read
    (or the module's import) the key is not stored, so ``entry.get("strategy")`` alone would give None."""

    def __init__(self, module: str, class_name: str, name: str, description: str, init_params: dict[str, Any]):
        super().__init__(strategy_name=name, description=description, init_params=init_params)
        self._class_path = (module, class_name)

    def __missing__(self, key: str) -> Any:
        if key != "strategy":
            raise KeyError(key)
        module, class_name = self._class_path
        self[key] = getattr(importlib.import_module(module), class_name)
        return self[key]
