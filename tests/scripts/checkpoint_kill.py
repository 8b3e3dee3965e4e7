"""A save killed mid-write: SIGKILL of the whole process group while ``last.ckpt`` is being rewritten at step 8.

``myfsdp`` on 2 processes saves every 4 steps (``epoch=<e>-step=<n>.ckpt`` then ``last.ckpt``, each a whole save)
into OUT_DIR/ckpts. At step 8, after ``epoch=1-step=8.ckpt`` is complete, the save of ``last.ckpt`` is interrupted
in the middle of writing its bytes: for ``full``, rank 0 has written half of the file; for ``sharded``, rank 0 has
written one item of its DCP shard file (every rank writes its own). Rank 0 then SIGKILLs its process group, which
holds both ranks (the test starts this script in a new session). What the folder must hold afterwards:
``last.ckpt`` still the complete step-4 checkpoint, the partial write only under a ``.partial-*`` name.
tests/scripts/checkpoint_resume.py then resumes from ``last`` (an epoch boundary, so the resumed run sees the data
the uninterrupted one did).

Usage: python tests/scripts/checkpoint_kill.py OUT_DIR full|sharded
"""

from __future__ import annotations

import io
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from checkpoint_resume import Scheduled, every_n_steps, loader, myfsdp
from strategy_common import make_trainer, out_dir

from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

KILL_AT_STEP = 8
armed = {"on": False}  # set on rank 0 for the save to interrupt


def die() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


class KillDuringSecondSave(L.Callback):
    """At step 8, arms the kill for the second save from now (``last.ckpt``; ModelCheckpoint runs after this)."""

    def __init__(self) -> None:
        self.saves = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != KILL_AT_STEP:
            return
        save = trainer.strategy.save_checkpoint

        def counted(*args: Any, **kwargs: Any) -> None:
            self.saves += 1
            armed["on"] = self.saves == 2 and dist.get_rank() == 0
            save(*args, **kwargs)

        trainer.strategy.save_checkpoint = counted  # type: ignore[method-assign]


def half_then_die(real_save: Callable[..., None]) -> Callable[..., None]:
    """``torch.save`` that, when armed, writes the first half of the file and kills the group."""

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not armed["on"] or not isinstance(f, str | os.PathLike):
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        with open(f, "wb") as handle:
            handle.write(buffer.getbuffer()[: buffer.tell() // 2])
            handle.flush()
            os.fsync(handle.fileno())
        die()

    return save


def one_item_then_die(real_write_item: Callable[..., Any]) -> Callable[..., Any]:
    """DCP's per-item writer that, when armed, writes one item of the shard file and kills the group."""

    def write_item(transforms: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
        result = real_write_item(transforms, stream, *args, **kwargs)
        if armed["on"]:
            stream.flush()
            os.fsync(stream.fileno())
            die()
        return result

    return write_item


def main() -> None:
    mode = sys.argv[2]
    if mode == "full":
        torch.save = half_then_die(torch.save)
    else:
        dcp_filesystem._write_item = one_item_then_die(dcp_filesystem._write_item)
    L.seed_everything(0)
    callbacks = [KillDuringSecondSave(), every_n_steps(out_dir() / "ckpts", steps=4)]
    trainer = make_trainer(myfsdp(mode), max_steps=KILL_AT_STEP, enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(Scheduled(), loader(2))
    raise AssertionError(f"the save at step {KILL_AT_STEP} should have killed this run")


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
