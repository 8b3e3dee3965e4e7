"""A run's monitor file and metrics, read into plain dataclasses: the one place that knows the file formats.

``fsdp_monitor.jsonl`` (written by ``lightning_fsdp.FSDPMonitor``) holds one JSON object a line: a ``run`` header
first, then ``interval`` and ``warning`` lines. Reading is lenient where a real run can leave odd data behind --
extra keys from a newer monitor, nulls for what a device cannot measure, a last line cut off by a killed process,
no ``metrics.csv`` -- and strict only where the file cannot be the monitor's at all. Nothing here unpickles:
the inputs are JSON and CSV from a run folder that may come from anywhere.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "METRICS_FILE",
    "MONITOR_FILE",
    "Interval",
    "MonitorWarning",
    "RankInterval",
    "ReportError",
    "RunHeader",
    "RunRecord",
    "Straggler",
    "Traffic",
    "load_run",
]

MONITOR_FILE = "fsdp_monitor.jsonl"
METRICS_FILE = "metrics.csv"
FORMAT_VERSION = 1


class ReportError(ValueError):
    """A run folder that cannot be reported; the message names the file and what to do."""


@dataclass(frozen=True)
class RunHeader:
    """The monitor's first line: what stays fixed for the whole run."""

    world_size: int
    hosts: tuple[str, ...]
    units: tuple[str, ...]
    parameters: int | None
    estimate_bytes_per_rank: int | None
    device: str
    every_n_steps: int | None
    flops_per_sample: float | None
    peak_flops: float | None
    started: float | None


@dataclass(frozen=True)
class RankInterval:
    """One rank's means over an interval; ``None`` where the monitor could not measure it."""

    rank: int
    step_s: float | None
    compute_s: float | None
    exposed_comm_s: float | None
    peer_wait_s: float | None
    peak_bytes: int | None
    resident_bytes: int | None
    limit_bytes: int | None
    samples_per_s: float | None
    tokens_per_s: float | None


@dataclass(frozen=True)
class Traffic:
    """Bytes one unit (or one transport) moves per step."""

    gathered_bytes: float
    reduced_bytes: float


@dataclass(frozen=True)
class Straggler:
    """The slowest rank of an interval and its lead over the others."""

    rank: int
    slower_by_s: float | None
    slower_by: float | None


@dataclass(frozen=True)
class Interval:
    """One ``interval`` line: the ``steps`` optimizer steps up to global step ``step``."""

    step: int
    steps: int
    time: float | None
    ranks: tuple[RankInterval, ...]
    units: dict[str, Traffic]
    transports: dict[str, Traffic]
    straggler: Straggler | None
    samples_per_s: float | None
    tokens_per_s: float | None
    mfu: float | None


@dataclass(frozen=True)
class MonitorWarning:
    """One ``warning`` line, as the monitor raised it during the run."""

    step: int | None
    code: str
    message: str


@dataclass(frozen=True)
class RunRecord:
    """Everything a report shows about one run.

    ``losses`` maps a metrics.csv column with ``loss`` in its name to its ``(step, value)`` points; it is empty
    without a metrics.csv. ``unreadable_lines`` are the 1-based numbers of monitor lines that were not JSON
    objects -- normally only a last line cut off by a killed run.
    """

    monitor_file: Path
    header: RunHeader
    intervals: tuple[Interval, ...]
    warnings: tuple[MonitorWarning, ...]
    losses: dict[str, tuple[tuple[int, float], ...]]
    unreadable_lines: tuple[int, ...]


def load_run(run_dir: str | Path) -> RunRecord:
    """Read ``RUN_DIR/fsdp_monitor.jsonl`` and, when present, ``RUN_DIR/metrics.csv``.

    ``run_dir`` may also name the monitor file itself. Lines of a kind not known here are skipped: a newer
    monitor may add kinds, and what this code knows of the file is still right. Raises :class:`ReportError` for
    a folder without the monitor file, a file that does not start with a run header, or a format version this
    code does not know.
    """
    path = Path(run_dir)
    monitor_file = path if path.is_file() else path / MONITOR_FILE
    if not monitor_file.is_file():
        raise ReportError(
            f"{path} has no {MONITOR_FILE}: pass the logger's folder of a run trained with the "
            "lightning_fsdp.FSDPMonitor callback (e.g. runs/demo/version_0), or add that callback and train again"
        )
    lines, unreadable = _json_lines(monitor_file)
    if not lines or lines[0][1].get("kind") != "run":
        raise ReportError(
            f'{monitor_file} does not start with a run header line ({{"kind": "run", ...}}), so it was not '
            "written by lightning_fsdp.FSDPMonitor; pass the folder of a run that the monitor recorded"
        )
    header = _header(monitor_file, lines[0][1])
    intervals, warnings = [], []
    for number, obj in lines[1:]:
        if obj.get("kind") == "interval":
            interval = _interval(obj)
            if interval is None:
                unreadable.append(number)
            else:
                intervals.append(interval)
        elif obj.get("kind") == "warning":
            warnings.append(_warning(obj))
    losses = _losses(monitor_file.parent / METRICS_FILE)
    return RunRecord(monitor_file, header, tuple(intervals), tuple(warnings), losses, tuple(sorted(unreadable)))


