"""Checkpoints of parameters held whole (see [Note: whole tensors] in ``engine/runtime/whole_tensors.py``), on real
ranks.

One 2-rank run trains the tiny GPT with Muon (fp32, ``tests/optimizers.py``) on the blocks' matrices and Adafactor --
whose state is row and column statistics, not shaped like its parameters -- on the rest, and saves both forms. A
resume at 2 ranks lands where the uninterrupted run did, bit for bit; at 1 and 4 ranks (other owners, other rows)
the model and both optimizers' full states come back exactly; a model trained by rows takes the weights saved whole
and the other way round; ``convert`` reads the folder into the full file the ranks wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fsdp import fully_shard
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import full_optimizer_state, load_full_optimizer_state
from lightning_fsdp.checkpoint.sharded import load_sharded, save_sharded, sharded_checkpoint_state
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.runtime.registry import fsdp_param_of
from lightning_fsdp.engine.state.state_dict import full_state_dict, load_full_state_dict
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT
from tests.optimizers import MuonFP32, hidden_matrices


class ScaledGPT(GPT):
    """The tiny GPT with a trainable 0-dim loss scale: one row, on one rank, whatever the optimizer."""

    def __init__(self) -> None:
        super().__init__(TINY_GPT)
        self.loss_scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(idx, targets) * self.loss_scale


def _fresh(optimizers: str = "whole") -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = fully_shard(ScaledGPT(), {Block})
    if optimizers == "rows":
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    hidden, rest = hidden_matrices(model)
    return model, [MuonFP32(hidden, lr=0.02), torch.optim.Adafactor(rest, lr=1e-2)]


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int, seed: int) -> None:
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=data)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def _full(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    return {
        "state_dict": full_state_dict(model),
        "optimizer_states": [full_optimizer_state(model, optimizer) for optimizer in optimizers],
    }


def _save(rank: int, world_size: int, folder: str) -> None:
    model, optimizers = _fresh()
    _train(model, optimizers, 2, seed=rank)
    assert any(fsdp_param_of(p).layout.owner is not None for p in model.parameters()), "nothing is held whole"
    save_sharded(Path(folder) / "sharded", sharded_checkpoint_state(model, optimizers), {"global_step": 2})
    full = _full(model, optimizers)
    if rank == 0:
        torch.save({**full, "global_step": 2}, Path(folder) / "full.ckpt")
    _train(model, optimizers, 2, seed=100 + rank)
    final = full_state_dict(model)
    if rank == 0:
        torch.save(final, Path(folder) / "expected_after_resume.pt")


def _assert_equal(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_equal(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _resume(rank: int, world_size: int, folder: str) -> None:
    saved = torch.load(Path(folder) / "full.ckpt", weights_only=False)
    expected = torch.load(Path(folder) / "expected_after_resume.pt")
    for form in ("sharded", "full"):
        model, optimizers = _fresh()
        if form == "sharded":
            load_sharded(Path(folder) / "sharded", model, optimizers)
        else:
            load_full_state_dict(model, saved["state_dict"])
            for optimizer, state in zip(optimizers, saved["optimizer_states"], strict=True):
                load_full_optimizer_state(model, optimizer, state)
        loaded = _full(model, optimizers)
        if rank == 0:
            _assert_equal(loaded["state_dict"], saved["state_dict"], f"[{form}, W={world_size}] model")
            _assert_equal(loaded["optimizer_states"], saved["optimizer_states"], f"[{form}, W={world_size}] optim")
        if world_size == 2:  # the uninterrupted run's data stream
            _train(model, optimizers, 2, seed=100 + rank)
            final = full_state_dict(model, rank0_only=False)
            for name, tensor in expected.items():
                assert torch.equal(final[name], tensor), f"[{form}] {name} differs from the uninterrupted run"


def _across_layouts(rank: int, world_size: int, folder: str) -> None:
    """Weights saved whole load into a model trained by rows, and a rows checkpoint into one held whole."""
    saved = torch.load(Path(folder) / "full.ckpt", weights_only=False)["state_dict"]
    rows, _ = _fresh("rows")
    load_sharded(Path(folder) / "sharded", rows, [])
    _assert_equal(full_state_dict(rows, rank0_only=False), saved, "rows from whole")
    save_sharded(Path(folder) / f"rows-{world_size}", sharded_checkpoint_state(rows, []), {})
    whole, _ = _fresh()
    load_sharded(Path(folder) / f"rows-{world_size}", whole, [])
    _assert_equal(full_state_dict(whole, rank0_only=False), saved, "whole from rows")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("saved_whole")
    run_distributed(_save, 2, str(folder))
    return folder


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_whole_tensors_resume_exactly_and_load_at_any_world_size(saved: Path, world_size: int) -> None:
    run_distributed(_resume, world_size, str(saved))


def test_weights_move_between_layouts_and_convert_reads_the_folder(saved: Path, tmp_path: Path) -> None:
    run_distributed(_across_layouts, 2, str(saved))
    convert(saved / "sharded", tmp_path / "consolidated.ckpt", "full", quiet=True)
    consolidated = torch.load(tmp_path / "consolidated.ckpt", weights_only=False)
    full = torch.load(saved / "full.ckpt", weights_only=False)
    _assert_equal(consolidated["state_dict"], full["state_dict"], "convert: model")
    for converted, written in zip(consolidated["optimizer_states"], full["optimizer_states"], strict=True):
        _assert_equal(converted["state"], written["state"], "convert: optimizer state")
