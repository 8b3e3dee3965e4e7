"""The engine benchmark at the Trainer level: ``strategy="myfsdp"`` against ``strategy="ddp"``, 2 CPU processes.

    python benchmarks/bench_trainer.py                        # ~14M params, 3 rounds, about 3 minutes
    python benchmarks/bench_trainer.py --rounds 1 --n-layer 2 --n-embd 128 --n-head 4 --steps 3   # a smoke test
    python benchmarks/bench_trainer.py --n-layer 5 --n-embd 672 --n-head 8 --rounds 2 --steps 4 \
        --impls ddp myfsdp_default                            # issue 10's target: the 27.4M GPT, no arguments
    python benchmarks/bench_trainer.py --json benchmarks/results/trainer.json

What a user of the strategy gets, end to end: ``LitGPT`` (``lightning_fsdp.demos.lit_gpt``, the GPT built in
``configure_model``) on ``CharDataModule``, under ``Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block}))``
("myfsdp"), under ``Trainer(strategy="myfsdp")`` with no argument at all ("myfsdp_default": the strategy finds the
GPT's blocks itself), the same with ``forward_prefetch=True`` ("myfsdp_prefetch") and under
``Trainer(strategy="ddp")``; "plain" is the floor under all of them: two processes started together, each fitting the
module alone on one device (no communication, no sharding, the same two cores shared), its step the slower one's.
Everything Lightning adds on top of ``bench_engine.py`` is included: ``configure_model`` (on the CPU, as under
Lightning's FSDP), the precision plugin, gradient clipping through the Trainer, hooks and logging, the
``DistributedSampler``.

Why it is built this way:

- Each (round, strategy) is its own ``python benchmarks/bench_trainer.py --impl X`` subprocess. Lightning's
  launcher starts rank 1 by running the same command line again, so a script that fitted both strategies in
  one process would have rank 1 replay the whole loop; one fit per command line keeps both ranks in step.
- Rounds are interleaved (ddp, myfsdp, ddp, myfsdp, ...): the machine is shared, and noise that comes and
  goes then hits both strategies alike. "step time (paired)" is the median (and range) over rounds of each
  round's ratio, the number to quote: it compares runs that were neighbours in time.
- Step time is what a ``Callback`` sees from ``on_train_batch_start`` to ``on_train_batch_end``: forward,
  backward, gradient reduction, clipping and the optimizer step. Per step the slowest rank counts; the first
  ``--warmup`` steps (optimizer state created lazily, first gathers) are left out. The same callback splits the
  step at ``on_before_backward`` and ``on_after_backward`` into forward (with ``zero_grad``), backward (with the
  gradient reductions, which finish before backward returns) and clipping plus the optimizer step, so a
  difference between strategies shows where in the step it arises. "off CPU" is, per rank and step, the step's
  time less the CPU time of the thread that trains (``time.thread_time``): what that thread spent waiting for the
  other rank, for a collective or for a core. For "plain" it is the machine's own noise.
- The same seed, data and optimizer (AdamW, constant learning rate, clipping at norm 1.0) under both, so the
  per-step training losses (rank means) must agree; a disagreement is printed as a WARNING line.
- Per-rank parameters + gradients + optimizer state are counted after the last step, with ``bench_engine``'s
  ``state_bytes`` (distinct storages, shards inside padded buffers counted whole).
- Peak RSS is each rank's ``ru_maxrss`` at the end of training (the whole process: interpreter, libraries, the
  model, activations, collective buffers and the shared-memory segment it mapped), the larger rank's counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
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

# Run as a script (the benchmarks folder is then sys.path[0], which finds engine_bench) from a checkout where the
# package is not installed: make the repository root importable, as `pip install -e .` would.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("lightning_fsdp") is None:
    sys.path.insert(0, str(_REPO_ROOT))

from engine_bench.config import LOSS_RTOL  # noqa: E402
from engine_bench.measure import state_bytes  # noqa: E402
from engine_bench.report import source_line, source_state  # noqa: E402

from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.demos.datamodule import CharDataModule  # noqa: E402
from lightning_fsdp.demos.gpt import Block  # noqa: E402
from lightning_fsdp.demos.lit_gpt import LitGPT  # noqa: E402
from lightning_fsdp.runtime.process_exit import exit_now  # noqa: E402

IMPLS = ("ddp", "myfsdp", "myfsdp_default", "myfsdp_prefetch", "plain")
PLAIN_PROCESSES = 2  # "plain" runs as many processes as the strategies have ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # ~14M parameters: the size bench_engine.py's default halved in width, so 3 rounds x 2 strategies, each
    # paying Lightning's start-up, stay within about 3 minutes on 2 shared cores.
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs ddp, then myfsdp")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before giving up")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="strategies to compare")
    parser.add_argument("--impl", choices=IMPLS, default=None, help=argparse.SUPPRESS)  # one run (internal)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # where that run's rank 0 writes
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------ one run (a child)


class StepRecorder(Callback):
    """Times each training batch, keeps its loss, and counts state bytes after the last one.

    ``on_train_batch_end`` runs after the optimizer step and before the next step's ``zero_grad``, so the
    gradients are still alive when they are counted.
    """

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.phase_ends: dict[str, list[float]] = {"forward": [], "backward": []}  # seconds into each step
        self.off_cpu: list[float] = []  # seconds of each step the training thread was not running
        self.losses: list[float] = []
        self.state: dict[str, int] = {}
        self.gathered: list[dict[str, Any]] = []  # every rank's record, after training
        self._start = 0.0
        self._start_cpu = 0.0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()
        self._start_cpu = time.thread_time()

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self.phase_ends["forward"].append(time.perf_counter() - self._start)

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.phase_ends["backward"].append(time.perf_counter() - self._start)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.step_times.append(time.perf_counter() - self._start)
        self.off_cpu.append(self.step_times[-1] - (time.thread_time() - self._start_cpu))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        if trainer.global_step >= trainer.max_steps:
            self.state = state_bytes(pl_module, trainer.optimizers[0])

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Gather every rank's record to rank 0 while the process group is certainly alive."""
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        mine = {
            "step_times_s": self.step_times,
            "phase_ends_s": self.phase_ends,
            "off_cpu_s": self.off_cpu,
            "losses": self.losses,
            "state_bytes": self.state,
            "peak_rss": peak_rss,
        }
        if not dist.is_initialized():  # "plain": one process, no group; the parent joins the processes' records
            self.gathered = [mine]
            return
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.gathered = gathered


