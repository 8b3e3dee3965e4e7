"""A model's life under ``myfsdp`` on 2 CPU processes: fit, validate, test, predict, checkpoint, resume.

- "straight": fit 2 epochs with the model summary on (it prints to stdout), save a checkpoint, write the full
  weights (straight.pt), then validate, test and predict with the sharded model (eval.pt: metrics and rank 0's
  predictions).
- "resumed": fit 1 epoch, save a checkpoint, then a new Trainer and a fresh model resume from it for the second
  epoch (resumed.pt); it must land where "straight" did.
- "early_optimizer": an optimizer built before sharding must stop fit in setup; rank 0 writes the message.
- "submodule_in_a_callback": a callback calling ``pl_module.model(x)`` after a step (the root unit is sharded then)
  must stop fit with the engine's sentence; rank 0 writes it.

Usage: python tests/scripts/strategy_lifecycle.py OUT_DIR
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from strategy_common import LitGPT, make_trainer, out_dir, token_loader, write_json

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

SAMPLES = 8  # 2 batches of 2 per rank: one epoch is 2 steps


def strategy() -> FSDPStrategy:
    return FSDPStrategy(auto_wrap_policy={Block})


def save_weights(trainer: L.Trainer, name: str) -> None:
    state = trainer.strategy.lightning_module_state_dict()  # a collective: every rank calls it
    if trainer.global_rank == 0:
        torch.save(state, out_dir() / name)


def straight() -> None:
    L.seed_everything(0)
    model = LitGPT()
    trainer = make_trainer(strategy(), max_epochs=2, enable_model_summary=True)
    trainer.fit(model, token_loader(SAMPLES, batch_size=2))
    trainer.save_checkpoint(out_dir() / "straight.ckpt")
    save_weights(trainer, "straight.pt")
    evaluation = token_loader(SAMPLES, batch_size=2, seed=2)
    validated = trainer.validate(model, evaluation, verbose=False)
    tested = trainer.test(model, evaluation, verbose=False)
    predictions = trainer.predict(model, evaluation)
    if trainer.global_rank == 0:
        torch.save({"validate": validated, "test": tested, "predict": predictions}, out_dir() / "eval.pt")


def resumed() -> None:
    L.seed_everything(0)
    first = make_trainer(strategy(), max_epochs=1)
    first.fit(LitGPT(), token_loader(SAMPLES, batch_size=2))
    first.save_checkpoint(out_dir() / "half.ckpt")
    model = LitGPT()
    with torch.no_grad():  # a different start: every weight must come from the checkpoint
        for param in model.parameters():
            param.add_(1.0)
    second = make_trainer(strategy(), max_epochs=2)
    second.fit(model, token_loader(SAMPLES, batch_size=2), ckpt_path=out_dir() / "half.ckpt")
    save_weights(second, "resumed.pt")


class EarlyOptimizer(LitGPT):
    """Builds its optimizer in ``setup``, which runs before the strategy shards the model."""

    def setup(self, stage: str) -> None:
        self.early = torch.optim.AdamW(self.parameters())

    def configure_optimizers(self) -> Any:
        return self.early


def early_optimizer() -> None:
    trainer = make_trainer(strategy(), max_steps=1)
    try:
        trainer.fit(EarlyOptimizer(), token_loader(SAMPLES, batch_size=2))
    except ValueError as error:
        write_json(trainer, "early_optimizer.json", str(error))


class CallsTheModel(L.Callback):
    """Calls ``pl_module.model`` after a step, outside the LightningModule's forward, as a logging callback might."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *_: Any):
        pl_module.model(batch[:, :-1])


def submodule_in_a_callback() -> None:
    trainer = make_trainer(strategy(), max_steps=1, callbacks=[CallsTheModel()])
    try:
        trainer.fit(LitGPT(), token_loader(SAMPLES, batch_size=2))
    except RuntimeError as error:
        write_json(trainer, "submodule_in_a_callback.json", str(error))


def main() -> None:
    straight()
    resumed()
    early_optimizer()
    submodule_in_a_callback()  # last: the fit ends in the error


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
