"""From the ranks' raw numbers to the summary per implementation and the printed tables and ratios."""

from __future__ import annotations

import hashlib
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import LOSS_RTOL, BenchArgs

REPO_ROOT = Path(__file__).resolve().parents[2]


def summarize(impl: str, rounds: list[list[dict[str, Any]] | str], args: BenchArgs) -> dict[str, Any]:
    """One implementation's numbers over its successful rounds (per rank: the worst rank; loss: rank mean)."""
    ok = [r for r in rounds if isinstance(r, list)]
    failures = [r for r in rounds if isinstance(r, str)]
    if not ok:
        return {"impl": impl, "ok": False, "failures": failures}
    step_times = [max(ranks) for round_ in ok for ranks in zip(*(r["step_times_s"] for r in round_), strict=True)]
    round_medians = [
        statistics.median(max(ranks) for ranks in zip(*(r["step_times_s"] for r in round_), strict=True))
        for round_ in ok
    ]
    loss_curves = [
        [statistics.fmean(ranks) for ranks in zip(*(r["losses"] for r in round_), strict=True)] for round_ in ok
    ]
    first = ok[0]
    summary: dict[str, Any] = {
        "impl": impl,
        "ok": True,
        "failures": failures,
        "rounds_ok": len(ok),
        "num_params": first[0]["num_params"],
        "step_time_median_s": statistics.median(step_times),
        # Noise on a shared machine only ever adds time, so the fastest step is the steadier comparison.
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "step_time_round_medians_s": round_medians,
        "state_bytes": {k: max(r["state_bytes"][k] for r in first) for k in first[0]["state_bytes"]},
        "live_tensor_bytes": max(r["live_tensor_bytes"] for r in first),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for round_ in ok for r in round_),
        "peak_rss_delta_bytes": max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for round_ in ok for r in round_),
        "comm_counts": first[0]["comm_counts"],
        "comm_bytes": first[0]["comm_bytes"],
        "comm_bytes_same_on_all_ranks": all(r["comm_bytes"] == first[0]["comm_bytes"] for r in first),
        "final_loss": loss_curves[0][-1],
        "loss_curve": loss_curves[0],
        "loss_same_every_round": all(curve == loss_curves[0] for curve in loss_curves),
    }
    if args.compile is not None:
        summary["graph_breaks"] = max(r["graph_breaks"] for round_ in ok for r in round_)
        summary["graphs"] = max(r["graphs"] for round_ in ok for r in round_)
    if args.profile:
        summary["profiled_step_s"] = statistics.median(max(r["profiled_step_s"] for r in round_) for round_ in ok)
        summary["comm_busy_s"] = statistics.median(statistics.fmean(r["comm_busy_s"] for r in round_) for round_ in ok)
        summary["comm_exposed_s"] = statistics.median(
            statistics.fmean(r["comm_exposed_s"] for r in round_) for round_ in ok
        )
    return summary


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def report(summaries: dict[str, dict[str, Any]], args: BenchArgs, rss_isolated: bool) -> list[str]:
    """The tables (and WARNING lines) printed at the end; returned so they can also go into the JSON."""
    ok = {impl: s for impl, s in summaries.items() if s["ok"]}
    lines = []
    label = "ours" if args.sharding_strategy == "FULL_SHARD" else f"ours({args.sharding_strategy})"
    if ok:
        any_summary = next(iter(ok.values()))
        lines.append(
            f"model: {any_summary['num_params'] / 1e6:.1f}M params, n_layer={args.n_layer} n_embd={args.n_embd} "
            f"n_head={args.n_head} block={args.block_size} vocab={args.vocab_size} "
            f"({'tied' if args.tie_weights else 'untied'} head) batch={args.batch_size}/rank; "
            f"W={args.world_size} "
            f"gloo ranks, {args.threads} thread(s) each, {args.precision}, ours over {args.transport}; "
            f"{args.rounds} rounds x "
            f"({args.warmup} warmup + {args.steps} timed) steps"
            + ("; forward prefetch on (ours and fsdp2)" if args.forward_prefetch else "")
        )
    # Under torchrun the implementations share processes: the peak is whichever came first's, so no ratio.
    rss_note = "" if rss_isolated else " (not isolated)"
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("step time (median)", lambda s: f"{s['step_time_median_s'] * 1e3:.0f} ms"),
        ("step time (min)", lambda s: f"{s['step_time_min_s'] * 1e3:.0f} ms"),
        ("  round medians", lambda s: " ".join(f"{t * 1e3:.0f}" for t in s["step_time_round_medians_s"])),
        ("params", lambda s: mib(s["state_bytes"]["params"])),
        ("grads", lambda s: mib(s["state_bytes"]["grads"])),
        ("optimizer state", lambda s: mib(s["state_bytes"]["optim"])),
        ("params+grads+optim", lambda s: mib(s["state_bytes"]["total"])),
        ("all live tensors", lambda s: mib(s["live_tensor_bytes"])),
        ("peak RSS" + rss_note, lambda s: mib(s["peak_rss_bytes"])),
        ("peak RSS - baseline" + rss_note, lambda s: mib(s["peak_rss_delta_bytes"])),
    ]
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
        rows.append(
            (f"{kind} /step/rank", lambda s, k=kind: f"{mib(s['comm_bytes'].get(k, 0))} ({s['comm_counts'].get(k, 0)})")
        )
    if args.compile is not None:
        rows.append(("graph breaks", lambda s: f"{s['graph_breaks']}"))
        rows.append(("graphs compiled", lambda s: f"{s['graphs']}"))
    if args.profile:
        rows.append(("profiled step", lambda s: f"{s['profiled_step_s'] * 1e3:.0f} ms"))
        rows.append(("comm busy /step", lambda s: f"{s['comm_busy_s'] * 1e3:.0f} ms"))
        rows.append(("comm exposed /step", lambda s: f"{s['comm_exposed_s'] * 1e3:.0f} ms"))
    rows.append(("final loss", lambda s: f"{s['final_loss']:.5f}"))
    names = [label if impl == "ours" else impl for impl in ok]
    width = max(24, *(len(r[0]) for r in rows))
    lines.append(f"{'':{width}s}" + "".join(f"{name:>22s}" for name in names))
    for title, cell in rows:
        lines.append(f"{title:{width}s}" + "".join(f"{cell(s):>22s}" for s in ok.values()))

    for impl, s in summaries.items():
        if not s["ok"]:
            lines.append(f"WARNING: {impl} failed in every attempt: {s['failures'][0].strip()[-500:]}")
        elif s["failures"]:
            lines.append(
                f"WARNING: {impl}: {len(s['failures'])} attempt(s) failed and were retried; the first: "
                f"{s['failures'][0].strip()[-300:]}"
            )
        elif not s["loss_same_every_round"]:
            lines.append(f"WARNING: {impl} is not deterministic: its losses differ between rounds")
        if s["ok"] and not s["comm_bytes_same_on_all_ranks"]:
            lines.append(f"WARNING: {impl}: ranks disagree on bytes communicated per step")
    reference = next(iter(ok.values()), None)
    rtol = LOSS_RTOL[args.precision]
    for impl, s in ok.items():
        if reference is None or impl == reference["impl"]:
            continue
        # Every step, not only the last: a wrong gradient shows up in the step after it, and may fade later.
        for step, (mine, theirs) in enumerate(zip(s["loss_curve"], reference["loss_curve"], strict=True)):
            if abs(mine - theirs) > rtol * abs(theirs):
                lines.append(
                    f"WARNING: losses disagree beyond rtol {rtol:g} at step {step + 1}: {impl} {mine:.6f} vs "
                    f"{reference['impl']} {theirs:.6f}"
                )
                break

    if "ours" in ok:
        ours = ok["ours"]
        others = [impl for impl in ("fsdp2", "ddp", "plain") if impl in ok]
        if others:
            lines.append("")
            lines.append(f"{'ratio':{width}s}" + "".join(f"{label + '/' + o:>22s}" for o in others))
            ratio_rows: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
                ("step time (median)", lambda s: s["step_time_median_s"]),
                ("step time (min)", lambda s: s["step_time_min_s"]),
                ("params+grads+optim", lambda s: s["state_bytes"]["total"]),
                ("all live tensors", lambda s: s["live_tensor_bytes"]),
                ("bytes communicated", lambda s: sum(s["comm_bytes"].values())),
            ]
            if rss_isolated:
                ratio_rows += [
                    ("peak RSS", lambda s: s["peak_rss_bytes"]),
                    ("peak RSS - baseline", lambda s: s["peak_rss_delta_bytes"]),
                ]
            if args.profile:
                ratio_rows.append(("comm exposed", lambda s: s["comm_exposed_s"]))
            for title, value in ratio_rows:
                lines.append(f"{title:{width}s}" + "".join(f"{_ratio(value(ours), value(ok[o])):>22s}" for o in others))
    return lines


