"""What a sweep of fits in one process keeps: each rank's memory, memory-file mappings, descriptors and threads.

    python benchmarks/sweep_leaks.py                          # 5 fits each of myfsdp and ddp, the issue's 8.5M model
    python benchmarks/sweep_leaks.py --fits 20 --blocks 2     # longer, on a smaller model
    python benchmarks/sweep_leaks.py --gloo                   # myfsdp without shared memory

An Optuna-style sweep, or a notebook: one short ``Trainer(devices=2).fit`` after another in the same two processes
(Lightning's launcher starts rank 1 by running this file again), each trainer and model dropped afterwards (``del``,
``gc.collect()``). After every fit each rank reads from ``/proc/self``: its resident memory (``VmRSS``; ``live``: the
same once malloc has given back the free memory it keeps for reuse, ``malloc_trim``), its mappings of anonymous
memory files (``/memfd:`` in ``maps``: the engine's shared-memory segments) with their size, its open descriptors,
and its threads (Python's and the kernel's tasks, gloo's C++ threads included). Each strategy runs in processes of
its own, so one's leftovers cannot show in the other's figures. Rank 0's figures are printed per fit; ``--json``
writes both ranks'.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fsdp.runtime.process_exit import exit_after_distributed_run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="myfsdp,ddp", help="comma-separated; each in processes of its own")
    parser.add_argument("--fits", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024, help="each block is a width x width Linear")
    parser.add_argument("--blocks", type=int, default=8, help="8 blocks of 1024: 8.4M parameters")
    parser.add_argument("--steps", type=int, default=2, help="training steps per fit")
    parser.add_argument("--gloo", action="store_true", help="myfsdp over gloo only (LIGHTNING_FSDP_SHARED_MEMORY=0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every rank's figures here")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # the strategy these ranks run (internal)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # where the ranks write (internal)
    return parser.parse_args(argv)


class Blocks(LightningModule):
    """``blocks`` Linear layers of ``width``, each in a block of its own (the default policy's units)."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.blocks(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def resident_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


def resources() -> dict[str, float]:
    """This process's footprint, from ``/proc/self``."""
    rss_mb = resident_mb()
    ctypes.CDLL(None).malloc_trim(0)
    memfd = [line for line in Path("/proc/self/maps").read_text().splitlines() if "/memfd:" in line]
    memfd_bytes = 0
    for line in memfd:
        start, end = (int(address, 16) for address in line.split()[0].split("-"))
        memfd_bytes += end - start
    return {
        "rss_mb": rss_mb,
        "live_mb": resident_mb(),
        "memfd_mappings": len(memfd),
        "memfd_mb": memfd_bytes / 2**20,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
    }


def one_fit(strategy: str, args: argparse.Namespace) -> float:
    data = TensorDataset(torch.randn(8 * args.steps, args.width))
    model = Blocks(args.width, args.blocks)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    started = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=4))
    return time.perf_counter() - started


def run_ranks(args: argparse.Namespace) -> None:
    """Inside a rank: the sweep, then this rank's figures into OUT/rank<r>.json."""
    torch.set_num_threads(1)
    records = []
    for fit in range(args.fits):
        seconds = one_fit(args.run, args)
        gc.collect()
        records.append({"fit": fit + 1, "fit_s": seconds, **resources()})
    rank = dist.get_rank()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()  # the process group stays up between fits (as Lightning keeps it): rank 0 reads both files after
    exit_after_distributed_run()


def sweep(strategy: str, args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """Run the sweep for ``strategy`` in two fresh processes; every rank's records."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.gloo:
            env["LIGHTNING_FSDP_SHARED_MEMORY"] = "0"
        command = [sys.executable, __file__, *sys.argv[1:], "--run", strategy, "--out", out]
        ran = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if ran.returncode != 0:
            raise SystemExit(f"the {strategy} sweep failed:\n{ran.stderr[-5000:]}")
        return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in (0, 1)]


def print_table(results: dict[str, list[list[dict[str, Any]]]]) -> None:
    columns = ("rss_mb", "live_mb", "memfd_mappings", "memfd_mb", "fds", "threads", "tasks", "fit_s")
    for strategy, ranks in results.items():
        print(f"\n{strategy}, rank 0, after each fit")
        print("| fit | " + " | ".join(columns) + " |")
        print("|---:|" + "---:|" * len(columns))
        for record in ranks[0]:
            cells = [f"{record[c]:.0f}" if c != "fit_s" else f"{record[c]:.1f}" for c in columns]
            print(f"| {record['fit']} | " + " | ".join(cells) + " |")


def main() -> None:
    args = parse_args()
    if args.run is not None:
        run_ranks(args)
        return
    results = {name: sweep(name, args) for name in args.strategies.split(",")}
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
