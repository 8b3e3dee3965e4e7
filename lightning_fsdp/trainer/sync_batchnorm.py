"""``Trainer(sync_batchnorm=True)`` on CPU ranks as well as on GPUs.

Lightning's ``TorchSyncBatchNorm`` converts batch norms to ``torch.nn.SyncBatchNorm``, whose forward refuses CPU
tensors (and which DDP refuses on CPU modules). :class:`SyncBatchNorm` is a batch norm for CPU ranks: the batch
statistics (per-channel sum, sum of
squares and count) are all-reduced over the data-parallel group by a differentiable sum (:class:`_AllReduceSum`:
the gradient of a sum over ranks is the sum over ranks of the gradients), so the gradients are those of normalising
by the global batch's statistics -- the same math as torch's CUDA kernel. On GPUs the strategy keeps torch's class.

Batch norm parameters are tiny; they are sharded like any other parameter, while the statistics are synchronised
over every rank of the data-parallel group (the whole world: every rank sees its own slice of the data).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override


class SyncBatchNorm(_BatchNorm):
    """A batch norm whose training statistics are those of the whole data-parallel batch, on CPU ranks (see the
    module docstring); built by :class:`CPUCapableSyncBatchNorm` from the model's ``BatchNorm*d`` layers."""

    def __init__(self, *args: Any, process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @override
    def forward(self, input: Tensor) -> Tensor:
        if not self._syncs():
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.shape[1]
        flat = input.transpose(0, 1).reshape(channels, -1)
        local = torch.stack([flat.sum(1), (flat * flat).sum(1), flat.new_full((channels,), flat.shape[1])])
        total = _AllReduceSum.apply(local, self.process_group or dist.group.WORLD)
        count = total[2]
        mean = total[0] / count
        var = total[1] / count - mean * mean  # biased: what normalisation uses
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            self._update_running_stats(mean.detach(), var.detach(), count[0].item())
        shape = [1, channels] + [1] * (input.dim() - 2)
        output = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output

    def _syncs(self) -> bool:
        """Synchronise exactly when torch's class would: training, with batch statistics, over several ranks."""
        batch_stats = self.training or not self.track_running_stats
        if not (batch_stats and self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group or dist.group.WORLD) > 1

    def _update_running_stats(self, mean: Tensor, var: Tensor, count: float) -> None:
        assert self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / max(count - 1.0, 1.0))
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)


class _AllReduceSum(torch.autograd.Function):
    """``all_reduce(SUM)`` with its gradient: every rank's output depends on every rank's input."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class CPUCapableSyncBatchNorm(TorchSyncBatchNorm):
    """Lightning's ``TorchSyncBatchNorm`` plugin converting to :class:`SyncBatchNorm` (usable with ddp as well:
    ``Trainer(strategy="ddp", plugins=[CPUCapableSyncBatchNorm()])``)."""

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        """torch's conversion (which copies weights, buffers and flags), then our CPU class in place of torch's."""
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        for module in converted.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = SyncBatchNorm
        return converted

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        for module in model.modules():
            if type(module) is SyncBatchNorm:
                module.__class__ = nn.SyncBatchNorm
        return super().revert(model)


def for_device(layer_sync: LayerSync, device: torch.device) -> LayerSync:
    """Lightning's default sync plugin on CPU ranks becomes :class:`CPUCapableSyncBatchNorm`; anything else as given."""
    if device.type == "cpu" and type(layer_sync) is TorchSyncBatchNorm:
        return CPUCapableSyncBatchNorm()
    return layer_sync
