"""An 8-step run interrupted at step 4 and resumed, through ``ModelCheckpoint`` and ``trainer.fit(ckpt_path=...)``.

Every run sees the same 4 samples per optimizer step whatever its world size (16 shuffled samples, a local batch
of ``4 // W``, Lightning's ``DistributedSampler`` dealing indices round-robin), and the same per-step learning-rate
schedule, so a resumed run must land where the uninterrupted one did, up to reduction order. Rank 0 saves each
run's result to OUT_DIR/<run>.pt: ``start`` (model, optimizer, scheduler and loop state right after the restore),
``final`` (the weights after step 8) and ``global_step``. tests/test_checkpoint_resume.py compares them.

``main`` (2 processes):

- ``straight``: 8 steps under ``myfsdp``, never interrupted: the reference.
- ``full_first`` / ``full_resumed``: ``state_dict_type="full"``, a ``.ckpt`` every 2 steps plus ``last.ckpt``; stop at
  step 4; a new Trainer resumes with ``ckpt_path="last"``.
- ``full_ddp``: ``strategy="ddp"`` resumes the step-4 ``.ckpt`` that ``myfsdp`` wrote.
- ``ddp_first`` / ``ddp_to_myfsdp``: ddp writes the step-4 ``.ckpt``; ``myfsdp`` resumes it.
- ``sharded_first`` / ``sharded_resumed``: the same with ``state_dict_type="sharded"`` (folders), ``last.ckpt`` a
  link to the newest folder (``save_last="link"``), resumed with ``ckpt_path="last"``. A second ``ModelCheckpoint``
  saves a folder every step and keeps the top 2 by ``step``, so it must remove steps 1 and 2; rank 0 writes its
  folder listing and ``best_k_models`` to OUT_DIR/topk.json.
- ``full_single``: one device (no process group in use) resumes the step-4 ``.ckpt``; rank 0 alone runs it.

``resume DEVICES MAIN_OUT [KILLED_OUT ...]`` (DEVICES processes):

- ``from_w2``: the sharded step-4 folder that ``main`` wrote on 2 ranks, resumed on DEVICES ranks.
- ``killed_<i>``: each run of tests/scripts/checkpoint_kill.py (killed while saving) resumed with
  ``ckpt_path="last"`` in its own checkpoint folder, which then keeps being saved into.

Usage: python tests/scripts/checkpoint_resume.py OUT_DIR main
       python tests/scripts/checkpoint_resume.py OUT_DIR resume DEVICES MAIN_OUT [KILLED_OUT ...]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from strategy_common import TINY, LitGPT, make_trainer, out_dir, write_json
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.checkpoint.full import full_optimizer_state
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

SAMPLES = 16
GLOBAL_BATCH = 4  # 4 steps an epoch: the step-4 checkpoint is the first epoch's last batch
STEPS = 8
STEP4 = "epoch=0-step=4.ckpt"


class Scheduled(LitGPT):
    """The tiny GPT with two parameter groups (weight decay on matrices only) and a learning rate that changes
    every step: a resume that lost the optimizer's groups or the scheduler's position would train differently."""

    def configure_optimizers(self) -> Any:
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=self.lr, eps=1e-5
        )
        scheduler = LambdaLR(optimizer, lambda step: 0.8**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(devices: int | None) -> DataLoader:
    """``devices`` ranks under a distributed strategy (Lightning adds the sampler), or None for one device, which
    gets the same sampler itself so that it sees the same shuffled order."""
    tokens = torch.randint(
        0, TINY.vocab_size, (SAMPLES, TINY.block_size + 1), generator=torch.Generator().manual_seed(1)
    )
    if devices is None:
        sampler = DistributedSampler(tokens, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(tokens, batch_size=GLOBAL_BATCH, sampler=sampler)
    return DataLoader(tokens, batch_size=GLOBAL_BATCH // devices, shuffle=True)


def weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The whole model's weights (on rank 0; a collective under ``myfsdp``)."""
    module = trainer.lightning_module
    if isinstance(trainer.strategy, FSDPStrategy):
        return full_state_dict(module)
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


