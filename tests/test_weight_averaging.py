"""Weight averaging under ``myfsdp``: ``ShardedEMA`` gives ddp's EMA at 1/W of the memory, in both checkpoint forms;
``AveragedModel`` built before sharding gives ddp's average; Lightning's averaging callbacks are refused at setup on two
ranks and, on one, where nothing is sharded, average as under ddp.

One spawned run of 2 gloo ranks (tests/scripts/weight_averaging.py) carries every Trainer run but the one-rank case; the
tests read what it wrote. The tolerance is the issue's: 1e-6 relative to the largest entry of the reference tensor.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_fsdp import ShardedEMA
from lightning_fsdp.checkpoint.callback_tensors import (
    CALLBACK_TENSORS,
    CALLBACKS,
    SHARDED_TENSORS,
    recorded_callback_tensors,
)
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.sharded import META_FILE
from tests.distributed import run_distributed
from tests.scripts.weight_averaging import run, run_one_rank

RTOL = 1e-6
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("weight_averaging")
    run_distributed(run, WORLD_SIZE, str(folder), timeout=300)
    return folder


@pytest.fixture(scope="module")
def results(out: Path) -> dict[str, Any]:
    return torch.load(out / "results.pt", weights_only=False)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name, value in expected.items():
        assert actual[name].shape == value.shape, f"{what}: {name}"
        error = relative_error(actual[name], value)
        assert error < RTOL, f"{what}: {name} is off by {error:.2e} relative"


def parameters_of(export: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in export.items() if name in names}


def test_sharded_ema_equals_ddp_ema_and_the_one_process_reference(results: dict[str, Any]) -> None:
    ddp, ours = results["ddp"]["average"], results["sharded"]
    assert ours["updates"] == 3  # after steps 1, 3 and 5
    assert_close(parameters_of(ours["export"], set(ddp)), ddp, "ShardedEMA vs ddp's EMAWeightAveraging")
    assert_close(parameters_of(ours["export"], set(ddp)), ours["reference"], "ShardedEMA vs one process")
    sgo = results["shard_grad_op"]
    assert_close(parameters_of(sgo["export"], set(ddp)), ddp, "ShardedEMA under SHARD_GRAD_OP vs ddp")
    assert sgo["val_loss"] == pytest.approx(results["ddp"]["val_loss"], rel=RTOL)
    # Not vacuous: the average lies well away from the weights it averages.
    assert max(relative_error(ours["final"][name], value) for name, value in ddp.items()) > 1e-3


def test_validation_uses_the_average_and_swaps_back_exactly(results: dict[str, Any]) -> None:
    ddp_losses, records = results["ddp"]["val_loss"], results["sharded"]["probe"]
    assert [record["step"] for record in records] == [3, 6]
    for record, ddp_loss in zip(records, ddp_losses, strict=True):
        assert abs(record["val_loss"] - ddp_loss) <= RTOL * abs(ddp_loss), (record["val_loss"], ddp_loss)
        for name, value in record["before"].items():
            assert torch.equal(record["after"][name], value), f"step {record['step']}: {name} not restored"
        assert any(not torch.equal(record["during"][n], v) for n, v in record["before"].items())
    names = set(results["ddp"]["average"])
    assert_close(parameters_of(records[1]["during"], names), results["ddp"]["average"], "validated weights")


def test_ema_memory_per_rank_is_its_shard(results: dict[str, Any]) -> None:
    for run_name, trainable_only in (("sharded", False), ("lora", True)):
        memory = results[run_name]["memory"]
        for rank, measured in enumerate(memory):
            assert measured["held"] == measured["nbytes"] == 4 * measured["shard_numel"], (run_name, rank, measured)
        # The ranks' shards partition the model: each holds about 1/W of it.
        total = sum(m["model_numel_local"] for m in memory)
        if not trainable_only:
            assert total == results["sharded"]["full_numel"]
            assert all(m["shard_numel"] <= total / WORLD_SIZE * 1.1 for m in memory), memory
        else:
            assert all(0 < m["shard_numel"] < m["model_numel_local"] / 10 for m in memory), memory


@pytest.mark.parametrize("form", ["sharded", "full", "consolidated"])
def test_a_resumed_run_ends_with_the_uninterrupted_average(results: dict[str, Any], form: str) -> None:
    resumed = results[f"resumed_{form}"]
    assert resumed["updates"] == 3
    assert_close(resumed["export"], results["sharded"]["export"], f"resumed from the {form} checkpoint")


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_an_average_of_other_parameters_is_refused_before_anything_loads(results: dict[str, Any], form: str) -> None:
    misfit = results[f"misfit_{form}"]
    assert misfit["message"] is not None and "for other tensors than this run's" in misfit["message"]
    assert misfit["unchanged"]


def test_both_forms_hold_the_step3_average_and_convert_keeps_it(
    out: Path, results: dict[str, Any], tmp_path: Path
) -> None:
    key = results["sharded"]["state_key"]
    full = torch.load(out / "full_step3.ckpt", weights_only=True)
    convert(out / "sharded_step3.ckpt", tmp_path / "converted.ckpt", "full", quiet=True)
    converted = torch.load(tmp_path / "converted.ckpt", weights_only=True)
    assert full["callbacks"][key]["updates"] == converted["callbacks"][key]["updates"] == 2
    averaged = full["callbacks"][key][SHARDED_TENSORS]
    assert averaged.keys() == set(results["ddp"]["average"])
    for name, value in averaged.items():
        assert value.dtype == torch.float32
        assert torch.equal(converted["callbacks"][key][SHARDED_TENSORS][name], value), name
        assert value.shape == full["state_dict"][name].shape
        # The frozen 0-dim scale is averaged from the one rank that holds it; everything else moved.
        assert torch.equal(value, full["state_dict"][name]) == (name == "loss_scale"), name


def test_lora_sharded_ema_and_averaged_model_equal_ddp(results: dict[str, Any]) -> None:
    ddp, ours = results["lora_ddp"]["weights"], results["lora"]
    averaged = {name: value for name, value in ddp.items() if name.startswith("averaged.module.")}
    assert averaged
    # torch's AveragedModel, built in __init__ and so sharded with the model, averages shard against shard.
    assert_close({n: ours["weights"][n] for n in averaged}, averaged, "AveragedModel under myfsdp vs ddp")
    assert torch.equal(ours["weights"]["averaged.n_averaged"], ddp["averaged.n_averaged"])
    # ShardedEMA(trainable_only=True) exports the averaged adapters with the frozen base: the same model.
    exported = {
        f"averaged.module.{n.removeprefix('model.')}": v for n, v in ours["export"].items() if n[:6] == "model."
    }
    assert_close(exported, averaged, "ShardedEMA(trainable_only) vs ddp's AveragedModel")


@pytest.mark.parametrize("callback", ["WeightAveraging", "EMAWeightAveraging", "StochasticWeightAveraging"])
def test_lightning_averaging_callbacks_are_refused_at_setup(results: dict[str, Any], callback: str) -> None:
    refused = results["refused"][callback]
    assert refused["message"] is not None, f"{callback} was not refused"
    assert refused["message"].startswith(f"{callback} averages a full, unsharded copy of the model")
    alternative = "AveragedModel" if callback == "StochasticWeightAveraging" else "lightning_fsdp.ShardedEMA"
    assert alternative in refused["message"]
    assert refused["unchanged"]


def test_bad_arguments_are_refused_with_a_sentence() -> None:
    with pytest.raises(ValueError, match=r"decay=1.0\) must be a number in \[0, 1\)"):
        ShardedEMA(decay=1.0)
    with pytest.raises(ValueError, match=r"update_every=0\) must be a positive int"):
        ShardedEMA(update_every=0)
    with pytest.raises(RuntimeError, match="has no model yet"):
        ShardedEMA().full_state_dict()


def test_lightning_ema_is_allowed_on_one_rank_and_averages_as_under_ddp(tmp_path: Path) -> None:
    run_distributed(run_one_rank, 1, str(tmp_path), timeout=300)
    results = torch.load(tmp_path / "one_rank.pt", weights_only=False)
    ddp, ours = results["ddp"], results["myfsdp"]
    assert_close(ours["average"], ddp["average"], "EMAWeightAveraging's average, myfsdp vs ddp")
    assert_close(ours["final"], ddp["final"], "the weights after fit (the average, copied in at the end)")
    assert ours["val_loss"] and ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=RTOL)
    saved_ddp = torch.load(tmp_path / "ema_ddp.ckpt", weights_only=True)
    saved_ours = torch.load(tmp_path / "ema_myfsdp.ckpt", weights_only=True)
    for key in ("state_dict", "current_model_state"):
        assert_close(saved_ours[key], saved_ddp[key], f"the checkpoint's {key}")


def _consolidated_by_lightning(folder: Path) -> dict[str, Any]:
    """What ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` writes for ``folder``."""
    return _format_checkpoint(_load_distributed_checkpoint(folder))


def _in_first_layout(folder: Path, dst: Path) -> Path:
    """``folder`` rewritten as sharded folders were before the ``callback_tensors`` key: the averages under
    ``callbacks.<state key>.<name>`` in the DCP part (read back whole, written by this one process)."""
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    state[CALLBACKS] = state.pop(CALLBACK_TENSORS)
    dcp.save(state, storage_writer=FileSystemWriter(dst), no_dist=True)
    shutil.copy(folder / META_FILE, dst / META_FILE)
    return dst


def test_lightning_consolidation_keeps_the_sharded_average_and_both_layouts_convert(
    out: Path, results: dict[str, Any], tmp_path: Path
) -> None:
    key = results["sharded"]["state_key"]
    full = torch.load(out / "full_step3.ckpt", weights_only=True)["callbacks"][key]
    consolidated = _consolidated_by_lightning(out / "sharded_step3.ckpt")
    assert consolidated[CALLBACKS][key]["updates"] == 2  # meta.pt's counters, as before
    averaged = consolidated[CALLBACK_TENSORS][key]  # beside them, no longer replaced by them
    assert averaged.keys() == full[SHARDED_TENSORS].keys()
    assert all(torch.equal(averaged[name], value) for name, value in full[SHARDED_TENSORS].items())
    torch.save(consolidated, tmp_path / "consolidated.ckpt")
    first_layout = _in_first_layout(out / "sharded_step3.ckpt", tmp_path / "first_layout.ckpt")
    for label, src in (("consolidated", tmp_path / "consolidated.ckpt"), ("first layout", first_layout)):
        convert(src, tmp_path / f"{label}.full.ckpt", "full", quiet=True)
        converted = torch.load(tmp_path / f"{label}.full.ckpt", weights_only=True)["callbacks"][key]
        assert converted["updates"] == 2, label
        for name, value in full[SHARDED_TENSORS].items():
            assert torch.equal(converted[SHARDED_TENSORS][name], value), f"{label}: {name}"
    targets = {key: {name: torch.empty(v.shape) for name, v in full[SHARDED_TENSORS].items()}}
    for folder, dcp_key in ((out / "sharded_step3.ckpt", CALLBACK_TENSORS), (first_layout, CALLBACKS)):
        metadata = FileSystemReader(folder).read_metadata()
        assert list(recorded_callback_tensors(metadata, targets, folder)) == [dcp_key]  # what a resume loads into
