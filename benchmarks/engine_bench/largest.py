"""--largest: the largest model ours (FULL_SHARD) and DDP fit in a per-rank budget, estimated and then measured."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from lightning_fsdp.demos.gpt import GPT
from lightning_fsdp.estimate import MemoryEstimate, estimate_memory, largest_trainable

from .config import LOSS_RTOL, BenchArgs
from .launch import spawn_impl
from .report import mib, source_line, source_state


@dataclass(frozen=True)
class ModelFamily:
    """The demo GPT at one width, by depth: its parameter count is exactly ``root + n_layer * block``.

    Depth is the knob because it leaves the largest sharding unit (a ``Block``, or its MLP under ``--wrap
    sublayer``) the same size, so the estimator's working set of gathered units stays fixed while the sharded
    part grows. Parameters of a layer outside every unit (the layer norms under ``--wrap sublayer``) belong to
    the root unit, which therefore grows by ``root_per_layer`` a layer.
    """

    block: int  # parameters of one layer (a Block)
    root: int  # parameters outside the blocks (tied embedding and head, positions, final norm)
    unit: int  # parameters of the largest sharding unit
    root_per_layer: int = 0  # parameters of a layer that no unit of that layer owns

    def params(self, n_layer: int) -> int:
        return self.root + n_layer * self.block

    def deepest(self, max_params: int) -> int:
        """The most layers whose model has at most ``max_params`` parameters."""
        return max(0, (max_params - self.root) // self.block)

    def root_unit(self, num_params: int) -> int:
        return self.root + self.root_per_layer * max(0, num_params - self.root) // self.block

    def estimate(self, num_params: int, world_size: int, strategy: str) -> MemoryEstimate:
        return estimate_memory(
            num_params, world_size, strategy, largest_unit=self.unit, root_unit=self.root_unit(num_params)
        )

    def largest(self, budget_bytes: int, world_size: int, strategy: str) -> int:
        # The root grows with depth (by root_per_layer); take it at the deepest model the budget could hold with
        # no working set at all, which overstates it by a few layer norms at most: conservative.
        deepest = largest_trainable(budget_bytes, world_size, strategy, largest_unit=0, root_unit=0)
        return largest_trainable(
            budget_bytes, world_size, strategy, largest_unit=self.unit, root_unit=self.root_unit(deepest)
        )


def model_family(args: BenchArgs) -> ModelFamily:
    """Count one block, its units and the rest on the meta device (no memory), at the width ``args`` gives."""
    with torch.device("meta"):
        model = GPT(replace(args.gpt_config(), n_layer=1))
    block = sum(p.numel() for p in model.blocks[0].parameters())
    units = [m for m in model.blocks[0].modules() if isinstance(m, tuple(args.wrapped()))]
    unit_sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    return ModelFamily(
        block=block,
        root=sum(p.numel() for p in model.parameters()) - block,
        unit=max(unit_sizes),
        root_per_layer=block - sum(unit_sizes),
    )


def largest_at(family: ModelFamily, budget_bytes: int, world_size: int) -> dict[str, Any]:
    """The largest DDP and FULL_SHARD models whose estimated per-rank peak fits ``budget_bytes``."""
    ddp = family.largest(budget_bytes, world_size, "DDP")
    full_shard = family.largest(budget_bytes, world_size, "FULL_SHARD")
    return {
        "budget_bytes": budget_bytes,
        "ddp_params": ddp,
        "full_shard_params": full_shard,
        "ratio": full_shard / ddp if ddp else None,
        "ddp_layers": family.deepest(ddp),
        "full_shard_layers": family.deepest(full_shard),
    }


def _one_step_summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A --largest run's numbers: the worst rank's bytes, the rank-mean loss curve."""
    return {
        "num_params": ranks[0]["num_params"],
        "state_bytes": {k: max(r["state_bytes"][k] for r in ranks) for k in ranks[0]["state_bytes"]},
        "step_start_tensor_bytes": max(r["step_start_tensor_bytes"] for r in ranks),
        "step_peak_tensor_bytes": max(r["step_peak_tensor_bytes"] for r in ranks),
        "loss_curve": [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks), strict=True)],
    }


