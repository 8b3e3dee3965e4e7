"""``Trainer(precision=...)`` with ``myfsdp``: mixed precision keeps fp32 master shards, and fp16's loss scaler skips
a step on every rank alike when only one rank saw an inf (tests/scripts/strategy_precision.py, 2 CPU processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.strategy_scripts import run_script

INF_BATCH = 2  # as in the script


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("precision")
    run_script("strategy_precision.py", out)
    return out


def load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def test_bf16_mixed_trains_in_bf16_with_fp32_master_shards(results: Path) -> None:
    record = load(results, "bf16_mixed.json")
    assert record["compute_dtypes"] == ["torch.bfloat16"]  # the blocks' gathered weights
    assert record["master_dtypes"] == ["torch.float32"]  # what the optimizer steps
    assert record["saved_dtypes"] == ["torch.float32"]  # and what a checkpoint holds
    losses = record["losses"]
    assert losses[-1] < losses[0] - 0.5, losses


def test_fp16_skips_the_step_with_an_inf_on_every_rank(results: Path) -> None:
    rank0, rank1 = load(results, "fp16.json.rank0"), load(results, "fp16.json.rank1")
    assert rank0["compute_dtypes"] == ["torch.float16"]
    assert rank0["master_dtypes"] == ["torch.float32"]
    # The inf was in rank 1's shard only; both ranks skipped that step and backed off the scale together.
    assert rank0["stepped"] == rank1["stepped"]
    assert rank0["stepped"][INF_BATCH] is False
    assert sum(rank0["stepped"]) == len(rank0["stepped"]) - 1
    assert rank0["scales"] == rank1["scales"]
    assert rank0["scales"][INF_BATCH] == rank0["scales"][INF_BATCH - 1] / 2


def test_bf16_true_keeps_the_model_in_bf16(results: Path) -> None:
    record = load(results, "bf16_true.json")
    assert record["master_dtypes"] == record["compute_dtypes"] == record["saved_dtypes"] == ["torch.bfloat16"]
    assert all(record["stepped"])
