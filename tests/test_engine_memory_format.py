"""Memory formats: a ``channels_last`` convolution weight stays ``channels_last`` through sharding, gathering,
gradient reduction and the optimizer's steps, and trains as the unsharded model does."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from lightning_fsdp import fully_shard, summon_full_params
from lightning_fsdp.engine.state.state_dict import full_state_dict
from tests.distributed import run_distributed

LOCAL_BATCH = 2
CHANNELS_LAST = torch.channels_last


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 5, 3)  # 5 output channels: rows that do not divide by the ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.bn(self.conv1(x)))).square().mean()


def _conv_weights(model: nn.Module) -> list[torch.Tensor]:
    return [model.conv1.weight, model.conv2.weight]


def _check_channels_last(rank: int, world_size: int) -> None:
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        torch.manual_seed(0)
        reference = ConvNet().to(memory_format=CHANNELS_LAST)
        model = fully_shard(copy.deepcopy(reference), {nn.Conv2d}, sharding_strategy=strategy)
        layouts: list[bool] = []
        for conv in (model.conv1, model.conv2):
            conv.register_forward_pre_hook(
                lambda m, _, layouts=layouts: layouts.append(m.weight.is_contiguous(memory_format=CHANNELS_LAST))
            )
        optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
        for step in range(3):
            images = torch.randn(LOCAL_BATCH * world_size, 3, 6, 6, generator=torch.Generator().manual_seed(step))
            images = images.to(memory_format=CHANNELS_LAST)
            model(images[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]).backward()
            for r in range(world_size):  # each rank's batch statistics, the gradients averaged over ranks as DDP does
                (reference(images[r * LOCAL_BATCH : (r + 1) * LOCAL_BATCH]) / world_size).backward()
            for opt in (optimizer, ref_optimizer):
                opt.step()
                opt.zero_grad()
        assert layouts and all(layouts), f"[{strategy}] a gathered conv weight lost channels_last: {layouts}"
        shards = [w for w in _conv_weights(model) if w.numel()]
        assert all(w.is_contiguous(memory_format=CHANNELS_LAST) for w in shards), f"[{strategy}] the shards"
        with summon_full_params(model):
            for full, expected in zip(_conv_weights(model), _conv_weights(reference), strict=True):
                assert full.is_contiguous(memory_format=CHANNELS_LAST), f"[{strategy}] summoned"
                torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-6)
        state = full_state_dict(model, rank0_only=False)
        for name, expected in reference.named_parameters():
            torch.testing.assert_close(state[name], expected.detach(), rtol=1e-5, atol=1e-6, msg=f"{strategy} {name}")


def _check_sharded_checkpoint_round_trip(rank: int, world_size: int, folder: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from lightning_fsdp.engine.state.state_dict import sharded_state_dict

    torch.manual_seed(0)
    model = fully_shard(ConvNet().to(memory_format=CHANNELS_LAST), {nn.Conv2d})
    images = torch.randn(LOCAL_BATCH, 3, 6, 6).to(memory_format=CHANNELS_LAST)
    model(images).backward()
    dcp.save(sharded_state_dict(model), checkpoint_id=folder)
    dist.barrier()
    torch.manual_seed(1)
    restored = fully_shard(ConvNet().to(memory_format=CHANNELS_LAST), {nn.Conv2d})
    state = sharded_state_dict(restored)
    dcp.load(state, checkpoint_id=folder)
    expected, found = full_state_dict(model, rank0_only=False), full_state_dict(restored, rank0_only=False)
    for name, value in expected.items():
        assert torch.equal(found[name], value), name
    assert restored.conv1.weight.is_contiguous(memory_format=CHANNELS_LAST)


def test_channels_last_conv_weights_keep_their_format_and_train_as_unsharded() -> None:
    run_distributed(_check_channels_last, 2)


def test_channels_last_sharded_checkpoint_round_trips(tmp_path: Path) -> None:
    run_distributed(_check_sharded_checkpoint_round_trip, 2, str(tmp_path / "ckpt"))
