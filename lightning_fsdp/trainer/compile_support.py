"""``trainer.fit(torch.compile(model))`` with our strategy.

Lightning unwraps a compiled LightningModule (``from_compiled`` re-applies the compiler to its ``forward`` and
``*_step`` methods) and then refuses every strategy outside an allow-list of its own classes: single device, DDP
and its own FSDP. Our strategy runs compiled code like those do -- the engine's hooks are kept out of traced graphs
(see [Note: hooks stay out of compiled graphs] in engine/runtime/hooks.py) -- so the check the Trainer calls is widened
by exactly our strategy; every other strategy still meets Lightning's own check, unchanged.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch.trainer.trainer as trainer_module


def accept_compiled_modules(strategy_class: type) -> None:
    """Lets the Trainer run a compiled LightningModule under ``strategy_class``; idempotent."""
    lightning_check = trainer_module._verify_strategy_supports_compile
    if getattr(lightning_check, "accepted_strategy", None) is strategy_class:
        return

    def verify_strategy_supports_compile(model: Any, strategy: Any) -> None:
        if not isinstance(strategy, strategy_class):
            lightning_check(model, strategy)

    verify_strategy_supports_compile.accepted_strategy = strategy_class
    trainer_module._verify_strategy_supports_compile = verify_strategy_supports_compile
