"""BatchNorm's running statistics in checkpoints, as DDP keeps them: ranks fed different data drift apart, and both
checkpoint forms hold rank 0's statistics (see [Note: buffers are rank 0's at every checkpoint] in
engine/features/module_buffers.py), resuming from either ends where the uninterrupted run did, and ``convert`` of the
sharded folder gives rank 0's statistics too, and evaluation after training uses rank 0's on every rank. One 2-rank run
does the training, saves and resumes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_fsdp import fully_shard
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import full_optimizer_state, load_full_optimizer_state
from lightning_fsdp.checkpoint.sharded import load_sharded, save_sharded, sharded_checkpoint_state
from lightning_fsdp.engine.state.state_dict import full_state_dict, load_full_state_dict
from tests.conv_nets import BasicBlock, ResNet
from tests.distributed import run_distributed


def _fresh() -> tuple[ResNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(ResNet(), {BasicBlock})
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(model: ResNet, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        images = torch.randn(4, 3, 16, 16, generator=data) * (1 + seed % 7)  # other statistics on every rank
        F.cross_entropy(model(images), torch.randint(0, 5, (4,), generator=data)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _buffers(model: ResNet) -> dict[str, torch.Tensor]:
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


def _each_ranks(buffers: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, buffers)
    return gathered


def _save_train_resume(rank: int, world_size: int, folder: str) -> None:
    root = Path(folder)
    model, optimizer = _fresh()
    _train(model, optimizer, 2, seed=rank)
    before = _each_ranks(_buffers(model))
    assert not torch.equal(before[0]["blocks.1.bn1.running_mean"], before[1]["blocks.1.bn1.running_mean"]), (
        "the ranks' statistics should differ before the save, or this test shows nothing"
    )
    save_sharded(root / "sharded", sharded_checkpoint_state(model, [optimizer]), {"global_step": 2})
    full = {"state_dict": full_state_dict(model), "optimizer_states": [full_optimizer_state(model, optimizer)]}
    if rank == 0:
        torch.save(full, root / "full.ckpt")
        torch.save(before[0], root / "rank0_buffers.pt")
    for name, value in _buffers(model).items():  # every rank continues from the saved statistics
        assert torch.equal(value, before[0][name]), f"rank {rank} kept its own {name} after the save"
    _train(model, optimizer, 2, seed=100 + rank)
    expected_buffers = _buffers(model)  # before the state dict below makes them rank 0's
    expected = full_state_dict(model, rank0_only=False)
    dist.barrier()
    for form in ("full", "sharded"):
        model, optimizer = _fresh()
        if form == "sharded":
            load_sharded(root / "sharded", model, [optimizer])
        else:
            saved = torch.load(root / "full.ckpt", mmap=True, weights_only=True)
            load_full_state_dict(model, saved["state_dict"])
            load_full_optimizer_state(model, optimizer, saved["optimizer_states"][0])
        for name, value in _buffers(model).items():
            assert torch.equal(value, before[0][name]), f"[{form}] rank {rank} resumed with other {name}"
        _train(model, optimizer, 2, seed=100 + rank)
        for name, value in _buffers(model).items():  # this rank's own statistics, before any broadcast
            assert torch.equal(value, expected_buffers[name]), f"[{form}] rank {rank}: {name} differs"
        final = full_state_dict(model, rank0_only=False)
        for name, value in expected.items():
            assert torch.equal(final[name], value), f"[{form}] {name} differs from the uninterrupted run"
    _train(model, optimizer, 1, seed=200 + rank)  # the ranks' statistics drift apart again
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 3, 16, 16))
    evaluated = _each_ranks(_buffers(model))
    for name, value in evaluated[1].items():  # validation normalises with rank 0's statistics on every rank
        assert torch.equal(value, evaluated[0][name]), f"in eval, rank 1's {name} is its own"


def test_both_checkpoint_forms_hold_rank0s_batchnorm_statistics(tmp_path: Path) -> None:
    run_distributed(_save_train_resume, 2, str(tmp_path), timeout=240.0)
    rank0 = torch.load(tmp_path / "rank0_buffers.pt", weights_only=True)
    convert(tmp_path / "sharded", tmp_path / "converted.ckpt", "full", quiet=True)
    for label, file in (("full", "full.ckpt"), ("converted sharded", "converted.ckpt")):
        state = torch.load(tmp_path / file, weights_only=True)["state_dict"]
        for name, value in rank0.items():
            assert torch.equal(state[name], value), f"[{label}] {name} is not rank 0's"
