"""Optimizers on sharded parameters: what each one reads, and the layout that makes its steps exact (see [Note: an
optimizer is prepared before its first step] in ``prepare.py``)."""

from lightning_fsdp.engine.optimizers.prepare import install_step_hook, prepare_optimizer
from lightning_fsdp.engine.optimizers.scope import UpdateScope, declare_update_scope

__all__ = ["UpdateScope", "declare_update_scope", "install_step_hook", "prepare_optimizer"]