def timing_trainer(strategy: Any, devices: int, max_steps: int, callback: Callback) -> Trainer:
    """A CPU Trainer that only trains and times: clipping at norm 1.0, no validation, logger, checkpoint or bar."""
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )


def run_one(args: argparse.Namespace) -> None:
    """Fit ``args.impl`` for warmup + steps steps; rank 0 writes what every rank recorded to ``args.out``."""
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13's deprecated collective names
    seed_everything(args.seed, verbose=False)
    strategies: dict[str, Any] = {
        "ddp": "ddp",
        "myfsdp": FSDPStrategy(auto_wrap_policy={Block}),
        "myfsdp_default": "myfsdp",
        "myfsdp_prefetch": FSDPStrategy(forward_prefetch=True),  # the default units, the next one gathered ahead
        "plain": "auto",
    }
    recorder = StepRecorder()
    devices = 1 if args.impl == "plain" else 2
    trainer = timing_trainer(strategies[args.impl], devices, args.warmup + args.steps, recorder)
    model = LitGPT(
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        block_size=args.block_size,
        lr=args.lr,
        warmup_steps=0,
        min_lr_ratio=1.0,  # a constant learning rate, as in bench_engine.py
    )
    data = CharDataModule(max_bytes=1_000_000, block_size=args.block_size, batch_size=args.batch_size)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"impl": args.impl, "ranks": recorder.gathered}))


# ------------------------------------------------------------------------------------ the rounds (the parent)


