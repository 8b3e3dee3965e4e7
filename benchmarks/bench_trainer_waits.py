"""Where each rank waits for the other under ``Trainer(strategy="myfsdp")``: every shared-memory wait, by its site.

    python benchmarks/bench_trainer_waits.py                      # issue 10's 27.4M GPT, 2 CPU processes, ~1 minute
    python benchmarks/bench_trainer_waits.py --n-layer 2 --n-embd 128 --n-head 4 --steps 3   # a smoke test

One fit of ``LitGPT`` with no strategy argument (the no-argument units), as ``bench_trainer.py`` runs it. Every wait
of the shared-memory transport (``SharedMemoryTransport._await_peers``, wrapped for this run only) is recorded with
what it waited for -- a peer's data ("data": its shards of a gather, its rows of a reduction) or a peer's reading of
a slot before it is written again ("slot") -- and the collective's unit. After the warm-up steps, each rank prints
its mean wait per step at every site, and per step the time its training thread spent off the CPU
(``time.thread_time``). Their difference is what the thread waited outside these waits (the clipping all-reduce,
a core taken by another thread).

Why it exists: ours' step differs from the module alone (``bench_trainer.py --impls plain``) by its copies and by
these waits, and the waits say whether the ranks are held back unit by unit (many small waits at the gathers) or
once a step by the slower one (one wait where backward ends).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from typing_extensions import override

_REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("lightning_fsdp") is None:
    sys.path.insert(0, str(_REPO_ROOT))

from bench_trainer import timing_trainer  # noqa: E402

from lightning_fsdp.demos.datamodule import CharDataModule  # noqa: E402
from lightning_fsdp.demos.lit_gpt import LitGPT  # noqa: E402
from lightning_fsdp.engine import shm  # noqa: E402
from lightning_fsdp.runtime.process_exit import exit_now  # noqa: E402

WAITS: list[tuple[float, float, str, str]] = []  # (start, seconds, "data" or "slot", unit)


def record_waits() -> None:
    """Wrap the transport's one waiting method so that every wait is timed (this process only)."""
    wait = shm.SharedMemoryTransport._await_peers

    def timed(transport: Any, slots: Any, slot: int, counter: int, value: int, sequence: int, stamp: Any, what: str):
        start = time.perf_counter()
        wait(transport, slots, slot, counter, value, sequence, stamp, what)
        site = "data" if "data" in what else "slot"
        WAITS.append((start, time.perf_counter() - start, site, stamp.label if stamp is not None else "-"))

    shm.SharedMemoryTransport._await_peers = timed


class StepMarks(Callback):
    """Each step's start and end, in wall and thread CPU time; rank 0 writes every rank's record."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[tuple[float, float, float, float]] = []
        self._start = (0.0, 0.0)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = (time.perf_counter(), time.thread_time())

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps.append((*self._start, time.perf_counter(), time.thread_time()))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        mine = {"steps": self.steps, "waits": WAITS}
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, mine)
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(gathered))


def fit(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    seed_everything(0, verbose=False)
    record_waits()
    trainer = timing_trainer("myfsdp", 2, args.warmup + args.steps, StepMarks(args.out))
    model = LitGPT(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=128, warmup_steps=0, min_lr_ratio=1.0
    )
    trainer.fit(model, datamodule=CharDataModule(max_bytes=1_000_000, block_size=128, batch_size=4))


def report(ranks: list[dict[str, Any]], warmup: int) -> list[str]:
    lines = []
    for rank, record in enumerate(ranks):
        steps = record["steps"][warmup:]
        per_site: dict[tuple[str, str], float] = defaultdict(float)
        for start, seconds, site, unit in record["waits"]:
            if any(begin <= start < end for begin, _, end, _ in steps):
                per_site[(site, unit)] += seconds
        off_cpu = [(end - begin) - (cpu_end - cpu_begin) for begin, cpu_begin, end, cpu_end in steps]
        total = sum(per_site.values()) / len(steps)
        lines.append(
            f"rank {rank}: waits {total * 1e3:.0f} ms a step; off CPU per step (ms): "
            + " ".join(f"{t * 1e3:.0f}" for t in off_cpu)
            + f" (median {statistics.median(off_cpu) * 1e3:.0f})"
        )
        for (site, unit), seconds in sorted(per_site.items(), key=lambda item: -item[1]):
            if seconds / len(steps) >= 0.5e-3:
                lines.append(f"    {seconds / len(steps) * 1e3:6.1f} ms  {site:4s} {unit}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=5)
    parser.add_argument("--n-embd", type=int, default=672)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set: this process is one of the fit's ranks
    args = parser.parse_args()
    if args.out is not None:
        fit(args)
        exit_now()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "waits.json"
        command = [sys.executable, __file__, "--out", str(out)]
        for name in ("n_layer", "n_embd", "n_head", "warmup", "steps"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        print("\n".join(report(json.loads(out.read_text()), args.warmup)))


if __name__ == "__main__":
    main()
