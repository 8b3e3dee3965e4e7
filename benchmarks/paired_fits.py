"""What the "with / without" benchmarks share (``bench_signals.py``, ``bench_monitor.py``): two ranks started as
subprocesses of the script itself, the same quiet fit in each variant, and the paired ratio of their step times.

Why paired: on a shared 2-core machine the speed moves by tens of percent between runs, far more than the few tenths
of a percent these features cost. Running "with" and "without" one after the other in the same two processes, round
by round, lets the noise hit both; the ratio of each round's pair is what is compared, and its median over rounds
reported with its range.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.runtime.launch import free_port

VARIANTS = ("with", "without")


class StepClock(Callback):
    """Batch-start times: a step is the time from one ``on_train_batch_start`` to the next."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def step_times(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)][warmup:]


def quiet_trainer(max_steps: int, callbacks: Sequence[Callback], **kwargs: Any) -> Trainer:
    """Two CPU ranks under ``FSDPStrategy(auto_wrap_policy={Block})``, with everything not under test turned off."""
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy={Block}),
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **kwargs,
    )


def share_records(records: list[dict[str, Any]], out: str) -> None:
    """Every rank's records, written by rank 0 to ``out`` (a list with one list of records per rank)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))


def run_two_ranks(script: str, argv: list[str], timeout: float) -> list[list[dict[str, Any]]]:
    """Run ``script argv --out FILE`` as ranks 0 and 1 (``LOCAL_RANK`` set, one thread each) and return what they
    wrote to ``FILE`` with :func:`share_records`."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "records.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        env.update({"WORLD_SIZE": "2", "NODE_RANK": "0"})
        command = [sys.executable, script, *argv, "--out", str(out)]
        ranks = [subprocess.Popen(command, env={**env, "LOCAL_RANK": str(rank)}) for rank in (0, 1)]
        try:
            for rank in ranks:
                if rank.wait(timeout=timeout) != 0:
                    raise SystemExit(f"a rank exited with {rank.returncode}")
        finally:
            for rank in ranks:
                rank.kill()
                rank.wait()
        return json.loads(out.read_text())


def paired_summary(
    gathered: list[list[dict[str, Any]]],
    rounds: int,
    measures: Callable[[Sequence[dict[str, Any]], list[float]], dict[str, float]],
    average: Callable[[Sequence[float]], float] = statistics.median,
) -> dict[str, Any]:
    """Per step the slower rank counts; per round the ratio of the variants' ``average`` step; over rounds the
    median ratio and its range. ``measures(run, steps)`` gives a fit's own numbers (``run``: each rank's record of
    it, ``steps``: its step times), reported as the median over rounds of the "with" variant's."""
    per_round: dict[int, dict[str, dict[str, float]]] = {}
    for run in zip(*gathered, strict=True):  # the same fit on every rank
        steps = [max(times) for times in zip(*(record["steps_s"] for record in run), strict=True)]
        per_round.setdefault(run[0]["round"], {})[run[0]["variant"]] = {
            "step_s": average(steps),
            **measures(run, steps),
        }
    ratios = [per_round[r]["with"]["step_s"] / per_round[r]["without"]["step_s"] for r in range(rounds)]
    own = {key: statistics.median(per_round[r]["with"][key] for r in range(rounds)) for key in per_round[0]["with"]}
    return {
        **own,
        "rounds": per_round,
        "step_with_s": own["step_s"],
        "step_without_s": statistics.median(per_round[r]["without"]["step_s"] for r in range(rounds)),
        "ratio_median": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
    }


def slowest_rank(run: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Per step, the larger of the ranks' ``key`` values."""
    return [max(values) for values in zip(*(record[key] for record in run), strict=False)]
