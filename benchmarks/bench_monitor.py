"""What ``FSDPMonitor`` costs per training step at its default interval: 2 CPU ranks, a GPT of LLM proportions.

    python benchmarks/bench_monitor.py                      # vocab 8192, width 512, 4 blocks, 2 rounds of 60 steps
    python benchmarks/bench_monitor.py --n-layer 2 --n-embd 128 --vocab 1024 --steps 8 --every-n-steps 4 --rounds 1
                                                            # a smoke test

The monitor must stay on in every run, so its cost must be noise: two counter copies and two clock readings per
step, one all-gather of a few dozen numbers and one line of JSON per interval (and, on the engine's side, a few
attribute updates per collective, present in both variants: ``engine/step_stats.py`` is always on). Two numbers:

- "the monitor's own time": what its hooks took, timed from outside around ``on_train_batch_start`` and
  ``on_train_batch_end`` (the interval's report included), per step, the larger rank's; against the step.
- "step time with / without": the same fit with the monitor and without it, interleaved in the same two processes
  round by round so that the shared machine's noise hits both; a step is the time from one ``on_train_batch_start``
  to the next, the slower rank's, the first ``--warmup`` left out, and the mean over steps (the interval's step
  counts: a median would hide it). The paired ratio is the median over rounds of each round's ratio.

Both ranks are started here with ``LOCAL_RANK`` set (no Lightning launcher), one thread each, and run every fit one
after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_fsdp import FSDPMonitor, FSDPStrategy
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.runtime.launch import free_port
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

VARIANTS = ("with", "without")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each fit")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per fit (the interval's report included)")
    parser.add_argument("--every-n-steps", type=int, default=50, help="the monitor's interval (its default: 50)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each fits with, then without")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set for the ranks (internal)
    return parser.parse_args(argv)


class LanguageModel(LightningModule):
    """The demo GPT with untied embedding and head, as most LLMs have, on integer token ids."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.model = GPT(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch[:, :-1], batch[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepClock(Callback):
    """Batch-start times."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())


def timed_hooks(monitor: FSDPMonitor, spent: list[float]) -> None:
    """Add the time each of ``monitor``'s batch hooks takes to ``spent`` (one entry per batch)."""
    start_hook, end_hook = monitor.on_train_batch_start, monitor.on_train_batch_end

    def on_start(*args: Any) -> None:
        began = time.perf_counter()
        start_hook(*args)
        spent.append(time.perf_counter() - began)

    def on_end(*args: Any) -> None:
        began = time.perf_counter()
        end_hook(*args)
        spent[-1] += time.perf_counter() - began

    monitor.on_train_batch_start = on_start  # type: ignore[method-assign]
    monitor.on_train_batch_end = on_end  # type: ignore[method-assign]


def run_rank(args: argparse.Namespace) -> None:
    """Fit ``rounds`` x (with, without); rank 0 writes every rank's numbers to ``args.out``."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    config = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        tie_weights=False,
    )
    steps = args.warmup + args.steps + 1  # the last step's end is the next start: one more
    generator = torch.Generator().manual_seed(int(os.environ["LOCAL_RANK"]))
    data = torch.randint(0, args.vocab, (steps * args.batch_size, args.block_size + 1), generator=generator)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                seed_everything(0, verbose=False)
                clock, spent = StepClock(), []
                callbacks: list[Callback] = [clock]
                if variant == "with":
                    monitor = FSDPMonitor(every_n_steps=args.every_n_steps, dirpath=folder)
                    timed_hooks(monitor, spent)
                    callbacks.append(monitor)
                trainer = Trainer(
                    accelerator="cpu",
                    devices=2,
                    strategy=FSDPStrategy(auto_wrap_policy={Block}),
                    max_steps=steps,
                    limit_val_batches=0,
                    num_sanity_val_steps=0,
                    logger=False,
                    enable_checkpointing=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    use_distributed_sampler=False,
                    callbacks=callbacks,
                )
                trainer.fit(LanguageModel(config), DataLoader(data, batch_size=args.batch_size))
                step_times = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)][args.warmup :]
                records.append(
                    {
                        "round": round_index,
                        "variant": variant,
                        "steps_s": step_times,
                        "monitor_s": spent[args.warmup : args.warmup + len(step_times)],
                    }
                )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))


def summarize(gathered: list[list[dict[str, Any]]], rounds: int) -> dict[str, Any]:
    """Per step the slower rank counts; per round the ratio of mean steps; over rounds their median."""
    per_round: dict[int, dict[str, dict[str, float]]] = {}
    for run in zip(*gathered, strict=True):  # the same fit on every rank
        steps = [max(times) for times in zip(*(r["steps_s"] for r in run), strict=True)]
        spent = [max(times) for times in zip(*(r["monitor_s"] for r in run), strict=True)]
        per_round.setdefault(run[0]["round"], {})[run[0]["variant"]] = {
            "step_s": statistics.mean(steps),
            "monitor_s": statistics.mean(spent) if spent else 0.0,
            "monitor_max_s": max(spent) if spent else 0.0,
        }
    ratios = [per_round[r]["with"]["step_s"] / per_round[r]["without"]["step_s"] for r in range(rounds)]
    return {
        "rounds": per_round,
        "step_with_s": statistics.median(per_round[r]["with"]["step_s"] for r in range(rounds)),
        "step_without_s": statistics.median(per_round[r]["without"]["step_s"] for r in range(rounds)),
        "monitor_s": statistics.median(per_round[r]["with"]["monitor_s"] for r in range(rounds)),
        "monitor_max_s": max(per_round[r]["with"]["monitor_max_s"] for r in range(rounds)),
        "ratio_median": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.out is not None:
        run_rank(args)
        exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
        return
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "records.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        env.update({"WORLD_SIZE": "2", "NODE_RANK": "0"})
        command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--out", str(out)]
        ranks = [subprocess.Popen(command, env={**env, "LOCAL_RANK": str(rank)}) for rank in (0, 1)]
        try:
            for rank in ranks:
                if rank.wait(timeout=args.timeout) != 0:
                    raise SystemExit(f"a rank exited with {rank.returncode}")
        finally:
            for rank in ranks:
                rank.kill()
                rank.wait()
        summary = summarize(json.loads(out.read_text()), args.rounds)
    low, high = summary["ratio_range"]
    step = summary["step_with_s"]
    print(
        f"step time with the monitor {step * 1e3:.1f} ms, without {summary['step_without_s'] * 1e3:.1f} ms "
        f"(paired ratio {summary['ratio_median']:.4f}, range {low:.4f}-{high:.4f} over {args.rounds} rounds); "
        f"the monitor's own time {summary['monitor_s'] * 1e6:.0f} us a step, {summary['monitor_s'] / step:.3%} of "
        f"the step (its interval's step {summary['monitor_max_s'] * 1e3:.2f} ms, every {args.every_n_steps} steps)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **summary}, indent=2))


if __name__ == "__main__":
    main()
