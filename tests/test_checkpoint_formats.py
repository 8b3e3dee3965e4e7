"""Checkpoint formats without Lightning: sharded folder and full file round trips at other world sizes, the
checks that refuse torn or foreign checkpoints, and offline conversion between the forms."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_fsdp import fully_shard
from lightning_fsdp.checkpoint import atomic
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import full_optimizer_state, load_full_optimizer_state
from lightning_fsdp.checkpoint.sharded import load_sharded, save_sharded, sharded_checkpoint_state
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.state.state_dict import full_state_dict, load_full_state_dict
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT, train_tokens


class ScaledGPT(GPT):
    """The tiny GPT with a trainable 0-dim parameter (a loss scale): its one row lives on one rank, so its sharded
    checkpoint form is a copy that loading must write back, for the value and for its optimizer state."""

    def __init__(self) -> None:
        super().__init__(TINY_GPT)
        self.loss_scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(idx, targets) * self.loss_scale


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(ScaledGPT(), {Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save(rank: int, world_size: int, folder: str) -> None:
    model, optimizer = _fresh()
    train_tokens(model, optimizer, 2, seed=rank)
    save_sharded(Path(folder) / "sharded", sharded_checkpoint_state(model, [optimizer]), {"global_step": 2})
    full = {"state_dict": full_state_dict(model), "optimizer_states": [full_optimizer_state(model, optimizer)]}
    if rank == 0:
        torch.save({**full, "global_step": 2}, Path(folder) / "full.ckpt")
    train_tokens(model, optimizer, 2, seed=100 + rank)  # what a resumed run must reproduce
    final = full_state_dict(model)
    if rank == 0:
        torch.save(final, Path(folder) / "expected_after_resume.pt")


def _resume(rank: int, world_size: int, folder: str) -> None:
    expected = torch.load(Path(folder) / "expected_after_resume.pt")
    for form in ("sharded", "full"):
        model, optimizer = _fresh()
        if form == "sharded":
            meta = load_sharded(Path(folder) / "sharded", model, [optimizer])
        else:
            meta = torch.load(Path(folder) / "full.ckpt", mmap=True, weights_only=False)
            load_full_state_dict(model, meta["state_dict"])
            load_full_optimizer_state(model, optimizer, meta["optimizer_states"][0])
        assert meta["global_step"] == 2
        if world_size == 2:  # the same data stream as the uninterrupted run; other world sizes see other data
            train_tokens(model, optimizer, 2, seed=100 + rank)
            final = full_state_dict(model, rank0_only=False)
            for name, tensor in expected.items():
                assert torch.equal(final[name], tensor), f"[{form}] {name} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank run's checkpoints (full.ckpt, sharded/) and expected weights; tests read them, never write there."""
    folder = tmp_path_factory.mktemp("saved")
    run_distributed(_save, 2, str(folder))
    return folder


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_round_trips_resume_exactly_and_load_at_any_world_size(saved: Path, world_size: int) -> None:
    run_distributed(_resume, world_size, str(saved))


def _refuse(rank: int, world_size: int, folder: str) -> None:
    model, optimizer = _fresh()
    other = fully_shard(GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=20)), {Block})
    mismatch = r"unexpected keys \['blocks.2.*'blocks.0.attn.proj.bias' has shape \(18,\) in the checkpoint but \(20,\)"
    with pytest.raises(ValueError, match=mismatch):
        load_sharded(Path(folder) / "sharded", other, [])
    with pytest.raises(ValueError, match=r"holds 1 optimizer state\(s\) but the model has 2 optimizer"):
        load_sharded(Path(folder) / "sharded", model, [optimizer, torch.optim.SGD(model.parameters(), lr=0.1)])
    with pytest.raises(ValueError, match=r"shard file __1_0.distcp is missing"):
        load_sharded(Path(folder) / "missing_shard", model, [optimizer])
    with pytest.raises(ValueError, match=r"truncated: __0_0.distcp has \d+ bytes of the \d+"):
        load_sharded(Path(folder) / "truncated", model, [optimizer])
    with pytest.raises(ValueError, match=r"incomplete: meta.pt is missing"):
        load_sharded(Path(folder) / "no_meta", model, [optimizer])


def test_torn_and_foreign_checkpoints_are_refused_by_name(saved: Path, tmp_path: Path) -> None:
    sharded = saved / "sharded"
    for name in ("sharded", "missing_shard", "truncated", "no_meta"):
        shutil.copytree(sharded, tmp_path / name)
    (tmp_path / "missing_shard" / "__1_0.distcp").unlink()
    with open(tmp_path / "truncated" / "__0_0.distcp", "r+b") as handle:
        handle.truncate(100)
    (tmp_path / "no_meta" / "meta.pt").unlink()
    run_distributed(_refuse, 2, str(tmp_path))


