"""--plot: step time, memory per implementation and memory against model size, drawn into one PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import BenchArgs
from .largest import model_family

_COLORS = {"ours": "tab:blue", "fsdp2": "tab:orange", "ddp": "tab:green"}


def _label(impl: str, args: dict[str, Any]) -> str:
    if impl == "ours":
        return "ours" if args["sharding_strategy"] == "FULL_SHARD" else f"ours ({args['sharding_strategy']})"
    return impl


def _plot_step_time(ax: Any, comparison: dict[str, Any]) -> None:
    """Median step time per implementation, whiskers from the fastest to the slowest timed step."""
    ok = {impl: s for impl, s in comparison["summaries"].items() if s["ok"]}
    names = list(ok)
    medians = [ok[i]["step_time_median_s"] * 1e3 for i in names]
    low = [m - ok[i]["step_time_min_s"] * 1e3 for m, i in zip(medians, names, strict=True)]
    high = [ok[i]["step_time_max_s"] * 1e3 - m for m, i in zip(medians, names, strict=True)]
    x = range(len(names))
    ax.bar(x, medians, color=[_COLORS[i] for i in names], yerr=[low, high], capsize=6, alpha=0.85)
    # Every timed step as a dot: on a shared machine the spread (bimodal, at times) says more than the bar.
    for xi, impl in zip(x, names, strict=True):
        steps = [
            max(ranks) * 1e3
            for round_ in comparison["raw"][impl]
            if isinstance(round_, list)
            for ranks in zip(*(r["step_times_s"] for r in round_), strict=True)
        ]
        offsets = [0.25 * (k / max(1, len(steps) - 1) - 0.5) for k in range(len(steps))]
        ax.plot([xi + o for o in offsets], steps, ".", color="black", markersize=4)
    for xi, median in zip(x, medians, strict=True):
        ax.annotate(f"{median:.0f}", (xi - 0.38, median), xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_xticks(list(x), [_label(i, comparison["args"]) for i in names])
    ax.set_ylabel("ms per step (slowest rank; dots: each timed step)")
    a = comparison["args"]
    ax.set_title(
        f"step time: median, min-max\nW={a['world_size']}, {a['threads']} thread/rank, {a['precision']}, "
        f"ours over {a.get('transport', 'shm')}",
        fontsize=10,
    )


def _plot_state_bytes(ax: Any, comparison: dict[str, Any]) -> None:
    """Per-rank parameters, gradients and optimizer state, stacked."""
    ok = {impl: s for impl, s in comparison["summaries"].items() if s["ok"]}
    names = list(ok)
    x = list(range(len(names)))
    bottom = [0.0] * len(names)
    for part, alpha, hatch in (("params", 1.0, ""), ("grads", 0.65, "//"), ("optim", 0.35, "..")):
        heights = [ok[i]["state_bytes"][part] / 2**20 for i in names]
        ax.bar(
            x,
            heights,
            bottom=bottom,
            color=[_COLORS[i] for i in names],
            alpha=alpha,
            hatch=hatch,
            edgecolor="black",
            linewidth=0.5,
            label={"optim": "optimizer state"}.get(part, part),
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for xi, total in zip(x, bottom, strict=True):
        ax.annotate(f"{total:.0f}", (xi, total), xytext=(-8, 3), textcoords="offset points", fontsize=8)
    ax.set_xticks(x, [_label(i, comparison["args"]) for i in names])
    ax.set_ylabel("MiB per rank")
    num_params = next(iter(ok.values()))["num_params"]
    ax.set_title(f"params + grads + optimizer state\n{num_params / 1e6:.1f}M params, AdamW", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def _plot_memory_vs_size(ax: Any, comparison: dict[str, Any] | None, largest: dict[str, Any] | None) -> None:
    """The estimator's per-rank bytes against model size, with every measured point of the runs on it."""
    source = comparison or largest
    assert source is not None
    args = BenchArgs(**{**source["args"], "impls": tuple(source["args"]["impls"])})
    family = model_family(args)
    world_size = args.world_size
    points = [ok["num_params"] for ok in (comparison or {}).get("summaries", {}).values() if ok["ok"]]
    if largest is not None:
        points += [largest["measured_params"], largest["at_budget"]["full_shard_params"]]
    x_max = 1.25 * max(points)
    xs = [x_max * k / 50 for k in range(1, 51)]
    for strategy, color, label in (("DDP", _COLORS["ddp"], "DDP"), ("FULL_SHARD", _COLORS["ours"], "FULL_SHARD")):
        estimates = [family.estimate(int(n), world_size, strategy) for n in xs]
        ax.plot(
            [n / 1e6 for n in xs], [e.peak / 2**20 for e in estimates], color=color, label=f"estimator peak, {label}"
        )
        if strategy == "FULL_SHARD":
            ax.plot(
                [n / 1e6 for n in xs],
                [e.steady / 2**20 for e in estimates],
                color=color,
                linestyle="--",
                linewidth=1,
                label="estimator params+grads+optim, FULL_SHARD",
            )
    markers = {"ours": "o", "fsdp2": "x", "ddp": "s"}
    for impl, s in (comparison or {}).get("summaries", {}).items():
        if s["ok"]:
            ax.plot(
                s["num_params"] / 1e6,
                s["state_bytes"]["total"] / 2**20,
                markers[impl],
                color=_COLORS[impl],
                markersize=7,
                label=f"measured params+grads+optim, {_label(impl, source['args'])}",
            )
    if largest is not None:
        budget = largest["budget_bytes"] / 2**20
        at = largest["at_budget"]
        ax.axhline(budget, color="gray", linestyle=":", linewidth=1)
        ax.annotate(f"budget {budget:.0f} MiB", (0, budget), xytext=(3, 3), textcoords="offset points", fontsize=7)
        for impl in ("ours", "ddp"):
            m = largest["measured"][impl]
            if "failed" not in m:
                ax.plot(
                    m["num_params"] / 1e6,
                    m["state_bytes"]["total"] / 2**20,
                    markers[impl],
                    color=_COLORS[impl],
                    markerfacecolor="none",
                    markersize=9,
                    label=f"measured params+grads+optim, {impl}, --largest",
                )
        for n, color in ((at["ddp_params"], _COLORS["ddp"]), (at["full_shard_params"], _COLORS["ours"])):
            ax.axvline(n / 1e6, color=color, linestyle=":", linewidth=1)
        ax.annotate(
            f"{at['ratio']:.2f}x DDP's largest",
            (at["full_shard_params"] / 1e6, budget),
            xytext=(-4, 5),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color=_COLORS["ours"],
        )
    ax.set_xlim(0, x_max / 1e6)
    ax.set_ylim(0, None)
    ax.set_xlabel(f"parameters (M), n_embd={args.n_embd}, depth varied")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"memory against model size, W={world_size}\n(activations not included)", fontsize=10)
    ax.legend(fontsize=6, loc="upper left")


def plot_results(payloads: list[dict[str, Any]], path: str) -> None:
    """Draw a comparison payload and/or a --largest payload into one PNG (matplotlib, Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparisons = [p for p in payloads if p.get("kind") == "comparison"]
    largest = next((p for p in payloads if p.get("kind") == "largest"), None)
    if not comparisons and largest is None:
        raise SystemExit("nothing to plot: give a --json file of a comparison or of a --largest run")
    # One row per comparison (e.g. a --transport shm run and a --transport gloo run), the memory-size panel once.
    rows, panels = max(1, len(comparisons)), 3 if comparisons else 1
    fig, axes = plt.subplots(
        rows, panels, figsize=(4.8 * panels, 4.4 * rows), dpi=90, layout="constrained", squeeze=False
    )
    for row, comparison in zip(axes, comparisons, strict=False):
        _plot_step_time(row[0], comparison)
        _plot_state_bytes(row[1], comparison)
    _plot_memory_vs_size(axes[0][-1], comparisons[0] if comparisons else None, largest)
    for row in axes[1:]:
        row[-1].axis("off")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
