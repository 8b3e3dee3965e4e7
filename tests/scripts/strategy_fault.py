"""Rank 1 fails in the middle of fit; rank 0 must exit with an error, not wait forever.

- ``kill``: rank 1 SIGKILLs itself; rank 0's next collective finds the connection gone.
- ``stall``: rank 1 stops answering (sleeps); only the strategy's 20 s timeout can end rank 0's wait.

The test starts both ranks itself with LOCAL_RANK set, so Lightning's launcher and its child-process watchdog are
not involved: what ends rank 0 is its own collective failing. Rank 1 writes the time it fails to OUT_DIR/failed_at.

Usage: LOCAL_RANK=<r> MASTER_ADDR=... MASTER_PORT=... python tests/scripts/strategy_fault.py OUT_DIR kill|stall
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
from strategy_common import LitGPT, make_trainer, out_dir, token_loader

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

TIMEOUT = timedelta(seconds=20)
FAIL_AT_BATCH = 2


class FailRankOne(L.Callback):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank == 1 and idx == FAIL_AT_BATCH:
            (out_dir() / "failed_at").write_text(str(time.time()))
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # the test kills this rank once rank 0 is gone


def main() -> None:
    L.seed_everything(0)
    strategy = FSDPStrategy(auto_wrap_policy={Block}, timeout=TIMEOUT)
    trainer = make_trainer(strategy, max_steps=50, callbacks=[FailRankOne(sys.argv[2])])
    trainer.fit(LitGPT(), token_loader(200, batch_size=2))


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