def test_convert_between_forms_offline(saved: Path, tmp_path: Path) -> None:
    for name in ("full.ckpt", "sharded"):
        (shutil.copytree if (saved / name).is_dir() else shutil.copy)(saved / name, tmp_path / name)
    full = torch.load(tmp_path / "full.ckpt", weights_only=False)
    convert(tmp_path / "sharded", tmp_path / "consolidated.ckpt", "full", quiet=True)
    consolidated = torch.load(tmp_path / "consolidated.ckpt", weights_only=False)
    assert consolidated["global_step"] == 2
    for name, tensor in full["state_dict"].items():
        assert torch.equal(consolidated["state_dict"][name], tensor), name
    saved_state, converted_state = full["optimizer_states"][0], consolidated["optimizer_states"][0]
    assert saved_state["param_groups"] == converted_state["param_groups"]
    for index, values in saved_state["state"].items():
        for key, value in values.items():
            assert torch.equal(converted_state["state"][index][key], value), f"optimizer state {index}.{key}"
    convert(tmp_path / "full.ckpt", tmp_path / "resharded", "sharded", quiet=True)
    convert(tmp_path / "resharded", tmp_path / "round_trip.ckpt", "full", quiet=True)
    round_trip = torch.load(tmp_path / "round_trip.ckpt", weights_only=False)
    assert all(torch.equal(round_trip["state_dict"][n], t) for n, t in full["state_dict"].items())
    for source in ("full.ckpt", "sharded"):
        convert(
            tmp_path / source, tmp_path / f"{source}.safetensors", "safetensors", strip_prefix="blocks.", quiet=True
        )
        weights = load_file(tmp_path / f"{source}.safetensors")
        assert torch.equal(weights["0.mlp.fc.weight"], full["state_dict"]["blocks.0.mlp.fc.weight"])
        assert weights.keys() == {n.removeprefix("blocks.") for n in full["state_dict"]}
    with pytest.raises(ValueError, match="already a sharded checkpoint"):
        convert(tmp_path / "sharded", tmp_path / "again", "sharded")


def _load_full_then_sharded(rank: int, world_size: int, folder: str) -> None:
    model, optimizer = _fresh()
    full = torch.load(Path(folder) / "full.ckpt", mmap=True, weights_only=False)
    load_full_state_dict(model, full["state_dict"])
    load_full_optimizer_state(model, optimizer, full["optimizer_states"][0])
    # The checkpoint's param_names are its record for convert, not names for the live optimizer's groups: with
    # them, torch's add_param_group refuses every group without names.
    assert all("param_names" not in group for group in optimizer.param_groups)
    load_sharded(Path(folder) / "sharded", model, [optimizer])
    # An optimizer built from named_parameters has param_names in its groups; the checkpoint has none recorded.
    named = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    load_sharded(Path(folder) / "sharded", model, [named])
    assert named.param_groups[0]["param_names"] == [name for name, _ in model.named_parameters()]
    # A rank keeps state only for parameters it holds elements of (the 0-dim loss scale lives on rank 0 alone).
    held = [param for param in model.parameters() if param.numel()]
    assert all(int(named.state[param]["step"]) == 2 for param in held)
    assert all(param not in named.state for param in model.parameters() if not param.numel())


def test_one_optimizer_loads_a_full_then_a_sharded_checkpoint(saved: Path) -> None:
    run_distributed(_load_full_then_sharded, 2, str(saved))


@pytest.mark.skipif(sys.platform != "linux", reason="the one-step exchange of two names is Linux's renameat2")
def test_replacing_or_removing_a_folder_never_leaves_a_torn_one_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records what sits under the checkpoint's name after every step that changes names or deletes: what a crash
    right then would leave. ``last.ckpt`` is replaced at every save, so this is the common case."""
    final, new = tmp_path / "last.ckpt", tmp_path / ".partial-new.tmp"
    for folder, content in ((final, "old"), (new, "new")):
        folder.mkdir()
        (folder / content).write_text(content)
    seen: list[list[str] | None] = []

    def record() -> None:
        seen.append(sorted(p.name for p in final.iterdir()) if final.exists() else None)

    real_replace, real_rmtree = os.replace, shutil.rmtree
    monkeypatch.setattr(atomic.os, "replace", lambda *args: (real_replace(*args), record()))
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda *args, **kwargs: (record(), real_rmtree(*args, **kwargs)))
    atomic.publish(new, final)
    assert seen and all(entry == ["new"] for entry in seen), seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    seen.clear()
    atomic.remove(final)
    assert seen and all(entry is None for entry in seen), seen  # gone from its name before any file is deleted
    assert not list(tmp_path.iterdir())
