"""Import paths of modules that moved when the package got one folder per layer, kept importable.

Code and configs written against the old layout (``from lightning_fsdp.strategy import FSDPStrategy``,
``class_path: lightning_fsdp.strategy.FSDPStrategy``, a checkpoint that pickled a class under its old module) keep
working: importing an old path gives the module at its new path, the same module object, so classes,
``isinstance`` checks and module state are shared rather than duplicated. Imports nothing but the standard library,
so the finder can be installed before anything else of the package runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED: dict[str, str] = {
    "lightning_fsdp.strategy": "lightning_fsdp.trainer.strategy",
    "lightning_fsdp.precision": "lightning_fsdp.trainer.precision",
    "lightning_fsdp.checkpoint_io": "lightning_fsdp.trainer.checkpoint_io",
    "lightning_fsdp.compile_support": "lightning_fsdp.trainer.compile_support",
    "lightning_fsdp.summary": "lightning_fsdp.trainer.summary",
    "lightning_fsdp.sync_batchnorm": "lightning_fsdp.trainer.sync_batchnorm",
    "lightning_fsdp.preemption": "lightning_fsdp.trainer.preemption",
    "lightning_fsdp.sharding_setup": "lightning_fsdp.adapter.sharding_setup",
    "lightning_fsdp.lightning_arguments": "lightning_fsdp.adapter.lightning_arguments",
    "lightning_fsdp.registration": "lightning_fsdp.adapter.registration",
    "lightning_fsdp.launch": "lightning_fsdp.runtime.launch",
    "lightning_fsdp.process_exit": "lightning_fsdp.runtime.process_exit",
    "lightning_fsdp.engine.gloo": "lightning_fsdp.engine.transport.gloo",
    "lightning_fsdp.engine.shm": "lightning_fsdp.engine.transport.shm",
    "lightning_fsdp.engine.nccl": "lightning_fsdp.engine.transport.nccl",
    "lightning_fsdp.engine.peer_wait": "lightning_fsdp.engine.transport.peer_wait",
    "lightning_fsdp.engine.ledger": "lightning_fsdp.engine.transport.ledger",
    "lightning_fsdp.engine.comm_stats": "lightning_fsdp.engine.transport.comm_stats",
    "lightning_fsdp.engine.buffers": "lightning_fsdp.engine.transport.buffers",
}


def keep_old_paths_importable() -> None:
    if not any(isinstance(finder, _OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())  # last: an old path is found only where no file of that name exists


class _OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _SameModule(new))


class _SameModule(importlib.abc.Loader):
    """Loads an old path as the module at its new path (its ``__name__`` and ``__spec__`` stay the new ones)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path has run already."""
