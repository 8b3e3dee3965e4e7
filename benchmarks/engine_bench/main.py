"""The command line: run a comparison or --largest (or load saved runs), print, save and plot."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from .config import BenchArgs, parse_args
from .largest import run_largest
from .launch import available_impls, run_all_spawned, run_all_torchrun
from .plots import plot_results
from .report import compiled_report, report, source_line, source_state, summarize


def run_comparison(args: BenchArgs) -> dict[str, Any] | None:
    """The three implementations, interleaved; the payload (None on a torchrun rank other than 0)."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    if under_torchrun:
        args = replace(args, world_size=int(os.environ["WORLD_SIZE"]))
    source = source_state()
    impls, skipped = available_impls(args)
    is_rank0 = not under_torchrun or os.environ.get("RANK", "0") == "0"
    if is_rank0:
        for impl, why in skipped.items():
            print(f"WARNING: skipping {impl}: {why}", flush=True)
    if not impls:
        raise SystemExit("no implementation to run")
    compiled_args = (
        replace(args, compile=args.compiled_row, compiled_row=None) if args.compiled_row is not None else None
    )
    if under_torchrun:
        if compiled_args is not None:
            raise SystemExit("--compiled-row spawns its own ranks for the compiled runs; run it without torchrun")
        results = run_all_torchrun(args, impls)
        compiled_results = None
    else:
        results, *rest = run_all_spawned([args] + ([compiled_args] if compiled_args else []), impls)
        compiled_results = rest[0] if rest else None
    if results is None:  # a torchrun rank other than 0
        return None
    summaries = {impl: summarize(impl, rounds, args) for impl, rounds in results.items()}
    lines = [source_line(source), *report(summaries, args, rss_isolated=not under_torchrun)]
    compiled: dict[str, Any] | None = None
    if compiled_args is not None and compiled_results is not None:
        compiled_summaries = {impl: summarize(impl, rounds, compiled_args) for impl, rounds in compiled_results.items()}
        compiled = {"args": asdict(compiled_args), "summaries": compiled_summaries, "raw": compiled_results}
        lines += compiled_report(summaries, compiled_summaries, compiled_args)
    return {
        "kind": "comparison",
        "args": asdict(args),
        "torch": torch.__version__,
        "source": source,
        "skipped": skipped,
        "rss_isolated": not under_torchrun,
        "summaries": summaries,
        "report": lines,
        "raw": results,
        "compiled": compiled,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        payloads = [json.loads(Path(path).read_text()) for path in args.from_json]
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        if args.largest:
            if "TORCHELASTIC_RUN_ID" in os.environ:
                raise SystemExit("--largest spawns its own ranks; run it without torchrun")
            payload = run_largest(args)
        else:
            payload = run_comparison(args)
        if payload is None:
            return
        payloads = [payload]
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(payload, indent=1))
    for payload in payloads:
        print("\n".join(payload["report"]), flush=True)
    if args.json and not args.from_json:
        print(f"wrote {args.json}")
    if args.plot:
        plot_results(payloads, args.plot)
