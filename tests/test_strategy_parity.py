"""Through the Trainer, ``strategy="myfsdp"`` trains to the same weights as ``strategy="ddp"``.

One script (tests/scripts/strategy_parity.py) runs every case on 2 CPU processes -- DDP once per training setup,
then our strategy in each configuration -- so the process start-up is paid once. The tolerance is the engine
parity tests' (see tests/engine_harness.py, [Note: parity tolerance]).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engine_harness import ATOL, RTOL
from tests.strategy_scripts import run_script

# (our case, its DDP reference)
PAIRS = [
    ("full_shard", "ddp"),
    ("shard_grad_op", "ddp"),
    ("full_shard_clip", "ddp_clip"),
    ("full_shard_clip_value", "ddp_clip_value"),
    ("full_shard_accumulate", "ddp_accumulate"),
    ("full_shard_accumulate_no_sync", "ddp_accumulate"),
    ("full_shard_compiled_module", "ddp"),
    ("full_shard_compiled_network", "ddp"),
]
UNITS = 3  # the tiny GPT's two Blocks and the root
# Measured: 3 graph breaks compiling the whole LightningModule, 2 compiling only its network (around the hooks).
MAX_GRAPH_BREAKS = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parity")
    run_script("strategy_parity.py", out)
    return out


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max() + ATOL / RTOL
    return ((actual - expected).abs().max() / scale).item()


@pytest.mark.parametrize(("case", "reference"), PAIRS)
def test_myfsdp_matches_ddp(results: Path, case: str, reference: str) -> None:
    ours, theirs = torch.load(results / f"{case}.pt"), torch.load(results / f"{reference}.pt")
    assert ours.keys() == theirs.keys()
    for name, expected in theirs.items():
        assert ours[name].shape == expected.shape, f"[{case}] {name}: {ours[name].shape} != {expected.shape}"
        error = max_relative_error(ours[name], expected)
        assert error < RTOL, f"[{case}] {name}: relative error {error:.2e} against {reference}"


def test_the_cases_differ_where_they_should(results: Path) -> None:
    """Clipping and accumulation change the result, so the cases above compare different trainings."""
    plain = torch.load(results / "ddp.pt")
    for variant in ("ddp_clip", "ddp_clip_value", "ddp_accumulate"):
        changed = torch.load(results / f"{variant}.pt")
        assert max(max_relative_error(changed[k], plain[k]) for k in plain) > 1e-2, variant


def test_each_rank_steps_half_the_model(results: Path) -> None:
    full = json.loads((results / "ddp.json").read_text())["optimizer_numel"]
    for case, _ in PAIRS:
        local = json.loads((results / f"{case}.json").read_text())["optimizer_numel"]
        assert full / 2 <= local < full / 2 + 100, f"{case}: the optimizer holds {local} of {full} elements"


def test_accumulation_reduces_every_micro_batch_unless_told_not_to(results: Path) -> None:
    every = json.loads((results / "full_shard_accumulate.json").read_text())["reductions_per_batch"]
    last_only = json.loads((results / "full_shard_accumulate_no_sync.json").read_text())["reductions_per_batch"]
    assert every == [UNITS] * 8
    assert last_only == [0, UNITS] * 4


@pytest.mark.parametrize("case", ["full_shard_compiled_module", "full_shard_compiled_network"])
def test_compiled_modules_are_compiled_with_few_graph_breaks(results: Path, case: str) -> None:
    """The parity above is of compiled code: dynamo built graphs, breaking only around the engine's hooks."""
    record = json.loads((results / f"{case}.json").read_text())
    assert record["graphs"] > 0, f"{case}: nothing was compiled"
    assert record["graph_breaks"] <= MAX_GRAPH_BREAKS, f"{case}: {record['graph_breaks']} graph breaks"