def spawn(impl: str, args: argparse.Namespace, out: Path) -> dict[str, Any] | str:
    """One fit in fresh processes (Lightning starts rank 1 from this command line); its record, or why not.

    "plain" starts its processes together, each with its own output, and joins their records as ranks."""
    outs = [out.with_name(f"{out.stem}_{i}{out.suffix}") for i in range(PLAIN_PROCESSES)] if impl == "plain" else [out]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    children = [
        subprocess.Popen(
            _command(impl, args, path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for path in outs
    ]
    deadline = time.monotonic() + args.timeout
    try:
        logs = [child.communicate(timeout=max(0.0, deadline - time.monotonic()))[0] for child in children]
    except subprocess.TimeoutExpired:
        for child in children:
            child.kill()
            child.communicate()
        return f"timed out after {args.timeout:g} s"
    for child, log, path in zip(children, logs, outs, strict=True):
        if child.returncode != 0 or not path.exists():
            return f"exit code {child.returncode}:\n{log[-3000:]}"
    records = [json.loads(path.read_text()) for path in outs]
    return {"impl": impl, "ranks": [rank for record in records for rank in record["ranks"]]}


def _command(impl: str, args: argparse.Namespace, out: Path) -> list[str]:
    command = [sys.executable, __file__, "--impl", impl, "--out", str(out)]
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "warmup", "steps", "threads", "seed"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return [*command, "--lr", str(args.lr)]


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Median, min and max step time (slowest rank per step, warm-up left out), loss curve, worst rank's bytes."""
    step_times = [t for r in records for t in _timed(r, warmup)]
    curves = [
        [statistics.fmean(step) for step in zip(*(x["losses"] for x in r["ranks"]), strict=True)] for r in records
    ]
    first = records[0]["ranks"]
    return {
        "runs": len(records),
        "step_time_median_s": statistics.median(step_times),
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "step_time_run_medians_s": [statistics.median(_timed(r, warmup)) for r in records],
        "phase_medians_s": {
            phase: statistics.median(t for r in records for t in _phase_times(r, phase, warmup)) for phase in PHASES
        },
        # Per rank and step: time the training thread waited (the peer, a collective, a lock) or was preempted.
        "off_cpu_median_s": statistics.median(t for r in records for x in r["ranks"] for t in x["off_cpu_s"][warmup:]),
        "rounds": [r["round"] for r in records],
        "loss_curve": curves[0],
        "loss_same_every_run": all(curve == curves[0] for curve in curves),
        "state_bytes": {k: max(x["state_bytes"][k] for x in first) for k in first[0]["state_bytes"]},
        "peak_rss_median_bytes": statistics.median(max(x["peak_rss"] for x in r["ranks"]) for r in records),
    }


PHASES = ("forward", "backward", "clip+optimizer")


def _phase_times(record: dict[str, Any], phase: str, warmup: int) -> list[float]:
    """The slowest rank's time in ``phase`` of each step after the warm-up."""
    index = PHASES.index(phase)
    per_rank = []
    for rank in record["ranks"]:
        ends = rank["phase_ends_s"]
        # Each step's boundaries: its start, the ends of forward and backward, its end.
        steps = zip(ends["forward"], ends["backward"], rank["step_times_s"], strict=True)
        per_rank.append([bounds[index + 1] - bounds[index] for bounds in ((0.0, *step) for step in steps)])
    return [max(ranks) for ranks in zip(*per_rank, strict=True)][warmup:]


def _timed(record: dict[str, Any], warmup: int) -> list[float]:
    """The slowest rank's time of each step after the warm-up."""
    per_step = [max(ranks) for ranks in zip(*(x["step_times_s"] for x in record["ranks"]), strict=True)]
    return per_step[warmup:]


def report(summaries: dict[str, dict[str, Any]], args: argparse.Namespace, num_params: int) -> list[str]:
    rows: list[tuple[str, Any]] = [
        ("step time (median)", lambda s: f"{s['step_time_median_s'] * 1e3:.0f} ms"),
        ("step time (min)", lambda s: f"{s['step_time_min_s'] * 1e3:.0f} ms"),
        ("step time (max)", lambda s: f"{s['step_time_max_s'] * 1e3:.0f} ms"),
        ("  run medians", lambda s: " ".join(f"{t * 1e3:.0f}" for t in s["step_time_run_medians_s"])),
        *((f"  {phase} (median)", _phase_cell(phase)) for phase in PHASES),
        ("  off CPU (median)", lambda s: f"{s['off_cpu_median_s'] * 1e3:.0f} ms"),
        ("params+grads+optim", lambda s: f"{s['state_bytes']['total'] / 2**20:.1f} MiB"),
        ("peak RSS (median)", lambda s: f"{s['peak_rss_median_bytes'] / 2**20:.0f} MiB"),
        ("final loss", lambda s: f"{s['loss_curve'][-1]:.5f}"),
    ]
    cells = {title: [cell(s) for s in summaries.values()] for title, cell in rows}
    width = 2 + max(16, *(len(text) for column in cells.values() for text in column))  # run medians grow with rounds
    lines = [
        f"Trainer level: LitGPT {num_params / 1e6:.1f}M params (n_layer={args.n_layer} n_embd={args.n_embd} "
        f"n_head={args.n_head} block={args.block_size}), batch {args.batch_size}/rank, 2 CPU processes, "
        f"{args.threads} thread(s) each, fp32; {args.rounds} rounds x ({args.warmup} warmup + {args.steps} timed) "
        "steps",
        f"{'':24s}" + "".join(f"{impl:>{width}s}" for impl in summaries),
    ]
    lines += [f"{title:24s}" + "".join(f"{text:>{width}s}" for text in column) for title, column in cells.items()]
    ours_impls = [impl for impl in summaries if impl != "ddp"]
    if "ddp" in summaries and ours_impls:
        ddp = summaries["ddp"]
        lines.append("")
        lines.append(f"{'ratio':24s}" + "".join(f"{impl + '/ddp':>20s}" for impl in ours_impls))
        ratio_rows: list[tuple[str, Any]] = [
            ("step time (median)", lambda s: s["step_time_median_s"] / ddp["step_time_median_s"]),
            ("step time (min)", lambda s: s["step_time_min_s"] / ddp["step_time_min_s"]),
            ("params+grads+optim", lambda s: s["state_bytes"]["total"] / ddp["state_bytes"]["total"]),
            ("peak RSS (median)", lambda s: s["peak_rss_median_bytes"] / ddp["peak_rss_median_bytes"]),
        ]
        for title, ratio in ratio_rows:
            lines.append(f"{title:24s}" + "".join(f"{ratio(summaries[impl]):>20.2f}" for impl in ours_impls))
        paired = {impl: _paired_ratios(summaries[impl], ddp) for impl in ours_impls}
        lines.append(f"{'step time (paired)':24s}" + "".join(f"{_spread(paired[impl]):>20s}" for impl in ours_impls))
        rtol = LOSS_RTOL["fp32"]
        for impl in ours_impls:
            if impl == "plain":  # each process fits the whole batch stream alone: other losses than ddp's mean
                continue
            pairs = zip(summaries[impl]["loss_curve"], ddp["loss_curve"], strict=True)
            bad = next(((i, m, t) for i, (m, t) in enumerate(pairs) if abs(m - t) > rtol * abs(t)), None)
            if bad is not None:
                lines.append(f"WARNING: losses disagree at step {bad[0] + 1}: {impl} {bad[1]:.6f} vs ddp {bad[2]:.6f}")
            else:
                lines.append(f"{impl}: losses agree with ddp at every step (rtol {rtol:g})")
        lines.append("ddp losses: " + " ".join(f"{x:.4f}" for x in ddp["loss_curve"]))
    for impl, s in summaries.items():
        if not s["loss_same_every_run"]:
            lines.append(f"WARNING: {impl} is not deterministic: its losses differ between runs")
    return lines


def _phase_cell(phase: str) -> Any:
    return lambda s: f"{s['phase_medians_s'][phase] * 1e3:.0f} ms"


def _paired_ratios(ours: dict[str, Any], ddp: dict[str, Any]) -> list[float]:
    """Per round, ours' median step over ddp's in the same round: the two ran back to back, so the machine's slow
    and fast spells (the same configuration moves by 30% between runs here) cancel in the ratio, not in the medians."""
    ddp_by_round = dict(zip(ddp["rounds"], ddp["step_time_run_medians_s"], strict=True))
    return [
        median / ddp_by_round[round_index]
        for round_index, median in zip(ours["rounds"], ours["step_time_run_medians_s"], strict=True)
        if round_index in ddp_by_round
    ]


def _spread(ratios: list[float]) -> str:
    """The median of the per-round ratios and their range."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.impl is not None:
        run_one(args)
        exit_now()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
    source = source_state()
    records: dict[str, list[dict[str, Any]]] = {impl: [] for impl in args.impls}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for impl in args.impls:
                start = time.monotonic()
                out = Path(tmp) / f"{impl}_{round_index}.json"
                outcome = spawn(impl, args, out)
                status = "ok" if isinstance(outcome, dict) else "FAILED"
                print(f"round {round_index + 1}/{args.rounds} {impl:6s} {status} in {time.monotonic() - start:.1f} s")
                if isinstance(outcome, str):
                    print(f"  {outcome.strip()}", flush=True)
                    failures.append(f"{impl}: {outcome.strip()[-500:]}")
                else:
                    records[impl].append({**outcome, "round": round_index})
    summaries = {impl: summarize(runs, args.warmup) for impl, runs in records.items() if runs}
    if not summaries:
        raise SystemExit("every run failed")
    lines = [source_line(source), *report(summaries, args, _num_params(args))]
    lines += [f"WARNING: a run failed: {failure}" for failure in failures]
    print("\n".join(lines), flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": vars(args),
            "torch": torch.__version__,
            "source": source,
            "summaries": summaries,
            "report": lines,
            "raw": records,
        }
        path.write_text(json.dumps(payload, indent=1))
        print(f"wrote {path}")


def _num_params(args: argparse.Namespace) -> int:
    """The model's parameter count, from a build on the meta device (no memory, no weights)."""
    model = LitGPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    with torch.device("meta"):
        model.configure_model()
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