def source_state() -> dict[str, Any]:
    """Which code the numbers come from: the commit, and a hash of the engine's files as they were on disk.

    The engine changes under the benchmark while people work on it; the hash tells two runs of the same
    commit apart when the working tree differed.
    """
    digest = hashlib.sha1()
    for path in sorted((REPO_ROOT / "lightning_fsdp" / "engine").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "lightning_fsdp"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {"commit": commit or None, "lightning_fsdp_modified": bool(dirty), "engine_sha1": digest.hexdigest()[:12]}


def source_line(source: dict[str, Any]) -> str:
    """The report's first line: which code produced the numbers (see :func:`source_state`)."""
    modified = " + uncommitted changes in lightning_fsdp/" if source["lightning_fsdp_modified"] else ""
    return f"code: commit {source['commit']}{modified} (engine files sha1 {source['engine_sha1']})"


def compiled_report(
    eager: dict[str, dict[str, Any]], compiled: dict[str, dict[str, Any]], args: BenchArgs
) -> list[str]:
    """--compiled-row: the compiled rounds' table, then each implementation's compiled/eager step time."""
    lines = [
        "",
        f"compiled: torch.compile(model, backend={args.compile!r}) of every implementation, the same model and data",
        *report(compiled, args, rss_isolated=True),
    ]
    both = [impl for impl in compiled if compiled[impl]["ok"] and eager.get(impl, {}).get("ok")]
    if both:
        width = 24
        lines.append("")
        lines.append(f"{'compiled / eager':{width}s}" + "".join(f"{impl:>22s}" for impl in both))
        for title, key in (("step time (median)", "step_time_median_s"), ("step time (min)", "step_time_min_s")):
            cells = "".join(f"{_ratio(compiled[i][key], eager[i][key]):>22s}" for i in both)
            lines.append(f"{title:{width}s}" + cells)
    return lines
