"""Checkpoint formats without Lightning: sharded folder and full file round trips at other world sizes, the
checks that refuse torn or foreign checkpoints, and offline conversion between the forms."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_fsdp import fully_shard
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import full_optimizer_state, load_full_optimizer_state
from lightning_fsdp.checkpoint.sharded import load_sharded, save_sharded, sharded_checkpoint_state
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.state_dict import full_state_dict, load_full_state_dict
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=data)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(GPT(TINY_GPT), {Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save(rank: int, world_size: int, folder: str) -> None:
    model, optimizer = _fresh()
    _train(model, optimizer, 2, seed=rank)
    save_sharded(Path(folder) / "sharded", sharded_checkpoint_state(model, [optimizer]), {"global_step": 2})
    full = {"state_dict": full_state_dict(model), "optimizer_states": [full_optimizer_state(model, optimizer)]}
    if rank == 0:
        torch.save({**full, "global_step": 2}, Path(folder) / "full.ckpt")
    _train(model, optimizer, 2, seed=100 + rank)  # what a resumed run must reproduce
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
            _train(model, optimizer, 2, seed=100 + rank)
            final = full_state_dict(model, rank0_only=False)
            for name, tensor in expected.items():
                assert torch.equal(final[name], tensor), f"[{form}] {name} differs from the uninterrupted run"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_round_trips_resume_exactly_and_load_at_any_world_size(tmp_path: Path, world_size: int) -> None:
    run_distributed(_save, 2, str(tmp_path))
    run_distributed(_resume, world_size, str(tmp_path))


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


def test_torn_and_foreign_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    run_distributed(_save, 2, str(tmp_path))
    sharded = tmp_path / "sharded"
    for name in ("missing_shard", "truncated", "no_meta"):
        shutil.copytree(sharded, tmp_path / name)
    (tmp_path / "missing_shard" / "__1_0.distcp").unlink()
    with open(tmp_path / "truncated" / "__0_0.distcp", "r+b") as handle:
        handle.truncate(100)
    (tmp_path / "no_meta" / "meta.pt").unlink()
    run_distributed(_refuse, 2, str(tmp_path))


def test_convert_between_forms_offline(tmp_path: Path) -> None:
    run_distributed(_save, 2, str(tmp_path))
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