def _json_lines(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[int]]:
    """The file's JSON objects with their line numbers, and the numbers of the lines that are not one."""
    objects, unreadable = [], []
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                unreadable.append(number)
                continue
            if isinstance(obj, dict):
                objects.append((number, obj))
            else:
                unreadable.append(number)
    return objects, unreadable


def _header(path: Path, obj: dict[str, Any]) -> RunHeader:
    version = obj.get("version")
    if version != FORMAT_VERSION:
        raise ReportError(
            f"{path} is in monitor format version {version!r}, but this lightning_fsdp reads version "
            f"{FORMAT_VERSION} only: report it with the lightning_fsdp release that wrote it, or upgrade"
        )
    world_size = _int(obj.get("world_size"))
    if world_size is None or world_size < 1:
        raise ReportError(f"{path}: the run header has no valid world_size; the file is damaged, train again")
    return RunHeader(
        world_size=world_size,
        hosts=tuple(str(host) for host in _list(obj.get("hosts"))),
        units=tuple(str(unit) for unit in _list(obj.get("units"))),
        parameters=_int(obj.get("parameters")),
        estimate_bytes_per_rank=_int(obj.get("estimate_bytes_per_rank")),
        device=str(obj.get("device") or "unknown"),
        every_n_steps=_int(obj.get("every_n_steps")),
        flops_per_sample=_float(obj.get("flops_per_sample")),
        peak_flops=_float(obj.get("peak_flops")),
        started=_float(obj.get("started")),
    )


def _interval(obj: dict[str, Any]) -> Interval | None:
    """``None`` for an interval line without a step: there is nowhere to put it on a chart."""
    step = _int(obj.get("step"))
    if step is None:
        return None
    ranks = tuple(_rank(entry) for entry in _list(obj.get("ranks")) if isinstance(entry, dict))
    straggler = obj.get("straggler")
    return Interval(
        step=step,
        steps=_int(obj.get("steps")) or 0,
        time=_float(obj.get("time")),
        ranks=tuple(sorted((rank for rank in ranks if rank is not None), key=lambda rank: rank.rank)),
        units=_traffic_table(obj.get("units")),
        transports=_traffic_table(obj.get("transports")),
        straggler=_straggler(straggler) if isinstance(straggler, dict) else None,
        samples_per_s=_float(obj.get("samples_per_s")),
        tokens_per_s=_float(obj.get("tokens_per_s")),
        mfu=_float(obj.get("mfu")),
    )


def _rank(obj: dict[str, Any]) -> RankInterval | None:
    rank = _int(obj.get("rank"))
    if rank is None:
        return None
    return RankInterval(
        rank=rank,
        step_s=_float(obj.get("step_s")),
        compute_s=_float(obj.get("compute_s")),
        exposed_comm_s=_float(obj.get("exposed_comm_s")),
        peer_wait_s=_float(obj.get("peer_wait_s")),
        peak_bytes=_int(obj.get("peak_bytes")),
        resident_bytes=_int(obj.get("resident_bytes")),
        limit_bytes=_int(obj.get("limit_bytes")),
        samples_per_s=_float(obj.get("samples_per_s")),
        tokens_per_s=_float(obj.get("tokens_per_s")),
    )


def _traffic_table(obj: Any) -> dict[str, Traffic]:
    if not isinstance(obj, dict):
        return {}
    return {
        str(name): Traffic(_float(entry.get("gathered_bytes")) or 0.0, _float(entry.get("reduced_bytes")) or 0.0)
        for name, entry in obj.items()
        if isinstance(entry, dict)
    }


def _straggler(obj: dict[str, Any]) -> Straggler | None:
    rank = _int(obj.get("rank"))
    if rank is None:
        return None
    return Straggler(rank, _float(obj.get("slower_by_s")), _float(obj.get("slower_by")))


def _warning(obj: dict[str, Any]) -> MonitorWarning:
    return MonitorWarning(_int(obj.get("step")), str(obj.get("code") or "unknown"), str(obj.get("message") or ""))


def _losses(path: Path) -> dict[str, tuple[tuple[int, float], ...]]:
    """The loss columns of the CSVLogger's file; a missing file or a cell that is not a number is left out."""
    if not path.is_file():
        return {}
    curves: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="", encoding="utf-8", errors="replace") as file:
        for row in csv.DictReader(file):
            step = _int(_parse_number(row.get("step")))
            if step is None:
                continue
            for column, cell in row.items():
                value = _parse_number(cell)
                if column and "loss" in column and value is not None:
                    curves.setdefault(column, []).append((step, value))
    return {column: tuple(points) for column, points in sorted(curves.items())}


def _parse_number(cell: str | None) -> float | None:
    try:
        value = float(cell) if cell else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def _float(value: Any) -> float | None:
    """A finite number as float; ``None`` for null, a bool, a string or NaN (JSON from Python can hold NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    number = _float(value)
    return int(number) if number is not None else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
