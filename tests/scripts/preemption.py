"""Signals sent to a rank from inside ``training_step``, under ``SLURMEnvironment(auto_requeue=True)``.

The test starts both ranks itself with SLURM's variables set (as ``srun`` would), so no Lightning launcher is
involved, and puts a fake ``scontrol`` on PATH that records its arguments. Six steps, three an epoch; the signals come
in step 2 and are acted on at the end of step 3 (see [Note: agreement a batch late] in
lightning_fsdp/trainer/preemption.py), so the HPC checkpoint lands on the epoch's last batch (a plain DataLoader
cannot resume mid-epoch).

- ``requeue``: ``straight`` (never signalled, the reference); ``one_rank``: rank 1 sends itself SIGUSR1 after its
  forward in step 2, full checkpoints, and the run goes on to step 6 (the fake ``scontrol`` does not stop it); then
  a new Trainer in the same folder resumes from the HPC checkpoint on its own (Lightning's restore under SLURM);
  ``both_ranks``: rank 0 sends it before its forward and rank 1 after, sharded checkpoints, resumed with
  ``ckpt_path="hpc"``. Rank 0 writes OUT_DIR/<run>.pt: the final weights and the step the run started from.
  ``apart``: rank 0 sends it in step 1, rank 1 in step 4: two HPC checkpoints (after steps 2 and 5), no resume.
- ``sigterm``: rank 1 sends itself SIGTERM after its forward in step 2 (writing the time to OUT_DIR/signalled_at);
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

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from strategy_common import LitGPT, make_trainer, out_dir, token_loader

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.engine.state_dict import full_state_dict
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

STEPS_PER_EPOCH = 3
STEPS = 6
BATCH = 2


class SignalledInsideStep(LitGPT):
    """The tiny GPT that sends ``signum`` to its own process inside ``training_step``, on the ranks of ``when``:
    rank -> (the step, ``"before"`` or ``"after"`` the forward)."""

    def __init__(self, when: dict[int, tuple[int, str]], signum: int = signal.SIGUSR1) -> None:
        super().__init__()
        self.signum = signum
        self.when = when

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step, moment = self.when.get(self.global_rank, (0, ""))
        moment = moment if self.global_step == step - 1 else ""
        if moment == "before":
            self._send()
        loss = super().training_step(batch, batch_idx)
        if moment == "after":
            self._send()
        return loss

    def _send(self) -> None:
        if self.signum == signal.SIGTERM:
            (out_dir() / "signalled_at").write_text(str(time.time()))
        os.kill(os.getpid(), self.signum)


class RecordStartStep(L.Callback):
    def __init__(self) -> None:
        self.step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step


def fit(
    name: str, make_model: Callable[[], LitGPT], state_dict_type: str = "full", ckpt_path: str | None = None
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
    )
    trainer.fit(model, token_loader(STEPS_PER_EPOCH * 2 * BATCH, batch_size=BATCH), ckpt_path=ckpt_path)
    final = full_state_dict(trainer.lightning_module)
    if trainer.global_rank == 0:
        torch.save({"final": final, "start_step": start.step}, out_dir() / f"{name}.pt")


def requeue() -> None:
    fit("straight", LitGPT)
    fit("one_rank-signalled", lambda: SignalledInsideStep({1: (2, "after")}))
    fit("one_rank-resumed", LitGPT)
    fit("both_ranks-signalled", lambda: SignalledInsideStep({0: (2, "before"), 1: (2, "after")}), "sharded")
    fit("both_ranks-resumed", LitGPT, state_dict_type="sharded", ckpt_path="hpc")
    fit("apart-signalled", lambda: SignalledInsideStep({0: (1, "after"), 1: (4, "before")}))


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
    model = SignalledInsideStep({1: (2, "after")}, signal.SIGTERM)
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
