"""What ``FSDPMonitor`` costs per training step at its default interval: 2 CPU ranks, a GPT of LLM proportions.

    python benchmarks/bench_monitor.py                      # vocab 8192, width 512, 4 blocks, 2 rounds of 60 steps
    python benchmarks/bench_monitor.py --n-layer 2 --n-embd 128 --vocab 1024 --steps 8 --every-n-steps 4 --rounds 1
                                                            # a smoke test

The monitor must stay on in every run, so its cost must be noise: two counter copies and two clock readings per
step, one all-gather of a few dozen numbers and one line of JSON per interval (and, on the engine's side, a few
attribute updates per collective, present in both variants: ``engine/diagnostics/step_stats.py`` is always on). Two
numbers:

- "the monitor's own time": what its hooks took, timed from outside around ``on_train_batch_start`` and
  ``on_train_batch_end`` (the interval's report included), per step, the larger rank's; against the step.
- "step time with / without": the same fit with the monitor and without it, interleaved in the same two processes
  round by round so that the shared machine's noise hits both; a step is the time from one ``on_train_batch_start``
  to the next, the slower rank's, the first ``--warmup`` left out, and the mean over steps (the interval's step
  counts: a median would hide it). The paired ratio is the median over rounds of each round's ratio.

Both ranks are started here with ``LOCAL_RANK`` set (no Lightning launcher), one thread each, and run every fit one
after the other (``paired_fits.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, seed_everything
from paired_fits import VARIANTS, StepClock, paired_summary, quiet_trainer, run_two_ranks, share_records, slowest_rank
from torch.utils.data import DataLoader

from lightning_fsdp import FSDPMonitor
from lightning_fsdp.demos.gpt import GPT, GPTConfig
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run


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
                trainer = quiet_trainer(steps, callbacks, use_distributed_sampler=False)
                trainer.fit(LanguageModel(config), DataLoader(data, batch_size=args.batch_size))
                step_times = clock.step_times(args.warmup)
                records.append(
                    {
                        "round": round_index,
                        "variant": variant,
                        "steps_s": step_times,
                        "monitor_s": spent[args.warmup : args.warmup + len(step_times)],
                    }
                )
    share_records(records, args.out)


def monitor_times(run: Any, steps: list[float]) -> dict[str, float]:
    """The monitor's mean time a step and its longest (the step that ends an interval), the slower rank's."""
    spent = slowest_rank(run, "monitor_s")
    return {"monitor_s": statistics.mean(spent) if spent else 0.0, "monitor_max_s": max(spent, default=0.0)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.out is not None:
        run_rank(args)
        exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
        return
    gathered = run_two_ranks(__file__, argv if argv is not None else sys.argv[1:], args.timeout)
    # The mean step: the interval's step counts (a median would hide it).
    summary = paired_summary(gathered, args.rounds, monitor_times, average=statistics.mean)
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
