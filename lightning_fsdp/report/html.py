"""One self-contained HTML page for a run: tables and inline SVG charts, nothing fetched when it is viewed.

The page must open from a laptop's disk or a CI artifact years later, so it has no scripts, no external fonts or
stylesheets and no images by reference: the charts are matplotlib's SVG with text left as text (searchable, and
small). Every string that came from the run's files goes through ``escape`` -- unit and host names are the
user's, and a page that runs markup from a file it reports on would be a way in.
"""

from __future__ import annotations

import io
import math
import os
import statistics
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_fsdp.report.data import Interval, RankInterval, ReportError, RunRecord, Traffic, load_run

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["MARKER", "REPORT_FILE", "render_html", "write_report"]

REPORT_FILE = "fsdp_report.html"
# The second line of every page written here; ``write_report`` replaces a file only when it finds it there.
MARKER = "<!-- lightning-fsdp report: written by lightning_fsdp.report, replaced when the report is rewritten -->"
STRAGGLER_ROWS = 50
OFF_SCALE = 4.0  # a memory level further above the highest peak than this is named, not drawn (see _draw_memory)
COLORS = {"compute": "#4c72b0", "exposed comm": "#dd8452", "peer wait": "#c44e52", "other": "#b0b0b0"}
STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1100px; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.7em; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
caption { text-align: left; font-weight: 600; padding: 0.3em 0; }
dl.summary { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1.5em; }
dl.summary dt { font-weight: 600; } dl.summary dd { margin: 0; }
figure { margin: 1em 0; } figure svg { width: 100%; height: auto; display: block; }
figcaption, p.note { color: #555; font-size: 0.92em; }
ul.warnings li { margin: 0.2em 0; } code { background: #f4f4f4; padding: 0 0.2em; }
"""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render ``run_dir``'s report into ``out`` (default ``RUN_DIR/fsdp_report.html``) and return its path.

    The page appears whole or not at all (a temporary file beside it, then ``os.replace``), and a file already
    at ``out`` is replaced only if it is a report written here: the marker comment says so.
    """
    run = load_run(run_dir)
    target = Path(out) if out is not None else run.monitor_file.parent / REPORT_FILE
    _check_replaceable(target)
    page = render_html(run)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(page)
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the page from whoever the run folder is shared with
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise
    return target


def _check_replaceable(target: Path) -> None:
    if not target.parent.is_dir():
        raise ReportError(f"cannot write {target}: its folder {target.parent} does not exist; create it first")
    if target.is_dir():
        raise ReportError(f"cannot write {target}: it is a folder; pass a file path to --out")
    if target.exists():
        with open(target, "rb") as file:
            start = file.read(1024).decode("utf-8", errors="replace")
        if MARKER not in start:
            raise ReportError(
                f"{target} exists and is not a report written by lightning-fsdp report; it is left as it is: "
                "choose another --out, or move that file away"
            )


def render_html(run: RunRecord) -> str:
    """The whole page for ``run``, as text."""
    sections = [
        _summary_section(run),
        _step_time_section(run),
        _memory_section(run),
        _communication_section(run),
        _straggler_section(run),
        _warnings_section(run),
    ]
    folder = run.monitor_file.resolve().parent
    title = f"FSDP report: {folder.parent.name}/{folder.name}"
    return "\n".join(
        [
            "<!DOCTYPE html>",
            MARKER,
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{escape(title)}</title>",
            f"<style>{STYLE}</style></head><body>",
            f"<h1>{escape(title)}</h1>",
            f'<p class="note">From <code>{escape(str(run.monitor_file.resolve()))}</code>.</p>',
            *sections,
            "</body></html>",
            "",
        ]
    )


# ---- sections ----------------------------------------------------------------------------------------------


def _summary_section(run: RunRecord) -> str:
    header, intervals = run.header, run.intervals
    last = intervals[-1] if intervals else None
    rows = [
        ("world size", f"{header.world_size} ranks"),
        ("hosts", _hosts_text(header.hosts)),
        ("parameters", _count_text(header.parameters)),
        ("device", header.device),
        ("steps covered", _steps_text(intervals, header.every_n_steps)),
        ("started", _time_text(header.started)),
        ("samples/s (last interval)", _number_text(last.samples_per_s if last else None)),
        ("tokens/s (last interval)", _number_text(last.tokens_per_s if last else None)),
        ("MFU (last interval)", _percent_text(last.mfu if last else None)),
    ]
    items = "".join(f"<dt>{escape(name)}</dt><dd>{escape(value)}</dd>" for name, value in rows)
    notes = ""
    if run.unreadable_lines:
        numbers = ", ".join(str(number) for number in run.unreadable_lines)
        notes = (
            f'<p class="note">Skipped line(s) {numbers} of {escape(run.monitor_file.name)}: not a complete record '
            "(a run killed while writing leaves its last line cut off).</p>"
        )
    return f'<section id="summary"><h2>Run</h2><dl class="summary">{items}</dl>{notes}</section>'


def _step_time_section(run: RunRecord) -> str:
    intervals = [interval for interval in run.intervals if interval.ranks]
    title = "<h2>Step time over training</h2>"
    if not intervals:
        return f'<section id="step-time">{title}<p class="note">No interval was recorded.</p></section>'
    figure, (time_axes, loss_axes) = _figure(2, height=6.5, height_ratios=(3, 2))
    first = _draw_breakdown(time_axes, intervals, run.header.every_n_steps)
    _draw_losses(loss_axes, run.losses)
    caption = (
        f"Stacked bars: rank {first}'s mean compute, exposed communication (waiting on a collective not hidden "
        "behind compute), peer wait (waiting for slower ranks) and the rest of its step (data loading, optimizer, "
        "logging), per interval. Line: the mean step time of the slowest rank."
    )
    if run.losses:
        caption += " Below: the loss columns of metrics.csv."
    return f'<section id="step-time">{title}{_svg_figure(figure, caption)}{_breakdown_table(intervals)}</section>'


def _draw_breakdown(axes: Axes, intervals: Sequence[Interval], every_n_steps: int | None) -> int:
    """Rank 0's breakdown, stacked, with the slowest rank's step time as a line above it; returns the rank drawn.

    Rank 0 rather than a maximum over ranks: the four parts of one rank add up to its step time, while maxima
    taken part by part come from different ranks and add up to a step nobody ran. Rank 0 waits for the others,
    so a straggler shows here as peer wait, and the line shows the step time the run actually paced at.
    """
    # Each bar spans the steps its interval covers, so it lines up with the loss curve below.
    spans = [interval.steps or every_n_steps or 1 for interval in intervals]
    centers = [interval.step - (span - 1) / 2 for interval, span in zip(intervals, spans, strict=True)]
    widths = [0.85 * span for span in spans]
    parts = _breakdown(interval.ranks[0] for interval in intervals)
    slowest = [
        max((rank.step_s for rank in interval.ranks if rank.step_s is not None), default=math.nan)
        for interval in intervals
    ]
    totals = [sum(values) for values in zip(*parts.values(), strict=True)]
    scale, unit = _time_scale(max(_finite(slowest + totals), default=0))
    bottom = [0.0] * len(intervals)
    for name, values in parts.items():
        heights = [value * scale for value in values]
        axes.bar(centers, heights, widths, bottom=bottom, label=name, color=COLORS[name])
        bottom = [low + height for low, height in zip(bottom, heights, strict=True)]
    axes.plot(centers, [value * scale for value in slowest], color="black", marker=".", label="slowest rank")
    axes.set_ylim(0, max(_finite(slowest + totals), default=1) * scale * 1.25 or 1)
    axes.set_ylabel(f"mean step time ({unit})")
    first = intervals[0].ranks[0].rank
    axes.set_title(f"rank {first}: where a step's time goes", loc="left", fontsize=10)
    axes.legend(loc="upper left", fontsize=8, ncols=5)
    return first


def _draw_losses(axes: Axes, losses: dict[str, tuple[tuple[int, float], ...]]) -> None:
    if losses:
        for column, points in losses.items():
            axes.plot([step for step, _ in points], [value for _, value in points], marker=".", label=_plain(column))
        axes.set_ylabel("loss")
        axes.legend(fontsize=8)
    else:
        message = "no metrics.csv beside the monitor file"
        axes.text(0.5, 0.5, message, ha="center", va="center", transform=axes.transAxes, color="#777")
    axes.set_xlabel("global step")


def _breakdown(ranks: Iterable[RankInterval]) -> dict[str, list[float]]:
    """Seconds per part; ``other`` is what the three measured parts leave of the step (never below zero)."""
    parts: dict[str, list[float]] = {name: [] for name in COLORS}
    for rank in ranks:
        measured = [rank.compute_s or 0.0, rank.exposed_comm_s or 0.0, rank.peer_wait_s or 0.0]
        for name, value in zip(("compute", "exposed comm", "peer wait"), measured, strict=True):
            parts[name].append(value)
        parts["other"].append(max(0.0, (rank.step_s or 0.0) - sum(measured)))
    return parts


def _breakdown_table(intervals: Sequence[Interval]) -> str:
    """The numbers behind the last bars, per rank: the chart shows rank 0, the table every rank."""
    last = intervals[-1]
    rows = [
        [
            str(rank.rank),
            *(_seconds_text(value) for value in (rank.step_s, rank.compute_s, rank.exposed_comm_s, rank.peer_wait_s)),
        ]
        for rank in last.ranks
    ]
    return _table(
        f"Last interval (step {last.step}), mean per step",
        ["rank", "step", "compute", "exposed comm", "peer wait"],
        rows,
    )


def _memory_section(run: RunRecord) -> str:
    intervals = [interval for interval in run.intervals if interval.ranks]
    title = "<h2>Memory per rank</h2>"
    if not intervals:
        return f'<section id="memory">{title}<p class="note">No interval was recorded.</p></section>'
    figure, (axes,) = _figure(1, height=3.8)
    off_scale = _draw_memory(axes, intervals, run.header.estimate_bytes_per_rank)
    caption = (
        "Lines: each rank's peak memory in the interval (peak_bytes). Dashed: the rank's limit (limit_bytes, the "
        "lowest over ranks); dotted: the monitor's estimate for this model and sharding (estimate_bytes_per_rank)."
    )
    if off_scale:
        caption += f" Not drawn, more than {OFF_SCALE:g} times the highest peak: {', '.join(off_scale)}."
    last = intervals[-1]
    rows = [
        [
            str(rank.rank),
            _bytes_text(rank.peak_bytes),
            _bytes_text(rank.resident_bytes),
            _bytes_text(rank.limit_bytes),
            _percent_text(rank.peak_bytes / rank.limit_bytes if rank.peak_bytes and rank.limit_bytes else None),
        ]
        for rank in last.ranks
    ]
    table = _table(f"Last interval (step {last.step})", ["rank", "peak", "resident", "limit", "peak / limit"], rows)
    return f'<section id="memory">{title}{_svg_figure(figure, caption)}{table}</section>'


def _draw_memory(axes: Axes, intervals: Sequence[Interval], estimate: int | None) -> list[str]:
    """Peaks per rank with the limit and the estimate; returns what was left off for being far above the peaks.

    A CPU rank's limit is its share of the host's memory, often many times what it uses: drawn to scale, it would
    flatten every peak into the axis, so a level more than ``OFF_SCALE`` times the highest peak is only named.
    """
    steps = [interval.step for interval in intervals]
    ranks = sorted({rank.rank for interval in intervals for rank in interval.ranks})
    peaks = {rank: [_peak(interval, rank) for interval in intervals] for rank in ranks}
    limits = [min((r.limit_bytes for r in interval.ranks if r.limit_bytes), default=math.nan) for interval in intervals]
    top = max(_finite([value for values in peaks.values() for value in values]), default=0)
    on_scale = [value for value in [*limits, estimate or math.nan] if math.isfinite(value) and value <= OFF_SCALE * top]
    scale, unit = _bytes_scale(max([top, *on_scale]))
    for rank in ranks:
        axes.plot(steps, [value * scale for value in peaks[rank]], marker=".", label=f"rank {rank} peak")
    off_scale = []
    if any(limit in on_scale for limit in limits):
        axes.plot(steps, [limit * scale for limit in limits], linestyle="--", color="black", label="limit")
    elif _finite(limits):
        off_scale.append(f"limit {_bytes_text(max(_finite(limits)))}")
    if estimate in on_scale:
        axes.axhline(estimate * scale, linestyle=":", color="#555", label="estimate")
    elif estimate:
        off_scale.append(f"estimate {_bytes_text(estimate)}")
    axes.set_ylim(0, max([top, *on_scale]) * scale * 1.15 or 1)
    axes.set_ylabel(f"peak memory ({unit})")
    axes.set_xlabel("global step")
    axes.legend(fontsize=8, ncols=4, loc="best")
    return off_scale


def _peak(interval: Interval, rank: int) -> float:
    found = [r.peak_bytes for r in interval.ranks if r.rank == rank and r.peak_bytes is not None]
    return float(found[0]) if found else math.nan


def _communication_section(run: RunRecord) -> str:
    title = "<h2>Communication per unit</h2>"
    units = _mean_traffic(run.intervals, "units", run.header.units)
    transports = _mean_traffic(run.intervals, "transports", ())
    if not units and not transports:
        return f'<section id="communication">{title}<p class="note">No traffic was recorded.</p></section>'
    parts = []
    if units:
        caption = (
            "Bytes each sharding unit moves per step, summed over ranks and averaged over the intervals: gathered "
            "(the all-gathers of its parameters, forward and backward) and reduced (the reduce-scatter of its "
            "gradients)."
        )
        parts.append(_svg_figure(_traffic_figure(units), caption))
        parts.append(_traffic_table("Per unit, per step", "unit", units))
    if transports:
        caption = "The same bytes split by the transport that carried them (e.g. shared memory within a host)."
        parts.append(_svg_figure(_traffic_figure(transports), caption))
        parts.append(_traffic_table("Per transport, per step", "transport", transports))
    return f'<section id="communication">{title}{"".join(parts)}</section>'


def _mean_traffic(intervals: Sequence[Interval], field: str, order: Sequence[str]) -> dict[str, Traffic]:
    """Per-step bytes averaged over intervals, weighted by the steps each covers; names in ``order`` first."""
    totals: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in order}
    for interval in intervals:
        weight = interval.steps or 1
        for name, traffic in getattr(interval, field).items():
            total = totals.setdefault(name, [0.0, 0.0, 0.0])
            total[0] += traffic.gathered_bytes * weight
            total[1] += traffic.reduced_bytes * weight
            total[2] += weight
    return {name: Traffic(g / w, r / w) for name, (g, r, w) in totals.items() if w}


def _traffic_figure(table: dict[str, Traffic]) -> Figure:
    names = list(table)
    figure, (axes,) = _figure(1, height=1.2 + 0.32 * len(names))
    scale, unit = _bytes_scale(max(max(t.gathered_bytes, t.reduced_bytes) for t in table.values()))
    rows = range(len(names))
    axes.barh([row - 0.2 for row in rows], [table[n].gathered_bytes * scale for n in names], 0.4, label="gathered")
    axes.barh([row + 0.2 for row in rows], [table[n].reduced_bytes * scale for n in names], 0.4, label="reduced")
    axes.set_yticks(list(rows), [_plain(name) for name in names], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(f"{unit} per step")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure


def _traffic_table(caption: str, kind: str, table: dict[str, Traffic]) -> str:
    rows = [[name, _bytes_text(t.gathered_bytes), _bytes_text(t.reduced_bytes)] for name, t in table.items()]
    return _table(caption, [kind, "gathered", "reduced"], rows, text_columns=1)


def _straggler_section(run: RunRecord) -> str:
    title = "<h2>Stragglers</h2>"
    marked = [interval for interval in run.intervals if interval.straggler is not None]
    if not marked:
        return f'<section id="stragglers">{title}<p class="note">No interval named a slowest rank.</p></section>'
    slowest = Counter(interval.straggler.rank for interval in marked)
    summary_rows = []
    for rank, count in slowest.most_common():
        leads = [i.straggler.slower_by_s for i in marked if i.straggler.rank == rank and i.straggler.slower_by_s]
        fractions = [i.straggler.slower_by for i in marked if i.straggler.rank == rank and i.straggler.slower_by]
        summary_rows.append(
            [
                str(rank),
                f"{count} of {len(marked)}",
                _seconds_text(statistics.fmean(leads) if leads else None),
                _percent_text(max(fractions, default=None)),
            ]
        )
    summary = _table(
        "How often each rank was the slowest", ["rank", "slowest in", "mean lead", "largest lead"], summary_rows
    )
    worst = sorted(marked, key=lambda i: i.straggler.slower_by_s or 0.0, reverse=True)[:STRAGGLER_ROWS]
    detail_rows = [
        [
            str(i.step),
            str(i.straggler.rank),
            _seconds_text(i.straggler.slower_by_s),
            _percent_text(i.straggler.slower_by),
        ]
        for i in sorted(worst, key=lambda i: i.step)
    ]
    what = (
        "Every interval" if len(marked) <= STRAGGLER_ROWS else f"The {STRAGGLER_ROWS} intervals with the largest lead"
    )
    detail = _table(f"{what}: its slowest rank", ["step", "rank", "slower by", "slower by (fraction)"], detail_rows)
    note = (
        '<p class="note">The slowest rank of an interval is the one the others waited for; its lead is how much '
        "longer its steps took than the other ranks' (slower_by_s, and slower_by as a fraction), as the monitor "
        "measured it.</p>"
    )
    return f'<section id="stragglers">{title}{note}{summary}{detail}</section>'


def _warnings_section(run: RunRecord) -> str:
    title = "<h2>Warnings</h2>"
    if not run.warnings:
        return f'<section id="warnings">{title}<p class="note">The monitor raised no warning.</p></section>'
    counts = Counter(warning.code for warning in run.warnings)
    tally = ", ".join(f"{count} × <code>{escape(code)}</code>" for code, count in counts.most_common())
    items = "".join(
        f"<li>step {escape(str(w.step) if w.step is not None else '?')}: <code>{escape(w.code)}</code> "
        f"{escape(w.message)}</li>"
        for w in run.warnings
    )
    return f'<section id="warnings">{title}<p>{tally}</p><ul class="warnings">{items}</ul></section>'


# ---- charts ------------------------------------------------------------------------------------------------


def _figure(rows: int, *, height: float, height_ratios: Sequence[float] | None = None) -> tuple[Figure, list[Axes]]:
    """A figure that belongs to no pyplot window: nothing global is touched, no GUI backend is asked for."""
    # Imported here: matplotlib costs half a second, and every rank of `lightning-fsdp fit` imports this module.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, height), layout="constrained")
    axes = figure.subplots(rows, 1, sharex=rows > 1, squeeze=False, height_ratios=height_ratios)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_axisbelow(True)
    return figure, list(axes)


def _svg_figure(figure: Figure, caption: str) -> str:
    """The figure as inline ``<svg>``: text stays text, and the XML prologue goes (it is not allowed inline)."""
    from matplotlib import rc_context

    buffer = io.StringIO()
    with rc_context({"svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]
    return f"<figure>{svg}<figcaption>{escape(caption)}</figcaption></figure>"


def _plain(text: str) -> str:
    """Text for a matplotlib label, shown as written: a ``$`` would otherwise start mathtext."""
    return text.replace("$", r"\$")


def _time_scale(seconds: float) -> tuple[float, str]:
    return (1.0, "s") if seconds >= 1 else (1e3, "ms")


def _bytes_scale(value: float) -> tuple[float, str]:
    for exponent, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if value >= 1024**exponent:
            return 1024.0**-exponent, unit
    return 1.0, "B"


def _finite(values: Iterable[float]) -> list[float]:
    return [value for value in values if math.isfinite(value)]


# ---- text --------------------------------------------------------------------------------------------------


def _table(caption: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *, text_columns: int = 0) -> str:
    """A table whose first ``text_columns`` columns are left-aligned text; every cell is escaped here."""

    def cell(tag: str, index: int, value: str) -> str:
        kind = ' class="text"' if index < text_columns else ""
        return f"<{tag}{kind}>{escape(value)}</{tag}>"

    head = "".join(cell("th", index, name) for index, name in enumerate(columns))
    body = "".join("<tr>" + "".join(cell("td", i, value) for i, value in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><caption>{escape(caption)}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _hosts_text(hosts: Sequence[str]) -> str:
    if not hosts:
        return "unknown"
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks.setdefault(host, []).append(rank)
    return "; ".join(f"{host} (ranks {', '.join(map(str, members))})" for host, members in ranks.items())


def _steps_text(intervals: Sequence[Interval], every_n_steps: int | None) -> str:
    if not intervals:
        return "none (no interval was recorded)"
    first = intervals[0].step - intervals[0].steps + 1
    every = f", one every {every_n_steps} steps" if every_n_steps else ""
    return f"{max(first, 0)} to {intervals[-1].step} ({len(intervals)} intervals{every})"


def _count_text(count: int | None) -> str:
    if count is None:
        return "unknown"
    for exponent, suffix in ((9, "B"), (6, "M"), (3, "k")):
        if count >= 10**exponent:
            return f"{count:,} ({count / 10**exponent:.2f} {suffix})"
    return f"{count:,}"


def _time_text(unix_time: float | None) -> str:
    if unix_time is None:
        return "unknown"
    return datetime.fromtimestamp(unix_time, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _bytes_text(value: float | None) -> str:
    if value is None:
        return "–"
    scale, unit = _bytes_scale(value)
    return f"{value * scale:.1f} {unit}" if unit != "B" else f"{value:.0f} B"


def _seconds_text(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3f} s" if value >= 1 else f"{value * 1e3:.1f} ms"


def _number_text(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"


def _percent_text(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"
