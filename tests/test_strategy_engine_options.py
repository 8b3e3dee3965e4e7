"""``myfsdp`` with cpu_offload, activation checkpointing, NO_SHARD, HYBRID_SHARD, deferred init, configure_model
(real device and meta), the default policy and sync_module_states trains to DDP's weights
(tests/scripts/strategy_engine_options.py, 2 CPU processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_fsdp.demos.gpt import GPTConfig
from tests.engine_harness import ATOL, RTOL
from tests.strategy_scripts import run_script

TINY = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=18, bias=True)  # the scripts' model

SHARDED = 4842  # elements of the tiny GPT one of 2 ranks holds (its 9666, split by rows)
CASES = {
    "cpu_offload": SHARDED,
    "activation_checkpointing": SHARDED,
    "no_shard": 9666,
    "hybrid_default_mesh": SHARDED,  # (1, 2): one replica sharded over both ranks
    "hybrid_2x1": 9666,  # (2, 1): two replicas, each whole
    "hybrid_zero2": SHARDED,  # SHARD_GRAD_OP within the (1, 2) shard group
    "init_module_empty_init": SHARDED,
    "configure_model": SHARDED,
    "configure_model_empty_init": SHARDED,
    "pretrained_in_configure_model": SHARDED,  # compared with ddp_pretrained
    "default_policy": SHARDED,
    "sync_module_states": SHARDED,
    "rank_seeded_without_sync": SHARDED,  # rank 0's values taken without the option too, as DDP does
    "manual_two_optimizers": 4122,  # the first optimizer: the blocks only; compared with ddp_manual
    "two_hosts_untied": 5400,  # the untied head's rows too; compared with ddp_untied
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engine_options")
    run_script("strategy_engine_options.py", out)
    return out


def max_error(results: Path, case: str) -> float:
    references = {"manual": "ddp_manual", "pretrained": "ddp_pretrained", "two": "ddp_untied"}
    reference_case = references.get(case.split("_")[0], "ddp")
    ours, reference = torch.load(results / f"{case}.pt"), torch.load(results / f"{reference_case}.pt")
    assert ours.keys() == reference.keys()
    return max(((ours[k] - reference[k]).abs().max() / (reference[k].abs().max() + ATOL / RTOL)).item() for k in ours)


@pytest.mark.parametrize(("case", "optimizer_numel"), CASES.items())
def test_engine_option_matches_ddp(results: Path, case: str, optimizer_numel: int) -> None:
    record = json.loads((results / f"{case}.json").read_text())
    assert record["optimizer_numel"] == optimizer_numel
    assert record["built_on_meta"] == (case in ("init_module_empty_init", "configure_model_empty_init"))
    if case in ("default_policy", "pretrained_in_configure_model"):
        assert record["units"] == 1 + TINY.n_layer  # no policy given: the root and one unit per Block
    # Only between hosts is an embedding gathered by the rows its lookups read (the untied input embedding, and the
    # position embedding, whose every row a step reads).
    assert record["looked_up"] == (["model.wpe.weight", "model.wte.weight"] if case == "two_hosts_untied" else [])
    error = max_error(results, case)
    assert error < RTOL, f"[{case}] relative error {error:.2e} against DDP"


def test_validation_between_hosts_sees_ddp_s_loss(results: Path) -> None:
    """Validation gathers the embedding whole (no lookup of rows there): its loss is DDP's on the same weights."""
    ours = json.loads((results / "two_hosts_untied.json").read_text())["val_loss"]
    reference = json.loads((results / "ddp_untied.json").read_text())["val_loss"]
    assert ours == pytest.approx(reference, rel=RTOL)


def test_pretrained_weights_set_in_configure_model_survive(results: Path) -> None:
    """The control: had configure_model's weights been replaced by a fresh init, they would not match ddp's run,
    whose model started from the loaded weights; the seed-0 run (ddp) and the pretrained one are far apart."""
    assert max_error(results, "pretrained_in_configure_model") < RTOL
    ours, fresh = torch.load(results / "pretrained_in_configure_model.pt"), torch.load(results / "ddp.pt")
    assert max((ours[k] - fresh[k]).abs().max().item() for k in ours) > 1e-2
