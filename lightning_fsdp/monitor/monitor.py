"""``FSDPMonitor``: where a sharded run's step and memory go, every few steps, for the Trainer and for Fabric.

Rank 0 logs the metrics of ``METRICS`` through the loggers and writes every interval to ``fsdp_monitor.jsonl``, the
file ``lightning-fsdp report`` reads; its fields are in [Note: fsdp_monitor.jsonl] above ``FILE_NAME``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lightning_fsdp.engine.diagnostics.step_stats import STEP_STATS, StatsSnapshot
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.runtime.unit import FSDPUnit
from lightning_fsdp.engine.transport.hosts import host_identity
from lightning_fsdp.estimate import STRATEGIES, estimate_memory
from lightning_fsdp.monitor.advice import Advisor, RunFacts
from lightning_fsdp.monitor.interval import RankSample, combine, metrics_of, row_length
from lightning_fsdp.monitor.memory import read_memory

log = logging.getLogger("lightning_fsdp.monitor")
# torch 2.13 renamed the flat-tensor all-gather; older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# [Note: fsdp_monitor.jsonl] The file ``lightning-fsdp report`` reads; rank 0 writes it, one JSON object per line, each
# flushed as written. Keep the fields; add new ones only with a new ``version``.
#
# - first, ``{"kind": "run", "version": 1, "world_size", "hosts"`` (each rank's host identity, see
#   ``engine/transport/hosts.py``)``, "units"`` (the engine's unit names, parents first)``, "parameters"`` (the model's
#   count, unsharded)``, "estimate_bytes_per_rank"`` (``estimate_memory``'s peak, plus what it puts in CPU memory when
#   the device is the CPU; null when the engine does not shard the model)``, "device"`` ("cpu" | "cuda")``,
#   "every_n_steps", "flops_per_sample", "peak_flops", "started"`` (unix time)``}``;
# - every interval, ``{"kind": "interval", "step"`` (the global step it ends at)``, "steps"`` (optimizer steps it
#   covers)``, "time", "ranks": [{"rank", "step_s", "compute_s", "exposed_comm_s", "peer_wait_s"`` (seconds, means per
#   step)``, "peak_bytes", "resident_bytes", "limit_bytes", "samples_per_s", "tokens_per_s"}, ...]`` (one per rank, in
#   rank order)``, "units": {name: {"gathered_bytes", "reduced_bytes"}}`` (every unit; per step, summed over ranks)``,
#   "transports": {key: {...}}`` (the same, by transport key of ``engine/step_stats.TRANSPORT_KEYS``; only those that
#   moved bytes)``, "straggler": {"rank", "slower_by_s", "slower_by"}`` (the rank with the longest compute, by how much
#   longer than the shortest, in seconds and as a fraction of the fastest rank's step)``, "samples_per_s",
#   "tokens_per_s"`` (the job's: summed over ranks; null if unknown)``, "mfu"}`` (null unless configured);
# - a warning, ``{"kind": "warning", "step", "code"`` ("exposed_communication" | "straggler" | "memory")``,
#   "message"}``, at most once per code.
FILE_NAME = "fsdp_monitor.jsonl"
FILE_VERSION = 1

#: What the monitor logs every interval, through the Trainer's loggers or ``Fabric.log_dict`` (rank 0). Seconds are
#: per optimizer step; MiB are 2**20 bytes.
METRICS = (
    "fsdp/step_s",  # rank 0's mean step
    "fsdp/compute_s",  # rank 0's step outside the engine's collectives
    "fsdp/exposed_comm_s",  # rank 0's time in collectives that moved bytes compute did not hide
    "fsdp/peer_wait_s",  # rank 0's time in collectives waiting for a slower rank
    "fsdp/exposed_comm_s_max",  # the worst rank's exposed communication
    "fsdp/gathered_mb",  # all-gather payload per step, summed over ranks
    "fsdp/reduced_mb",  # reduce-scatter and all-reduce payload per step, summed over ranks
    "fsdp/peak_mb",  # the highest peak of any rank
    "fsdp/resident_mb",  # the highest resident memory of any rank
    "fsdp/memory_fraction",  # the highest peak / limit of any rank
    "fsdp/straggler_rank",  # the rank with the longest compute
    "fsdp/straggler_slower_by",  # its compute minus the fastest rank's, as a fraction of the fastest rank's step
    "fsdp/samples_per_s",  # the whole job's (absent when a batch's size is unknown)
    "fsdp/tokens_per_s",  # the whole job's (absent unless batches are integer tensors of token ids)
    "fsdp/mfu",  # model FLOP utilisation (absent unless flops_per_sample and peak_flops are given)
)


@dataclass(frozen=True)
class _Run:
    """Where the monitor runs: the model, this rank among the others, and where the results go (rank 0)."""

    model: nn.Module
    rank: int
    world_size: int
    device: torch.device
    directory: str | None
    log_metrics: Callable[[dict[str, float], int], None] | None
    optimizer: torch.optim.Optimizer | None


class FSDPMonitor(Callback):
    """Every ``every_n_steps`` optimizer steps, where the step and the memory of each rank go.

    Per rank: the mean step split into compute, exposed communication and waiting for peers (see [Note: splitting a
    step] in ``interval.py``), peak and resident memory against the rank's limit (its share of the host's memory on
    CPU, the device's on CUDA; ``memory_limit_bytes`` overrides it); for the job: bytes gathered and reduced per step
    by unit and by transport (summed over ranks), the straggler, samples/s, tokens/s and MFU (``flops_per_sample``
    FLOPs per sample, forward and backward, against ``peak_flops`` FLOP/s per rank). The first step is warm-up and is
    left out of the first interval.

    Rank 0 logs the metrics below through the loggers and writes every interval to ``fsdp_monitor.jsonl`` in
    ``dirpath`` (default: the Trainer's ``log_dir``, Fabric's logger's ``log_dir``), one JSON object per line: a
    ``"run"`` line first (the file is started afresh for each run), then ``"interval"`` and ``"warning"`` lines;
    ``lightning-fsdp report`` reads it. With ``warn``, a problem a setting can fix -- exposed communication above
    ``exposed_comm_warn`` of the step or the same straggler by more than ``straggler_warn`` of a step for two
    intervals in a row, a peak above ``memory_warn`` of the limit -- is logged once (logger
    ``lightning_fsdp.monitor``) with the settings to try.

    Logged metrics: ``fsdp/step_s``, ``fsdp/compute_s``, ``fsdp/exposed_comm_s``, ``fsdp/peer_wait_s`` (rank 0's),
    ``fsdp/exposed_comm_s_max`` (the worst rank's), ``fsdp/gathered_mb``, ``fsdp/reduced_mb`` (per step, summed over
    ranks), ``fsdp/peak_mb``, ``fsdp/resident_mb``, ``fsdp/memory_fraction`` (the worst rank's),
    ``fsdp/straggler_rank``, ``fsdp/straggler_slower_by``, ``fsdp/samples_per_s``, ``fsdp/tokens_per_s``, ``fsdp/mfu``
    (the job's; the last three only when known); see :data:`METRICS`.

    Under the Trainer a step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (data loading,
    validation and checkpoints between batches are left out); under Fabric from one :meth:`step` call to the next.
    Times are the host's: on CUDA the interval's last step synchronises the device, and waits on NCCL's streams do not
    block the host, so there exposed communication reads low.

    Cost: two clock readings and two copies of the engine's counters per step, one small all-gather per interval (and
    one at the start, for the ranks' hosts).

    Fabric (or plain ``torch.distributed``, with ``fabric=None`` and a ``dirpath``)::

        monitor = FSDPMonitor(every_n_steps=50)
        model, optimizer = fabric.setup(model, optimizer)
        monitor.attach(model, fabric)
        for batch in loader:
            loss = model(batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(batch)  # or monitor.step(batch_size=8, tokens=8 * 1024)
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        dirpath: str | None = None,
        warn: bool = True,
        exposed_comm_warn: float = 0.3,
        straggler_warn: float = 0.1,
        memory_warn: float = 0.9,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
        memory_limit_bytes: int | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"FSDPMonitor(every_n_steps={every_n_steps}): it must be a positive number of steps.")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.warn = warn
        self.exposed_comm_warn, self.straggler_warn, self.memory_warn = exposed_comm_warn, straggler_warn, memory_warn
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self.memory_limit_bytes = memory_limit_bytes
        self._run: _Run | None = None
        self._units: list[str] = []
        self._ranks_on_host = 1
        self._advisor: Advisor | None = None
        self._last_step = 0
        self._opened: tuple[float, StatsSnapshot] | None = None
        self._started = 0.0
        self._clear()

    # ----- the Trainer ------------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        directory = self.dirpath or trainer.log_dir  # every rank: log_dir is a broadcast

        def log_metrics(metrics: dict[str, float], step: int) -> None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._begin(
            _Run(
                pl_module, trainer.global_rank, trainer.world_size, pl_module.device, directory, log_metrics, optimizer
            ),
            trainer.global_step,
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._open()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self._close(*batch_counts(batch), settle=self._ends_interval(step))
        self._advance(step)

    # ----- Fabric and plain torch.distributed ---------------------------------------------------------------------

    def attach(self, model: nn.Module, fabric: Any = None) -> None:
        """Watch ``model`` (after ``fabric.setup``; under plain ``torch.distributed``, after ``fully_shard``) from now
        on. ``fabric``: its loggers get the metrics and its logger's ``log_dir`` the file, unless ``dirpath`` is given;
        None: ``torch.distributed``'s ranks, and ``dirpath`` is required."""
        if fabric is not None:
            logger = fabric.logger if fabric.loggers else None
            directory = self.dirpath or getattr(logger, "log_dir", None)
            rank, world_size, device = fabric.global_rank, fabric.world_size, fabric.device
            log_metrics = fabric.log_dict
        else:
            directory = self.dirpath
            running = dist.is_available() and dist.is_initialized()
            rank, world_size = (dist.get_rank(), dist.get_world_size()) if running else (0, 1)
            device = next(model.parameters()).device
            log_metrics = None
        if directory is None:
            raise ValueError(
                "FSDPMonitor has nowhere to write fsdp_monitor.jsonl: pass FSDPMonitor(dirpath=...), or give Fabric a "
                "logger with a log_dir (e.g. Fabric(loggers=CSVLogger('logs')))."
            )
        self._begin(_Run(model, rank, world_size, device, directory, log_metrics, None), 0)

    def _begin(self, run: _Run, global_step: int) -> None:
        if run.rank == 0 and run.directory is not None:
            _refuse_foreign_file(os.path.join(run.directory, FILE_NAME))
        self._run, self._units, self._advisor = run, [], None
        self._last_step = global_step
        self._opened = None
        self._started = time.time()
        self._clear()

    def step(self, batch: Any = None, *, batch_size: int | None = None, tokens: int | None = None) -> None:
        """One optimizer step is done. Samples and tokens come from ``batch`` (its length; its number of elements if
        it is an integer tensor of token ids), or from ``batch_size`` and ``tokens`` where given."""
        if self._run is None:
            raise RuntimeError("FSDPMonitor.step() was called before FSDPMonitor.attach(model, fabric).")
        samples, counted_tokens = batch_counts(batch)
        samples = batch_size if batch_size is not None else samples
        counted_tokens = tokens if tokens is not None else counted_tokens
        self._close(samples, counted_tokens, settle=self._ends_interval(self._last_step + 1))
        self._advance(self._last_step + 1)
        self._open()

    # ----- measuring ----------------------------------------------------------------------------------------------

    def _clear(self) -> None:
        self._elapsed, self._steps, self._traffic = 0.0, 0, StatsSnapshot()
        self._samples: int | None = 0
        self._tokens: int | None = 0

    def _open(self) -> None:
        self._opened = (time.perf_counter(), STEP_STATS.snapshot())

    def _close(self, samples: int | None, tokens: int | None, settle: bool) -> None:
        if self._opened is None:
            return
        assert self._run is not None
        if settle and self._run.device.type == "cuda":
            torch.cuda.synchronize(self._run.device)  # the interval ends when the device's work does
        opened_at, stats = self._opened
        self._elapsed += time.perf_counter() - opened_at
        self._traffic = self._traffic + (STEP_STATS.snapshot() - stats)
        self._samples = None if samples is None or self._samples is None else self._samples + samples
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens
        self._opened = None

    def _ends_interval(self, step: int) -> bool:
        """Whether the optimizer's step count crossed a multiple of ``every_n_steps`` (it may move by more than one a
        batch: manual optimization with several optimizers)."""
        crossed = step // self.every_n_steps > self._last_step // self.every_n_steps
        return crossed and self._advisor is not None

    def _advance(self, step: int) -> None:
        """A batch ended with the optimizer's ``step`` count (the same as before it: accumulating gradients)."""
        ends = self._ends_interval(step)
        self._steps, self._last_step = self._steps + step - self._last_step, step
        if self._advisor is None:  # the first step ends: the engine has named its units; its time was warm-up
            self._start()
            self._clear()
        elif ends and self._steps:
            self._report(step)
            self._clear()

    def _start(self) -> None:
        run = self._run
        assert run is not None
        units = units_under(run.model)
        self._units = [unit.name for unit in units]
        hosts = [host_identity()] * run.world_size
        if run.world_size > 1:
            dist.all_gather_object(hosts, host_identity())
        self._ranks_on_host = hosts.count(hosts[run.rank])
        facts = RunFacts(
            units[0].options.sharding_strategy.value if units else None,
            bool(units and units[0].options.forward_prefetch),
            bool(units and units[0].options.cpu_offload),
            len(set(hosts)),
            run.device.type,
        )
        self._advisor = Advisor(self.exposed_comm_warn, self.straggler_warn, self.memory_warn, facts)
        if run.rank != 0:
            return
        assert run.directory is not None
        os.makedirs(run.directory, exist_ok=True)
        line = {
            "kind": "run",
            "version": FILE_VERSION,
            "world_size": run.world_size,
            "hosts": hosts,
            "units": self._units,
            "parameters": _parameters(run.model, units),
            "estimate_bytes_per_rank": _estimate(units, run.world_size, run.device, run.optimizer),
            "device": "cuda" if run.device.type == "cuda" else "cpu",
            "every_n_steps": self.every_n_steps,
            "flops_per_sample": self.flops_per_sample,
            "peak_flops": self.peak_flops,
            "started": self._started,
        }
        self._write(line, mode="w")

    def _report(self, step: int) -> None:
        run = self._run
        assert run is not None and self._advisor is not None
        elapsed = max(self._elapsed, 1e-12)
        sample = RankSample(
            self._elapsed / self._steps,
            self._traffic.blocked_s / self._steps,
            read_memory(run.device, self._ranks_on_host, self.memory_limit_bytes),
            None if self._samples is None else self._samples / elapsed,
            None if self._tokens is None else self._tokens / elapsed,
            self._traffic,
            self._steps,
        )
        rows = _gather(sample.to_row(self._units), run.world_size, row_length(self._units))
        if run.rank != 0:
            return
        interval = combine(rows, self._units, step, self._steps, time.time(), self._mfu)
        self._write(interval)
        if run.log_metrics is not None:
            run.log_metrics(metrics_of(interval), step)
        if self.warn:
            for advice in self._advisor.review(interval):
                log.warning("lightning_fsdp: %s", advice.message)
                self._write({"kind": "warning", "step": step, "code": advice.code, "message": advice.message})

    def _mfu(self, samples_per_s: float) -> float | None:
        if self.flops_per_sample is None or self.peak_flops is None or self._run is None:
            return None
        return samples_per_s * self.flops_per_sample / (self.peak_flops * self._run.world_size)

    def _write(self, line: dict[str, Any], mode: str = "a") -> None:
        assert self._run is not None and self._run.directory is not None
        with open(os.path.join(self._run.directory, FILE_NAME), mode) as file:
            file.write(json.dumps(line) + "\n")
            file.flush()


def _refuse_foreign_file(path: str) -> None:
    """The monitor starts its file afresh each run: only over a file it wrote (a run line first), never a user's."""
    try:
        with open(path, "rb") as file:
            first = file.readline(4096)
    except FileNotFoundError:
        return
    try:
        ours = json.loads(first).get("kind") == "run"
    except (ValueError, AttributeError):
        ours = False
    if first and not ours:
        raise FileExistsError(
            f"{path} is not a record FSDPMonitor wrote, and the monitor would replace it: move it away, or give the "
            "monitor another folder with FSDPMonitor(dirpath=...)."
        )


def batch_counts(batch: Any) -> tuple[int | None, int | None]:
    """Samples and tokens in a batch: its first dimension, and its number of elements when it is an integer tensor of
    token ids (alone, or under ``"input_ids"``); None where the batch does not say."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        batch = batch["input_ids"]
    if isinstance(batch, torch.Tensor):
        samples = batch.shape[0] if batch.dim() else 1
        is_ids = not (batch.is_floating_point() or batch.is_complex() or batch.dtype is torch.bool)
        return samples, batch.numel() if is_ids else None
    if batch is None:
        return None, None
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return extract_batch_size(batch), None
    except Exception:  # noqa: BLE001 -- any batch Lightning cannot read has an unknown size, nothing worse
        return None, None


def _gather(row: torch.Tensor, world_size: int, length: int) -> torch.Tensor:
    """Every rank's row, in one all-gather over the default group."""
    if world_size == 1:
        return row.view(1, length)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else row.device
    rows = torch.empty(world_size * length, dtype=row.dtype, device=device)
    _all_gather_single(rows, row.to(device))
    return rows.view(world_size, length)


def _unit_numel(unit: FSDPUnit) -> int:
    return sum(math.prod(p.shape) for p in unit.params) + sum(p.numel() for p in unit.replicated)


def _parameters(model: nn.Module, units: list[FSDPUnit]) -> int:
    if units:
        return sum(_unit_numel(unit) for unit in units)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _estimate(
    units: list[FSDPUnit], world_size: int, device: torch.device, optimizer: torch.optim.Optimizer | None
) -> int | None:
    """``estimate_memory``'s peak for this model as the engine sharded it; None when the model is not sharded by
    the engine or its strategy has no estimate."""
    if not units or not any(unit.params for unit in units):
        return None
    options = units[0].options
    strategy = options.sharding_strategy.value
    if strategy not in STRATEGIES:
        return None
    root = sum(_unit_numel(unit) for unit in units if unit.is_root)
    children = [_unit_numel(unit) for unit in units if not unit.is_root]
    dtype = next(unit.params[0].sharded.dtype for unit in units if unit.params)
    param_dtype = options.mixed_precision.param_dtype
    estimate = estimate_memory(
        sum(_unit_numel(unit) for unit in units),
        world_size,
        strategy,
        largest_unit=max(children) if children else root,
        root_unit=root,
        shard_size=units[0].world_size,
        bytes_per_param=dtype.itemsize,
        param_dtype_bytes=param_dtype.itemsize if param_dtype is not None else None,
        optimizer_states=_optimizer_states(optimizer),
        cpu_offload=options.cpu_offload,
    )
    return estimate.peak + (estimate.cpu_offloaded if device.type == "cpu" else 0)


def _optimizer_states(optimizer: torch.optim.Optimizer | None) -> int:
    """Tensors per parameter in the optimizer's state after its first step (AdamW: 2); 2 when it cannot be told."""
    if optimizer is None:
        return 2
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:
                return sum(isinstance(v, torch.Tensor) and v.shape == param.shape for v in state.values())
    return 2