class RecordStart(L.Callback):
    """The state the restore produced, taken when training starts: model, optimizer (full, positional, as in a
    full checkpoint), scheduler and loop position."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (optimizer,) = trainer.optimizers
        fsdp = isinstance(trainer.strategy, FSDPStrategy)
        # Copies: state_dict()s hold the live tensors, which training goes on to change.
        self.state = {
            "weights": weights(trainer),
            "optimizer": full_optimizer_state(pl_module, optimizer) if fsdp else copy.deepcopy(optimizer.state_dict()),
            "scheduler": copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
        }


def myfsdp(state_dict_type: str = "full") -> FSDPStrategy:
    return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type)


def every_n_steps(folder: Path, steps: int = 2, save_last: bool | Literal["link"] = True) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, every_n_train_steps=steps, save_top_k=-1, save_last=save_last)


def fit(
    name: str,
    strategy: Any,
    max_steps: int = STEPS,
    ckpt_path: str | Path | None = None,
    callbacks: list[L.Callback] | None = None,
    devices: int = 2,
) -> L.Trainer:
    """Fit ``Scheduled`` from seed 0; rank 0 saves what the run started from and ended with to OUT_DIR/<name>.pt."""
    L.seed_everything(0)
    start = RecordStart()
    trainer = make_trainer(
        strategy, max_steps=max_steps, devices=devices, enable_checkpointing=True, callbacks=[start, *(callbacks or [])]
    )
    trainer.fit(Scheduled(), loader(None if devices == 1 and strategy == "auto" else devices), ckpt_path=ckpt_path)
    final = weights(trainer)
    if trainer.global_rank == 0:
        result = {"start": start.state if ckpt_path else None, "final": final, "global_step": trainer.global_step}
        torch.save(result, out_dir() / f"{name}.pt")
    return trainer


def main_runs() -> None:
    out = out_dir()
    fit("straight", myfsdp())

    fit("full_first", myfsdp(), max_steps=4, callbacks=[every_n_steps(out / "full")])
    fit("full_resumed", myfsdp(), ckpt_path="last", callbacks=[every_n_steps(out / "full")])
    fit("full_ddp", "ddp", ckpt_path=out / "full" / STEP4)

    ddp_save = ModelCheckpoint(dirpath=out / "ddp", every_n_train_steps=4)
    fit("ddp_first", "ddp", max_steps=4, callbacks=[ddp_save])
    fit("ddp_to_myfsdp", myfsdp(), ckpt_path=out / "ddp" / STEP4)

    top_k = ModelCheckpoint(dirpath=out / "topk", monitor="step", mode="max", save_top_k=2, every_n_train_steps=1)
    every_2 = every_n_steps(out / "sharded", save_last="link")
    trainer = fit("sharded_first", myfsdp("sharded"), max_steps=4, callbacks=[every_2, top_k])
    write_json(
        trainer,
        "topk.json",
        {"listing": sorted(p.name for p in (out / "topk").iterdir()), "best_k": sorted(top_k.best_k_models)},
    )
    every_2 = every_n_steps(out / "sharded", save_last="link")
    fit("sharded_resumed", myfsdp("sharded"), ckpt_path="last", callbacks=[every_2])

    if dist.get_rank() == 0:  # one device needs one process; rank 1 has nothing left to do
        fit("full_single", "auto", ckpt_path=out / "full" / STEP4, devices=1)


def resume_runs(devices: int, main_out: Path, killed: list[Path]) -> None:
    fit("from_w2", myfsdp("sharded"), ckpt_path=main_out / "sharded" / STEP4, devices=devices)
    for index, folder in enumerate(killed):
        state_dict_type = "sharded" if (folder / "ckpts" / "last.ckpt").is_dir() else "full"
        callbacks = [every_n_steps(folder / "ckpts", steps=4)]
        fit(f"killed_{index}", myfsdp(state_dict_type), ckpt_path="last", callbacks=callbacks, devices=devices)


def main() -> None:
    if sys.argv[2] == "main":
        main_runs()
    else:
        resume_runs(int(sys.argv[3]), Path(sys.argv[4]), [Path(p) for p in sys.argv[5:]])


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
