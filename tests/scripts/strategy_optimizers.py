"""Train the tiny GPT under the Trainer with optimizers that read whole tensors, with ``strategy="ddp"`` and ``myfsdp``.

Cases, each from the same seed and data: LAMB (pytorch-optimizer) from ``configure_optimizers``; Muon (fp32, from
``tests/optimizers.py``) on the blocks' matrices beside AdamW on the rest, stepped by manual optimization; Adafactor
with ``ShardedEMA``, saved in a sharded checkpoint and restored by a new Trainer. Rank 0 saves the full weights of
each case to OUT_DIR/<case>.pt (and the Adafactor runs' optimizer state and average beside them). An optimizer that
reads across tensors (Prodigy) is refused at setup: OUT_DIR/refusal.rank<r>.json holds each rank's message.

Usage: python tests/scripts/strategy_optimizers.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytorch_optimizer
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_common import LitGPT, make_trainer, out_dir, token_loader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_fsdp import FSDPStrategy, ShardedEMA  # noqa: E402
from lightning_fsdp.checkpoint.full import full_optimizer_state  # noqa: E402
from lightning_fsdp.demos.gpt import Block  # noqa: E402
from lightning_fsdp.engine.state.state_dict import full_state_dict  # noqa: E402
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run  # noqa: E402
from tests.optimizers import MuonFP32, hidden_matrices  # noqa: E402

STEPS = 6
LOCAL_BATCH = 2


class WithOptimizer(LitGPT):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "lamb":
            return pytorch_optimizer.Lamb(self.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-5)
        if self.optimizer_name == "adafactor":
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)
        return pytorch_optimizer.Prodigy(self.parameters())


class ManualMuon(LitGPT):
    """Muon and AdamW stepped by hand: how Muon's users write it in Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        hidden, rest = hidden_matrices(self.model)
        return [MuonFP32(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, eps=1e-5)]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        muon, adamw = self.optimizers()
        loss = self.model(batch[:, :-1], batch[:, 1:])
        self.manual_backward(loss)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()


def strategy(kind: str) -> Any:
    return "ddp" if kind == "ddp" else FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")


def save_weights(trainer: L.Trainer, model: L.LightningModule, name: str) -> None:
    if isinstance(trainer.strategy, FSDPStrategy):
        state = full_state_dict(model)  # a collective: every rank calls it
    else:
        state = model.state_dict()
    if trainer.global_rank == 0:
        torch.save(state, out_dir() / f"{name}.pt")


def fit(model: L.LightningModule, kind: str, steps: int = STEPS, **kwargs: Any) -> L.Trainer:
    L.seed_everything(0)
    trainer = make_trainer(strategy(kind), max_steps=steps, **kwargs)
    trainer.fit(model, loader())
    return trainer


def loader() -> Any:
    """Three steps an epoch on each of the two ranks."""
    return token_loader(STEPS // 2 * LOCAL_BATCH * 2, LOCAL_BATCH)


def main() -> None:
    for kind in ("ddp", "myfsdp"):
        for optimizer in ("lamb", "muon"):
            L.seed_everything(0)
            model = ManualMuon() if optimizer == "muon" else WithOptimizer(optimizer)
            save_weights(fit(model, kind), model, f"{optimizer}_{kind}")
    # Adafactor with an EMA: a sharded checkpoint restored by a new Trainer gives back weights, optimizer state and
    # average as they were.
    folder = out_dir() / "checkpoints"
    for run in ("saved", "restored"):
        L.seed_everything(0)
        model, ema = WithOptimizer("adafactor"), ShardedEMA(decay=0.5)
        if run == "saved":
            every = ModelCheckpoint(dirpath=folder, every_n_train_steps=STEPS // 2)
            trainer = fit(model, "myfsdp", STEPS // 2, callbacks=[ema, every], enable_checkpointing=True)
        else:
            trainer = make_trainer(strategy("myfsdp"), max_steps=STEPS // 2, callbacks=[ema])
            trainer.fit(model, loader(), ckpt_path=str(next(folder.iterdir())))
        save_weights(trainer, model, f"adafactor_{run}")
        optimizer_state = full_optimizer_state(model, trainer.optimizers[0])
        average = ema.full_state_dict()
        if trainer.global_rank == 0:
            torch.save({"optimizer": optimizer_state, "average": average}, out_dir() / f"adafactor_{run}_state.pt")
    # Reads across tensors: refused at setup, on every rank, before a step.
    trainer = make_trainer(strategy("myfsdp"), max_steps=STEPS)
    try:
        trainer.fit(WithOptimizer("prodigy"), loader())
        message = None
    except ValueError as error:
        message = str(error)
    (out_dir() / f"refusal.rank{trainer.global_rank}.json").write_text(json.dumps([message, trainer.global_step]))


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