def run_largest(args: BenchArgs) -> dict[str, Any]:
    """Estimate the largest model each strategy fits in the budget, then measure a step of one in between."""
    source = source_state()
    family = model_family(args)
    world_size = args.world_size
    one_step = replace(args, warmup=0, steps=1, rounds=1, profile=False)
    if args.budget_mib is not None:
        budget = int(args.budget_mib * 2**20)
        budget_source = "--budget-mib"
    else:
        start = time.monotonic()
        outcome = spawn_impl("ddp", one_step)
        print(f"budget: ddp on the {args.n_layer}-layer model in {time.monotonic() - start:.1f} s", flush=True)
        if isinstance(outcome, str):
            raise SystemExit(f"ddp on the {args.n_layer}-layer model failed, so there is no budget: {outcome}")
        budget = max(r["state_bytes"]["total"] for r in outcome)
        budget_source = (
            f"DDP's measured params+grads+optim on the {args.n_layer}-layer model "
            f"({family.params(args.n_layer) / 1e6:.1f}M params)"
        )
    at_budget = largest_at(family, budget, world_size)
    # How the ratio grows with the budget: the gathered units are a fixed cost that matters less and less.
    scan = [largest_at(family, budget * factor, world_size) for factor in (1, 2, 4, 8)]
    n_layer = at_budget["full_shard_layers"]
    if n_layer <= at_budget["ddp_layers"]:
        raise SystemExit(
            f"at {budget / 2**20:.1f} MiB no whole number of layers fits FULL_SHARD but not DDP; raise --budget-mib"
        )
    big = replace(one_step, n_layer=n_layer, peak=True)
    measured: dict[str, Any] = {}
    for impl in ("ours", "ddp"):
        start = time.monotonic()
        outcome = spawn_impl(impl, big)
        ok = isinstance(outcome, list)
        print(f"{impl:6s} {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.1f} s", flush=True)
        measured[impl] = _one_step_summary(outcome) if isinstance(outcome, list) else {"failed": outcome}
    num_params = family.params(n_layer)
    estimates = {
        impl: asdict(family.estimate(num_params, world_size, strategy))
        for impl, strategy in (("ours", "FULL_SHARD"), ("ddp", "DDP"))
    }
    payload = {
        "kind": "largest",
        "args": asdict(args),
        "torch": torch.__version__,
        "source": source,
        "family": asdict(family),
        "budget_bytes": budget,
        "budget_source": budget_source,
        "at_budget": at_budget,
        "budget_scan": scan,
        "measured_n_layer": n_layer,
        "measured_params": num_params,
        "estimates": estimates,
        "measured": measured,
    }
    payload["report"] = [source_line(source), *largest_report(payload)]
    return payload


def largest_report(payload: dict[str, Any]) -> list[str]:
    """The --largest run as text: the estimator's answer, then the measured step against the budget."""
    budget, at, family = payload["budget_bytes"], payload["at_budget"], payload["family"]
    world_size = payload["args"]["world_size"]
    whole_layers = (family["root"] + at["full_shard_layers"] * family["block"]) / (
        family["root"] + at["ddp_layers"] * family["block"]
    )
    lines = [
        f"budget: {mib(budget)} per rank = {payload['budget_source']}",
        f"estimator (lightning_fsdp.estimate, W={world_size}, fp32 AdamW; largest unit "
        f"{family.get('unit', family['block']) / 1e6:.2f}M params (wrap: {payload['args'].get('wrap', 'block')}), "
        f"layer {family['block'] / 1e6:.2f}M, root {family['root'] / 1e6:.2f}M):",
        f"  largest DDP         {at['ddp_params'] / 1e6:7.1f}M params ({at['ddp_layers']} whole layers)",
        f"  largest FULL_SHARD  {at['full_shard_params'] / 1e6:7.1f}M params ({at['full_shard_layers']} whole layers)",
        f"  ratio FULL_SHARD/DDP {at['ratio']:.2f} (in whole layers {whole_layers:.2f}); target >= 1.80",
        "  ratio at 1x 2x 4x 8x the budget: " + " ".join(f"{row['ratio']:.2f}" for row in payload["budget_scan"]),
        f"measured: one step of the {payload['measured_n_layer']}-layer model "
        f"({payload['measured_params'] / 1e6:.1f}M params), which the estimator fits in FULL_SHARD but not DDP:",
    ]
    measured, estimates = payload["measured"], payload["estimates"]
    impls = [impl for impl in ("ours", "ddp") if "failed" not in measured[impl]]
    for impl in ("ours", "ddp"):
        if impl not in impls:
            lines.append(f"WARNING: {impl} failed: {measured[impl]['failed'].strip()[-500:]}")
    rows: list[tuple[str, Callable[[str], int]]] = [
        ("params+grads+optim, measured", lambda i: measured[i]["state_bytes"]["total"]),
        (
            "params+grads+optim, estimator",
            lambda i: estimates[i]["params"] + estimates[i]["grads"] + estimates[i]["optimizer_state"],
        ),
        (
            "+ gathered units, estimator",
            lambda i: (
                estimates[i]["params"]
                + estimates[i]["grads"]
                + estimates[i]["optimizer_state"]
                + estimates[i]["unsharded_working_set"]
            ),
        ),
        ("all tensors but data, step start", lambda i: measured[i]["step_start_tensor_bytes"]),
        ("all tensors but data, step peak", lambda i: measured[i]["step_peak_tensor_bytes"]),
    ]
    lines.append(f"{'':40s}" + "".join(f"{impl:>14s}" for impl in impls) + f"{'/ budget':>14s}")
    for title, value in rows:
        cells = "".join(f"{mib(value(i)):>14s}" for i in impls)
        fractions = " ".join(f"{value(i) / budget:.2f}" for i in impls)
        lines.append(f"{title:40s}{cells}{fractions:>14s}")
    if len(impls) == 2:
        ours, ddp = (measured[i]["state_bytes"]["total"] for i in impls)
        verdict = "fits" if ours <= budget else "does NOT fit"
        lines.append(
            f"ours/ddp params+grads+optim {ours / ddp:.2f}; ours {verdict} the budget, ddp needs {ddp / budget:.2f}x it"
        )
        curves = [measured[i]["loss_curve"] for i in impls]
        rtol = LOSS_RTOL[payload["args"]["precision"]]
        if any(abs(a - b) > rtol * abs(b) for a, b in zip(*curves, strict=True)):
            lines.append(f"WARNING: losses disagree beyond rtol {rtol:g}: ours {curves[0]} vs ddp {curves[1]}")
        else:
            lines.append(f"losses agree: {' '.join(f'{x:.5f}' for x in curves[0])}")
    return lines
