"""fit, validate, test, predict, the model summary, checkpoints and resuming with ``myfsdp`` on 2 CPU processes
(tests/scripts/strategy_lifecycle.py), checked against the unsharded model in this process."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import NAMES_KEY, OWN_KEY
from lightning_fsdp.demos.gpt import GPT
from tests.engine_harness import ATOL, RTOL
from tests.scripts.strategy_common import TINY, token_loader
from tests.strategy_scripts import run_script


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("lifecycle")
    return out, run_script("strategy_lifecycle.py", out)


@pytest.fixture(scope="module")
def results(run: tuple[Path, subprocess.CompletedProcess]) -> Path:
    return run[0]


def unsharded(weights: dict[str, torch.Tensor]) -> GPT:
    """The plain GPT with the LightningModule's weights (its keys carry the ``model.`` prefix)."""
    model = GPT(TINY)
    model.load_state_dict({name.removeprefix("model."): value for name, value in weights.items()})
    return model.eval()


def test_the_summary_prints_the_full_parameter_count(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    full = sum(p.numel() for p in GPT(TINY).parameters())
    expected = get_human_readable_count(full)
    assert expected != get_human_readable_count(full // 2)  # the count one rank's shards would give
    printed = re.search(r"Total params:?\s+([\d.]+ ?\w?)\s", run[1].stdout)
    assert printed, run[1].stdout[-3000:]
    assert printed.group(1).strip() == expected
    assert re.search(rf"model\s*│\s*GPT\s*│\s*{re.escape(expected)}", run[1].stdout)  # the GPT's row of the table


def test_the_checkpoint_holds_the_full_model_and_optimizer_state(results: Path) -> None:
    checkpoint = torch.load(results / "straight.ckpt", weights_only=False)
    weights = torch.load(results / "straight.pt")
    assert checkpoint["state_dict"].keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(checkpoint["state_dict"][name], value), name
    unsharded(checkpoint["state_dict"])  # loads strictly into the unsharded model

    # The optimizer state is Optimizer.state_dict()'s own positional format and keys at full shapes (no
    # param_names: the optimizer was built from parameters()), so a plain optimizer over the unsharded model -- what
    # ddp or one device resumes with -- loads it as its own. Its positions are the parameters' order.
    (optimizer,) = checkpoint["optimizer_states"]
    assert all("param_names" not in group for group in optimizer["param_groups"])
    model = unsharded(weights)
    full_shapes = dict(model.named_parameters())
    names = list(full_shapes)
    assert len(names) == sum(len(group["params"]) for group in optimizer["param_groups"])
    recorded = checkpoint[OWN_KEY][NAMES_KEY]  # what convert keys the positional state by, beside it
    assert [name for group in recorded[0] for name in group] == [f"model.{name}" for name in names]
    for index, state in optimizer["state"].items():
        shape = full_shapes[names[index].removeprefix("model.")].shape
        assert state["exp_avg"].shape == shape and state["exp_avg_sq"].shape == shape, names[index]
        assert int(state["step"]) == 4  # 2 epochs of 2 steps
    by_name = dict(model.named_parameters())
    plain = torch.optim.AdamW([by_name[name.removeprefix("model.")] for name in names])
    plain.load_state_dict(optimizer)


def test_the_trainers_checkpoint_converts_to_a_folder_keyed_by_name(results: Path, tmp_path: Path) -> None:
    convert(results / "straight.ckpt", tmp_path / "sharded", "sharded", quiet=True)
    checkpoint = torch.load(results / "straight.ckpt", weights_only=False)
    (positional,) = checkpoint["optimizer_states"]
    names = [name for group in checkpoint[OWN_KEY][NAMES_KEY][0] for name in group]
    convert(tmp_path / "sharded", tmp_path / "back.ckpt", "full", quiet=True)
    back = torch.load(tmp_path / "back.ckpt", weights_only=False)
    (round_trip,) = back["optimizer_states"]
    assert [name for group in round_trip["param_groups"] for name in group["param_names"]] == names
    for index, values in positional["state"].items():
        for key, value in values.items():
            assert torch.equal(round_trip["state"][index][key], value), f"{names[index]}.{key}"


def test_resuming_from_a_checkpoint_lands_where_the_straight_run_did(results: Path) -> None:
    straight, resumed = torch.load(results / "straight.pt"), torch.load(results / "resumed.pt")
    for name, expected in straight.items():
        scale = expected.abs().max() + ATOL / RTOL
        error = ((resumed[name] - expected).abs().max() / scale).item()
        assert error < RTOL, f"{name}: relative error {error:.2e} after resuming"


def test_validate_test_and_predict_use_the_sharded_model_correctly(results: Path) -> None:
    model = unsharded(torch.load(results / "straight.pt"))
    evaluation = torch.load(results / "eval.pt")
    samples = next(iter(token_loader(8, batch_size=8, seed=2)))
    # The distributed sampler deals samples round-robin: rank 0 gets 0, 2, 4, 6 and rank 1 the others, in
    # batches of 2; the logged loss is the mean over every rank's batches.
    batches = [samples[[0, 2]], samples[[4, 6]], samples[[1, 3]], samples[[5, 7]]]
    with torch.no_grad():
        expected = torch.stack([model(b[:, :-1], b[:, 1:]) for b in batches]).mean().item()
        predictions = [model(b[:, :-1]) for b in batches[:2]]
    assert evaluation["validate"][0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert evaluation["test"][0]["test_loss"] == pytest.approx(expected, rel=1e-5)
    for ours, reference in zip(evaluation["predict"], predictions, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_an_optimizer_built_before_sharding_is_refused_in_setup(results: Path) -> None:
    message = json.loads((results / "early_optimizer.json").read_text())
    assert "built before FSDPStrategy sharded the model" in message
    assert "configure_optimizers" in message


def test_a_callback_calling_the_inner_model_gets_a_sentence_not_an_index_error(results: Path) -> None:
    message = json.loads((results / "submodule_in_a_callback.json").read_text())
    assert message.startswith("GPT `model` was called on its own while the sharded unit it belongs to (LitGPT)")
    assert "call the sharded LitGPT itself (under Lightning, the LightningModule)" in message
    assert "summon_full_params" in message
