"""The full optimizer state in ``Optimizer.state_dict()``'s own layout (what the Trainer's ``optimizer_state`` and
ddp's give), the parameter names ``convert`` needs recorded beside it, and files with ``param_names`` in their
groups (as they were written before) still loading, on 2 real ranks without Lightning.

One 2-rank run saves, for an optimizer with two groups in an order of its own and for one built from
``named_parameters``: a file in the new layout (``torch_optimizer_state`` plus ``record_optimizer_names``), one in the
old (``full_optimizer_state``: ``param_names`` in every group), the state itself and the weights two steps on. Each
file, and each converted to a sharded folder, is then loaded by 2 fresh ranks: the optimizer state comes back exactly
and training from it lands where the uninterrupted run did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fsdp import fully_shard
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import (
    NAMES_KEY,
    OWN_KEY,
    full_optimizer_state,
    load_full_checkpoint,
    record_optimizer_names,
    torch_optimizer_state,
)
from lightning_fsdp.checkpoint.sharded import load_sharded
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.state.state_dict import full_state_dict
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT, train_tokens

VARIANTS = ("grouped", "named")
SOURCES = ("new.ckpt", "old.ckpt", "new-sharded", "old-sharded")


def _fresh(variant: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(GPT(TINY_GPT), {Block})
    if variant == "named":
        return model, torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    params = list(model.parameters())  # two groups, neither in the module's order: positions are not names
    groups = [{"params": params[::2][::-1], "lr": 1e-2}, {"params": params[1::2], "lr": 5e-3, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups)


def _keys(state: dict[str, Any]) -> tuple[list[str], list[list[str]], dict[int, list[str]]]:
    """The keys at the top, of every group and of every parameter's state."""
    return (
        sorted(state),
        [sorted(group) for group in state["param_groups"]],
        {int(index): sorted(values) for index, values in state["state"].items()},
    )


def _assert_equal(actual: dict[str, Any], expected: dict[str, Any], label: str) -> None:
    assert _keys(actual) == _keys(expected), label
    assert actual["param_groups"] == expected["param_groups"], label
    for index, values in expected["state"].items():
        for key, value in values.items():
            assert torch.equal(actual["state"][index][key], value), f"{label}: state {index}.{key}"


def _save(rank: int, world_size: int, folder: str) -> None:
    out = Path(folder)
    for variant in VARIANTS:
        model, optimizer = _fresh(variant)
        train_tokens(model, optimizer, 2, seed=rank)
        weights = full_state_dict(model)
        new = torch_optimizer_state(model, optimizer)
        old = full_optimizer_state(model, optimizer)
        own = optimizer.state_dict()  # torch's own, over this rank's shards: the keys to have
        if rank == 0:
            assert _keys(new)[:2] == _keys(own)[:2], (_keys(new), _keys(own))
            assert _keys(new)[2] == _keys(own)[2]
            for ours, torchs in zip(new["param_groups"], own["param_groups"], strict=True):
                assert ours.get("param_names") == torchs.get("param_names"), variant  # its own names, or none
            assert all("param_names" in group for group in old["param_groups"])  # the old layout, for the files
            checkpoint = {"state_dict": weights, "optimizer_states": [new], "global_step": 2}
            record_optimizer_names(checkpoint, model, [optimizer])
            torch.save(checkpoint, out / f"{variant}-new.ckpt")
            before = {"state_dict": weights, "optimizer_states": [old], "global_step": 2}
            torch.save(before, out / f"{variant}-old.ckpt")
            torch.save(new, out / f"{variant}-expected-state.pt")
        train_tokens(model, optimizer, 2, seed=100 + rank)  # what a resumed run must reproduce
        final = full_state_dict(model)
        if rank == 0:
            torch.save(final, out / f"{variant}-expected-final.pt")


def _resume(rank: int, world_size: int, folder: str) -> None:
    out = Path(folder)
    for variant in VARIANTS:
        expected_state = torch.load(out / f"{variant}-expected-state.pt")
        expected_final = torch.load(out / f"{variant}-expected-final.pt")
        for source in SOURCES:
            path = out / f"{variant}-{source}"
            model, optimizer = _fresh(variant)
            if path.is_dir():
                meta = load_sharded(path, model, [optimizer])
            else:
                meta = load_full_checkpoint(path, model, [optimizer])
            assert meta["global_step"] == 2
            restored = torch_optimizer_state(model, optimizer)
            if rank == 0:
                _assert_equal(restored, expected_state, f"{variant}, from {source}")
            train_tokens(model, optimizer, 2, seed=100 + rank)
            final = full_state_dict(model, rank0_only=False)
            for name, tensor in expected_final.items():
                assert torch.equal(final[name], tensor), f"{variant}, from {source}: {name}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("layout")
    run_distributed(_save, 2, str(folder))
    for variant in VARIANTS:
        for form in ("new", "old"):
            convert(folder / f"{variant}-{form}.ckpt", folder / f"{variant}-{form}-sharded", "sharded", quiet=True)
    return folder


def test_the_new_file_has_torch_s_layout_and_the_names_beside_it(saved: Path) -> None:
    checkpoint = torch.load(saved / "grouped-new.ckpt", weights_only=True)
    (state,) = checkpoint["optimizer_states"]
    assert all("param_names" not in group for group in state["param_groups"])
    recorded = checkpoint[OWN_KEY][NAMES_KEY][0]
    assert [len(names) for names in recorded] == [len(group["params"]) for group in state["param_groups"]]
    names = sorted(name for name, _ in GPT(TINY_GPT).named_parameters())  # sharding keeps the names
    assert sorted(name for group_names in recorded for name in group_names) == names
    meta = torch.load(saved / "grouped-new-sharded" / "meta.pt", weights_only=True)
    assert NAMES_KEY not in meta.get(OWN_KEY, {})  # the folder keys its state by name


def test_every_file_and_its_converted_folder_resume_the_optimizer_exactly(saved: Path) -> None:
    run_distributed(_resume, 2, str(saved))


def test_a_file_without_names_is_refused_by_convert(saved: Path, tmp_path: Path) -> None:
    checkpoint = torch.load(saved / "grouped-new.ckpt", weights_only=True)
    del checkpoint[OWN_KEY]  # what ddp or one device writes: torch's layout, nothing beside it
    torch.save(checkpoint, tmp_path / "ddp.ckpt")
    with pytest.raises(ValueError, match="does not record parameter names"):
        convert(tmp_path / "ddp.ckpt", tmp_path / "ddp-sharded", "sharded", quiet=True)
    assert not (tmp_path / "ddp-sharded").exists()
