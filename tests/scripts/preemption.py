"""Signals sent to a rank from inside a training batch, under ``SLURMEnvironment(auto_requeue=True)``.

The test starts both ranks itself with SLURM's variables set (as ``srun`` would), so no Lightning launcher is
involved, and puts a fake ``scontrol`` on PATH that records its arguments. Six batches, three an epoch. A signal that
arrives in ``training_step`` is acted on at the end of that same batch; one that arrives after the rank sent its flags
(in the module's ``on_before_optimizer_step``, which runs after the callbacks', so inside the optimizer step) at the
end of the next batch (see [Note: agreement behind the optimizer step] in lightning_fsdp/trainer/preemption.py). The
resumed runs' signals come in batch 3, so the HPC checkpoint lands on the epoch's last batch (a plain DataLoader
cannot resume mid-epoch).

- ``requeue``: ``straight`` (never signalled, the reference); ``one_rank``: rank 1 sends itself SIGUSR1 after its
  forward in batch 3, full checkpoints, and the run goes on to step 6 (the fake ``scontrol`` does not stop it); then
  a new Trainer in the same folder resumes from the HPC checkpoint on its own (Lightning's restore under SLURM);
  ``both_ranks``: rank 0 sends it before its forward and rank 1 after, sharded checkpoints, resumed with
  ``ckpt_path="hpc"``. Rank 0 writes OUT_DIR/<run>.pt: the final weights and the step the run started from.
  No resume for the others, whose HPC checkpoints' steps the test reads:
  ``apart``: rank 0 sends it in batch 1's ``training_step``, rank 1 inside batch 3's optimizer step, rank 0 inside the
  last batch's (6): acted on after steps 1, 4 and, at the end of training, 6.
  ``accumulated`` (``accumulate_grad_batches=2``: steps in batches 2, 3 (the epoch's last), 5, 6): rank 1 sends it in
  batch 1, which does not step (acted on at its end, after step 0), rank 0 inside batch 2's optimizer step (acted on
  at the end of batch 3, after step 2).
  ``manual`` (manual optimization, one ``optimizer.step()`` per batch): rank 0 sends it in batch 2 before its step
  (acted on at the batch's end, after step 2), rank 1 in batch 4 after its step (at the end of batch 5, step 5).
- ``sigterm``: rank 1 sends itself SIGTERM after its forward in batch 2 (writing the time to OUT_DIR/signalled_at);
  the strategy's timeout is 600 s, and ``OnExceptionCheckpoint`` saves when the ranks stop. Each rank prints how it
  ended and leaves with its exit status (143 for Lightning's ``SIGTERMException``, 1 for an error).

Usage: SLURM_PROCID=<r> ... python tests/scripts/preemption.py OUT_DIR requeue|sigterm
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from strategy_common import LitGPT, make_trainer, out_dir, token_loader

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

STEPS_PER_EPOCH = 3
STEPS = 6
BATCH = 2


class SignalledInsideStep(LitGPT):
    """The tiny GPT that sends ``signum`` to its own process inside a training batch, on the ranks of ``when``:
    rank -> [(the batch, counted from 1 in this fit; the moment)]. Moments: ``"before"`` or ``"after"`` the forward
    in ``training_step``, ``"late"`` in ``on_before_optimizer_step`` (after the strategy's callback sent its flags).
    ``manual``: manual optimization, one step a batch, ``"before"`` and ``"after"`` being around ``optimizer.step()``.
    """

    def __init__(
        self, when: dict[int, list[tuple[int, str]]], signum: int = signal.SIGUSR1, manual: bool = False
    ) -> None:
        super().__init__()
        self.signum = signum
        self.when = when
        self.batches = 0
        self.automatic_optimization = not manual

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.batches += 1
        if self.automatic_optimization:
            self._send_at("before")
            loss = super().training_step(batch, batch_idx)
            self._send_at("after")
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self._send_at("before")
        optimizer.step()
        self._send_at("after")
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._send_at("late")

    def _send_at(self, moment: str) -> None:
        if (self.batches, moment) not in self.when.get(self.global_rank, []):
            return
        if self.signum == signal.SIGTERM:
            (out_dir() / "signalled_at").write_text(str(time.time()))
        os.kill(os.getpid(), self.signum)


class RecordStartStep(L.Callback):
    def __init__(self) -> None:
        self.step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step


def fit(
    name: str,
    make_model: Callable[[], LitGPT],
    state_dict_type: str = "full",
    ckpt_path: str | None = None,
    **trainer_options: Any,
) -> None:
    """Fit the model ``make_model`` builds from seed 0, in OUT_DIR/<run> (``name`` is ``<run>-<what>``)."""
    L.seed_everything(0)
    model = make_model()
    start = RecordStartStep()
    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type)
    trainer = make_trainer(
        strategy,
        max_steps=STEPS,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        default_root_dir=out_dir() / name.split("-")[0],
        callbacks=[start],
        **trainer_options,
    )
    trainer.fit(model, token_loader(STEPS_PER_EPOCH * 2 * BATCH, batch_size=BATCH), ckpt_path=ckpt_path)
    final = full_state_dict(trainer.lightning_module)
    if trainer.global_rank == 0:
        torch.save({"final": final, "start_step": start.step}, out_dir() / f"{name}.pt")


def requeue() -> None:
    fit("straight", LitGPT)
    fit("one_rank-signalled", lambda: SignalledInsideStep({1: [(3, "after")]}))
    fit("one_rank-resumed", LitGPT)
    fit("both_ranks-signalled", lambda: SignalledInsideStep({0: [(3, "before")], 1: [(3, "after")]}), "sharded")
    fit("both_ranks-resumed", LitGPT, state_dict_type="sharded", ckpt_path="hpc")
    fit("apart-signalled", lambda: SignalledInsideStep({0: [(1, "after"), (6, "late")], 1: [(3, "late")]}))
    fit(
        "accumulated-signalled",
        lambda: SignalledInsideStep({0: [(2, "late")], 1: [(1, "after")]}),
        accumulate_grad_batches=2,
    )
    fit(
        "manual-signalled",
        lambda: SignalledInsideStep({0: [(2, "before")], 1: [(4, "after")]}, manual=True),
    )


def sigterm() -> None:
    L.seed_everything(0)
    strategy = FSDPStrategy(auto_wrap_policy={Block}, timeout=timedelta(seconds=600))
    trainer = make_trainer(
        strategy,
        max_steps=50,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        default_root_dir=out_dir() / "term",
        callbacks=[OnExceptionCheckpoint(out_dir() / "term")],
        enable_checkpointing=True,
    )
    model = SignalledInsideStep({1: [(2, "after")]}, signal.SIGTERM)
    trainer.fit(model, token_loader(200, batch_size=BATCH))


def leave(status: int) -> None:
    """Exit at once with ``status``, skipping the interpreter's shutdown (see [Note: gloo exit race])."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    if sys.argv[2] == "requeue":
        requeue()
        exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
    try:
        sigterm()
    except SystemExit as stop:
        print(f"left with {type(stop).__name__}({stop.code})", flush=True)
        leave(stop.code if isinstance(stop.code, int) else 1)
    except Exception:
        traceback.print_exc()
        leave(1)
    print("sigterm run finished without stopping", flush=True)
    leave(0)
