"""Register the strategy names with Lightning as soon as Lightning is loaded, without loading it ourselves.

Why not at import: ``import lightning_fsdp`` must register ``"myfsdp"`` and the other names, yet ``import
lightning_fsdp.engine`` (which runs this package's ``__init__`` first) must not import Lightning, which the engine
does not need. So the package's ``__init__`` calls ``register_when_lightning_loads``: if ``lightning.pytorch`` is
already imported the names are registered at once; otherwise a finder on ``sys.meta_path`` waits for
``lightning.pytorch`` to be imported and registers them right after its package has run, before any user code can
look a name up (``Trainer`` and ``StrategyRegistry`` live under it). The registry gets a factory that imports
``strategy.py`` only when a ``Trainer`` builds the strategy: Lightning may be loading because one of our own modules
imports it, so importing ``strategy.py`` from the hook could find it half-initialised.

``STRATEGY_NAMES`` is the one table of the names, their descriptions and the arguments each stands for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

LIGHTNING = "lightning.pytorch"

# name -> (description, FSDPStrategy arguments)
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "myfsdp": ("lightning_fsdp: FULL_SHARD", {}),
    "myfsdp_shard_grad_op": (
        "lightning_fsdp: SHARD_GRAD_OP (parameters kept gathered from forward to backward)",
        {"sharding_strategy": "SHARD_GRAD_OP"},
    ),
    "myfsdp_cpu_offload": ("lightning_fsdp: FULL_SHARD with the sharded state in CPU memory", {"cpu_offload": True}),
}


def register(registry: Any, strategy: Callable[..., Any]) -> None:
    """Every name of ``STRATEGY_NAMES`` in Lightning's ``registry``, built by ``strategy(**arguments)``."""
    for name, (description, arguments) in STRATEGY_NAMES.items():
        if name not in registry:
            registry.register(name, strategy, description=description, **arguments)


def _build_strategy(**arguments: Any) -> Any:
    """What the registry calls when a ``Trainer`` asks for one of our names (see the module's docstring)."""
    from lightning_fsdp.strategy import FSDPStrategy

    return FSDPStrategy(**arguments)


def register_now() -> None:
    register(importlib.import_module("lightning.pytorch.strategies").StrategyRegistry, _build_strategy)


def register_when_lightning_loads() -> None:
    if LIGHTNING in sys.modules:
        register_now()
    elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` as the other finders do, with a loader that registers our names once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != LIGHTNING:
            return None
        sys.meta_path.remove(self)  # once: the other finders locate the real package
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Registering(spec.loader)
        return spec


class _Registering(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        register_now()
