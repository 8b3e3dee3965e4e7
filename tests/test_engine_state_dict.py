"""Engine state dicts: full and sharded (DTensor) forms round-trip, and reshard across world sizes via DCP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from lightning_fsdp import fully_shard
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.state.state_dict import (
    full_state_dict,
    init_optimizer_state,
    load_full_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT


def _trained(strategy: str = "FULL_SHARD") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(GPT(TINY_GPT), {Block}, sharding_strategy=strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=torch.Generator())
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    return model, optimizer


def _save(rank: int, world_size: int, folder: str) -> None:
    model, optimizer = _trained()
    full = full_state_dict(model)
    if rank == 0:
        assert full.keys() == GPT(TINY_GPT).state_dict().keys()
        assert all(t.device.type == "cpu" for t in full.values())
        torch.save(
            {"model": full, "optimizer_exp_avg": {n: s["exp_avg"] for n, s in _full_moments(model, optimizer)}},
            Path(folder) / "full.pt",
        )
    else:
        assert full == {}, "ranks other than 0 keep nothing"
        _full_moments(model, optimizer)
    sharded = sharded_state_dict(model)
    assert isinstance(sharded["blocks.0.mlp.fc.weight"], DTensor)
    assert sharded["blocks.0.mlp.fc.weight"].shape == (4 * TINY_GPT.n_embd, TINY_GPT.n_embd)
    dcp.save({"model": sharded, "optimizer": sharded_optimizer_state_dict(model, optimizer)}, checkpoint_id=folder)


def _full_moments(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, dict]]:
    """Adam's first moments at full shape, by name, gathered with summon-free DTensor redistribution."""
    state = sharded_optimizer_state_dict(model, optimizer)["state"]
    return [
        (name, {"exp_avg": v["exp_avg"].full_tensor() if isinstance(v["exp_avg"], DTensor) else v["exp_avg"]})
        for name, v in state.items()
    ]


def _load(rank: int, world_size: int, folder: str) -> None:
    saved = torch.load(Path(folder) / "full.pt", mmap=True)
    model = fully_shard(GPT(TINY_GPT), {Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    init_optimizer_state(optimizer)
    target = {"model": sharded_state_dict(model), "optimizer": sharded_optimizer_state_dict(model, optimizer)}
    dcp.load(target, checkpoint_id=folder)  # written by 2 ranks, read by world_size ranks, into the shards
    loaded = full_state_dict(model, rank0_only=False)
    for name, tensor in saved["model"].items():
        assert torch.equal(loaded[name], tensor), f"W={world_size}: {name} differs after the sharded load"
    for name, moments in _full_moments(model, optimizer):
        assert torch.equal(moments["exp_avg"], saved["optimizer_exp_avg"][name]), f"exp_avg of {name} differs"
    fresh = fully_shard(GPT(TINY_GPT), {Block})
    load_full_state_dict(fresh, saved["model"])
    for name, tensor in full_state_dict(fresh, rank0_only=False).items():
        assert torch.equal(tensor, saved["model"][name]), f"W={world_size}: {name} differs after the full load"
    wrong = dict(saved["model"])
    wrong.pop("ln_f.bias")
    wrong["blocks.0.mlp.fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"missing keys \['ln_f.bias'\].*'blocks.0.mlp.fc.weight' has shape \(3, 3\)"):
        load_full_state_dict(fresh, wrong)


@pytest.mark.parametrize("load_world_size", [1, 4])
def test_sharded_and_full_state_dicts_reshard_across_world_sizes(tmp_path: Path, load_world_size: int) -> None:
    run_distributed(_save, 2, str(tmp_path))
    run_distributed(_load, load_world_size, str(tmp_path))
