"""What the deferred signals cost per training step (lightning_fsdp/trainer/preemption.py): 2 CPU ranks, the demo GPT.

    python benchmarks/bench_signals.py                      # ~14M params (bench_trainer's model), 3 rounds
    python benchmarks/bench_signals.py --n-layer 2 --n-embd 64 --n-head 2 --rounds 1 --steps 3   # a smoke test

Under ``Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block}))`` every training batch ends with the ranks agreeing
on the signals any of them received: one all-reduce of ``world_size + 1`` integers, issued in the background before
the batch's optimizer step and waited for at its end, so that a signal is acted on at the end of the batch it arrived
in (see [Note: agreement behind the optimizer step]). Two numbers say what it costs:

- "agreement": the time each step spends in ``DeferredSignals._send`` (issuing the all-reduce, at
  ``on_before_optimizer_step``) and ``DeferredSignals._agree`` (waiting for it at the batch end: what of the round
  trip the optimizer step did not cover), timed from outside, each the larger rank's; their sum a step.
- "step time with / without": the same fit with the agreement and without it (``DeferredSignals.remove()`` at the
  first batch), interleaved in the same two processes round by round so that the shared machine's noise hits both;
  a step is the time from one ``on_train_batch_start`` to the next, the first ``--warmup`` left out.

Both ranks are started here with ``LOCAL_RANK`` set (no Lightning launcher), and run every fit one after the other.
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
from typing_extensions import override

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.demos.datamodule import CharDataModule
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.demos.lit_gpt import LitGPT
from lightning_fsdp.runtime.launch import free_port
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run
from lightning_fsdp.trainer.preemption import Agreement, DeferredSignals

VARIANTS = ("with", "without")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each fit")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per fit")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each fits with, then without")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set for the ranks (internal)
    return parser.parse_args(argv)


class StepClock(Callback):
    """Batch-start times, and the time spent agreeing; ``without`` takes the agreement out at the first batch."""

    def __init__(self, without: bool, agree_times: dict[str, list[float]]) -> None:
        self.without = without
        self.starts: list[float] = []
        self.agree_times = agree_times

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.without and not self.starts:
            for callback in [c for c in trainer.callbacks if isinstance(c, DeferredSignals)]:
                callback.remove()
        self.starts.append(time.perf_counter())


def timed_agreements(agree_times: dict[str, list[float]]) -> None:
    """Time every ``DeferredSignals._send`` and ``_agree`` call of this process into ``agree_times["send"]`` and
    ``agree_times["wait"]``."""
    send, agree = DeferredSignals._send, DeferredSignals._agree

    def timed_send(self: DeferredSignals) -> Agreement:
        start = time.perf_counter()
        try:
            return send(self)
        finally:
            agree_times["send"].append(time.perf_counter() - start)

    def timed_agree(self: DeferredSignals, agreement: Agreement) -> tuple[bool, list[int]]:
        start = time.perf_counter()
        try:
            return agree(self, agreement)
        finally:
            agree_times["wait"].append(time.perf_counter() - start)

    DeferredSignals._send = timed_send  # type: ignore[method-assign]
    DeferredSignals._agree = timed_agree  # type: ignore[method-assign]


def run_rank(args: argparse.Namespace) -> None:
    """Fit ``rounds`` x (with, without); rank 0 writes every rank's numbers to ``args.out``."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    agree_times: dict[str, list[float]] = {"send": [], "wait": []}
    timed_agreements(agree_times)
    records: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for variant in VARIANTS:
            seed_everything(0, verbose=False)
            clock = StepClock(variant == "without", agree_times)
            for times in agree_times.values():
                times.clear()
            trainer = Trainer(
                accelerator="cpu",
                devices=2,
                strategy=FSDPStrategy(auto_wrap_policy={Block}),
                max_steps=args.warmup + args.steps + 1,  # the last step's end is the next start: one more
                limit_val_batches=0,
                num_sanity_val_steps=0,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[clock],
            )
            model = LitGPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
            data = CharDataModule(max_bytes=1_000_000, block_size=args.block_size, batch_size=args.batch_size)
            trainer.fit(model, datamodule=data)
            steps = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)][args.warmup :]
            records.append(
                {
                    "round": round_index,
                    "variant": variant,
                    "steps_s": steps,
                    "send_s": agree_times["send"][args.warmup : args.warmup + args.steps],
                    "wait_s": agree_times["wait"][args.warmup : args.warmup + args.steps],
                }
            )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))


def summarize(gathered: list[list[dict[str, Any]]], rounds: int) -> dict[str, Any]:
    """Per step the slower rank counts; per round the ratio of median steps; over rounds their median."""
    per_round: dict[int, dict[str, dict[str, float]]] = {}
    for run in zip(*gathered, strict=True):  # the same fit on every rank
        steps = [max(times) for times in zip(*(r["steps_s"] for r in run), strict=True)]
        send = [max(times) for times in zip(*(r["send_s"] for r in run), strict=False)]
        wait = [max(times) for times in zip(*(r["wait_s"] for r in run), strict=False)]
        per_round.setdefault(run[0]["round"], {})[run[0]["variant"]] = {
            "step_s": statistics.median(steps),
            "send_s": statistics.median(send) if send else 0.0,
            "wait_s": statistics.median(wait) if wait else 0.0,
            "agree_s": statistics.median([a + b for a, b in zip(send, wait, strict=False)]) if send else 0.0,
        }
    ratios = [per_round[r]["with"]["step_s"] / per_round[r]["without"]["step_s"] for r in range(rounds)]
    return {
        "rounds": per_round,
        "step_with_s": statistics.median(per_round[r]["with"]["step_s"] for r in range(rounds)),
        "step_without_s": statistics.median(per_round[r]["without"]["step_s"] for r in range(rounds)),
        "agree_s": statistics.median(per_round[r]["with"]["agree_s"] for r in range(rounds)),
        "send_s": statistics.median(per_round[r]["with"]["send_s"] for r in range(rounds)),
        "wait_s": statistics.median(per_round[r]["with"]["wait_s"] for r in range(rounds)),
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
    print(
        f"step time with the agreement {summary['step_with_s'] * 1e3:.1f} ms, "
        f"without {summary['step_without_s'] * 1e3:.1f} ms (paired ratio {summary['ratio_median']:.4f}, "
        f"range {low:.4f}-{high:.4f} over {args.rounds} rounds); "
        f"the agreement itself {summary['agree_s'] * 1e6:.0f} us a step "
        f"(issuing {summary['send_s'] * 1e6:.0f} us, waiting at the batch end {summary['wait_s'] * 1e6:.0f} us; "
        f"{summary['agree_s'] / summary['step_with_s'] * 100:.3f}% of the step)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **summary}, indent=2))


if __name__ == "__main__":
    main()
