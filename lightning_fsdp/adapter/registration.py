"""Register the strategy names with Lightning as soon as Lightning is loaded, without loading it ourselves.

Why not at import: ``import lightning_fsdp`` must register ``"myfsdp"`` and the other names with the Trainer and
with Fabric, yet ``import lightning_fsdp.engine`` (which runs this package's ``__init__`` first) must not import
Lightning, which the engine does not need. So the package's ``__init__`` calls ``register_when_lightning_loads``:
if ``lightning.pytorch`` is already imported the names are registered at once; otherwise a finder on
``sys.meta_path`` waits for ``lightning.pytorch`` to be imported and registers them right after its package has
run, before any user code can look a name up (``Trainer`` and ``StrategyRegistry`` live under it; importing
``lightning.fabric`` imports it too, through the ``lightning`` package). The registered entries name the strategy
classes, as Lightning registers its own, and import them when first read (see ``register_now``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

from lightning_fsdp.adapter.strategy_names import STRATEGY_NAMES, ClassOnFirstRead

LIGHTNING = "lightning.pytorch"


def register_now() -> None:
    """Register entries that import their class when it is first read: this runs while Lightning is being imported,
    often because one of our own Lightning-dependent modules is importing it and is itself half-initialised, so the
    strategy modules cannot be imported yet. Each strategy module fills its entries in when it is imported."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for registry, (module, class_name) in (
        (StrategyRegistry, ("lightning_fsdp.trainer.strategy", "FSDPStrategy")),
        (FABRIC_STRATEGY_REGISTRY, ("lightning_fsdp.fabric.strategy", "FabricFSDPStrategy")),
    ):
        for name, (description, init_params) in STRATEGY_NAMES.items():
            if name not in registry:
                registry[name] = ClassOnFirstRead(module, class_name, name, description, init_params)


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
