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

Both ranks are started here with ``LOCAL_RANK`` set (no Lightning launcher), and run every fit one after the other
(``paired_fits.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from paired_fits import VARIANTS, StepClock, paired_summary, quiet_trainer, run_two_ranks, share_records, slowest_rank
from typing_extensions import override

from lightning_fsdp.demos.datamodule import CharDataModule
from lightning_fsdp.demos.lit_gpt import LitGPT
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run
from lightning_fsdp.trainer.preemption import Agreement, DeferredSignals


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


class ClockWithoutSignals(StepClock):
    """The step clock of the "without" variant: it takes the agreement out at the first batch."""

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.starts:
            for callback in [c for c in trainer.callbacks if isinstance(c, DeferredSignals)]:
                callback.remove()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


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
            clock = StepClock() if variant == "with" else ClockWithoutSignals()
            for times in agree_times.values():
                times.clear()
            trainer = quiet_trainer(args.warmup + args.steps + 1, [clock])  # the last step's end is the next start
            model = LitGPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
            data = CharDataModule(max_bytes=1_000_000, block_size=args.block_size, batch_size=args.batch_size)
            trainer.fit(model, datamodule=data)
            records.append(
                {
                    "round": round_index,
                    "variant": variant,
                    "steps_s": clock.step_times(args.warmup),
                    "send_s": agree_times["send"][args.warmup : args.warmup + args.steps],
                    "wait_s": agree_times["wait"][args.warmup : args.warmup + args.steps],
                }
            )
    share_records(records, args.out)


def agreement_times(run: Any, steps: list[float]) -> dict[str, float]:
    """The median send, wait and their sum a step, each the slower rank's."""
    send, wait = slowest_rank(run, "send_s"), slowest_rank(run, "wait_s")
    if not send:
        return {"send_s": 0.0, "wait_s": 0.0, "agree_s": 0.0}
    return {
        "send_s": statistics.median(send),
        "wait_s": statistics.median(wait),
        "agree_s": statistics.median([a + b for a, b in zip(send, wait, strict=False)]),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.out is not None:
        run_rank(args)
        exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
        return
    gathered = run_two_ranks(__file__, argv if argv is not None else sys.argv[1:], args.timeout)
    summary = paired_summary(gathered, args.rounds, agreement_times)
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
