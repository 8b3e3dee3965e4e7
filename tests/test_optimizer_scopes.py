"""What an optimizer reads to update a parameter, asked by experiment (``engine/optimizers/scope.py``), in one process.

The probe must answer right for optimizers nobody listed -- pytorch-optimizer's and bitsandbytes' as their users build
them, and optimizers defined here that the product cannot know -- must leave the real optimizer untouched, and must
agree with the table that lets the torch optimizers skip it. The owners of whole tensors balance bytes inside a unit
and work across units.
"""

from __future__ import annotations

import warnings

import bitsandbytes
import pytest
import pytorch_optimizer
import torch
import torchao.optim as torchao_optim
from torch import nn

from lightning_fsdp import UpdateScope, declare_update_scope
from lightning_fsdp.engine.optimizers.owners import plan_owners, work_of
from lightning_fsdp.engine.optimizers.scope import (
    KNOWN_SCOPES,
    PROBE_MAX_NUMEL,
    ProbeFailedError,
    declared_scope,
    probe_scope,
    probe_shape,
)
from tests.optimizers import GlobalNormSGD, LatePreconditioner, MuonFP32, NormalizedSGD, SignSGD

ELEMENTWISE, TENSOR, ACROSS = UpdateScope.ELEMENTWISE, UpdateScope.TENSOR, UpdateScope.ACROSS_TENSORS
MATRIX, VECTOR, KERNEL = (96, 40), (50,), (12, 6, 3)


def _optimizer(cls: type, **kwargs: object) -> torch.optim.Optimizer:
    return cls([nn.Parameter(torch.zeros(4, 3))], **kwargs)


def _probe(optimizer: torch.optim.Optimizer, shape: tuple[int, ...]) -> UpdateScope:
    return probe_scope(optimizer, 0, shape, torch.zeros(()))


@pytest.mark.parametrize("cls", [c for c in KNOWN_SCOPES if c is not torch.optim.LBFGS], ids=lambda c: c.__name__)
def test_the_table_of_torch_optimizers_says_what_the_probe_finds(cls: type) -> None:
    optimizer = _optimizer(cls)
    shapes = [MATRIX] if cls is getattr(torch.optim, "Muon", None) else [MATRIX, VECTOR, KERNEL]
    for shape in shapes:
        assert _probe(optimizer, shape) is KNOWN_SCOPES[cls], f"{cls.__name__} {shape}"


def test_optimizers_defined_here_are_told_apart() -> None:
    for shape in (MATRIX, VECTOR, KERNEL):
        assert _probe(_optimizer(SignSGD), shape) is ELEMENTWISE
        assert _probe(_optimizer(NormalizedSGD), shape) is TENSOR
        assert _probe(_optimizer(GlobalNormSGD), shape) is ACROSS
        # By its state, before it reads rows; a vector's rows are its elements, which it does read one by one.
        assert _probe(_optimizer(LatePreconditioner), shape) is (ELEMENTWISE if shape == VECTOR else TENSOR)


def test_optimizers_of_the_libraries_users_install() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _probe(_optimizer(pytorch_optimizer.Lamb), MATRIX) is TENSOR  # a trust ratio per tensor
        assert _probe(_optimizer(pytorch_optimizer.Lamb, pre_norm=True), MATRIX) is ACROSS  # a global norm too
        assert _probe(_optimizer(pytorch_optimizer.Shampoo), MATRIX) is TENSOR
        assert _probe(_optimizer(pytorch_optimizer.Prodigy), MATRIX) is ACROSS  # its step size from every tensor
        assert _probe(_optimizer(pytorch_optimizer.Lion), MATRIX) is ELEMENTWISE
        # 8-bit states in blocks, from 4096 elements on; smaller tensors keep 32-bit states, element by element.
        assert _probe(_optimizer(bitsandbytes.optim.AdamW8bit), (128, 64)) is TENSOR
        assert _probe(_optimizer(bitsandbytes.optim.AdamW8bit), (30, 20)) is ELEMENTWISE
        # torchao's low-bit states are tensor subclasses shaped like the parameter but quantized in blocks.
        assert _probe(_optimizer(torchao_optim.AdamW8bit), (128, 64)) is TENSOR
        assert _probe(_optimizer(torchao_optim.AdamW4bit), (128, 64)) is TENSOR
        assert _probe(_optimizer(torchao_optim.AdamW8bit), (30, 20)) is ELEMENTWISE


def test_the_probe_leaves_the_real_optimizer_and_its_scheduler_alone() -> None:
    param = nn.Parameter(torch.randn(6, 5))
    optimizer = torch.optim.Adafactor([param], lr=0.05)
    param.grad = torch.randn_like(param)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # patches optimizer.step on the instance
    before = (param.detach().clone(), {k: v.clone() for k, v in optimizer.state[param].items()})
    group_before = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    calls_before = optimizer._opt_called if hasattr(optimizer, "_opt_called") else None
    assert _probe(optimizer, MATRIX) is TENSOR
    assert torch.equal(param, before[0])
    assert optimizer.state[param].keys() == before[1].keys()
    assert all(torch.equal(optimizer.state[param][k], v) for k, v in before[1].items())
    assert {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} == group_before
    assert optimizer.param_groups[0]["params"] == [param]
    assert getattr(optimizer, "_opt_called", None) == calls_before
    assert scheduler.last_epoch == 0


def test_a_step_the_probe_cannot_run_is_reported() -> None:
    class NeedsTwoCalls(torch.optim.SGD):
        def step(self, closure: object = None) -> None:
            raise RuntimeError("call first_step and second_step instead")

    with pytest.raises(ProbeFailedError, match="first_step"):
        _probe(_optimizer(NeedsTwoCalls, lr=0.1), MATRIX)


def test_a_zero_learning_rate_does_not_hide_what_the_step_reads() -> None:
    """A warm-up's first step (or a zero-lr step that only creates state) moves nothing: the probe steps at the
    group's ``initial_lr`` or a rate of its own; a step that still changes nothing cannot be judged."""
    assert _probe(_optimizer(MuonFP32, lr=0.0), MATRIX) is TENSOR
    warming_up = _optimizer(NormalizedSGD, lr=0.5)
    torch.optim.lr_scheduler.LambdaLR(warming_up, lambda step: step / 10)  # lr 0 now, initial_lr 0.5 recorded
    assert warming_up.param_groups[0]["lr"] == 0.0 and _probe(warming_up, MATRIX) is TENSOR

    class Frozen(SignSGD):
        def step(self, closure: object = None) -> None:
            return None

    with pytest.raises(ProbeFailedError, match="did not change the test tensor"):
        _probe(_optimizer(Frozen), MATRIX)


def test_declared_scopes_replace_the_probe_for_exactly_that_class() -> None:
    class Mine(SignSGD):
        pass

    assert declared_scope(_optimizer(Mine)) is None
    declare_update_scope(Mine, "tensor")
    assert declared_scope(_optimizer(Mine)) is TENSOR
    assert declared_scope(_optimizer(SignSGD)) is None  # not the base class
    assert declared_scope(_optimizer(torch.optim.AdamW)) is ELEMENTWISE  # the table
    with pytest.raises(ValueError, match="'rows' is not one of 'elementwise', 'tensor', 'across_tensors'"):
        declare_update_scope(Mine, "rows")
    with pytest.raises(TypeError, match="takes an optimizer class"):
        declare_update_scope(_optimizer(Mine), "tensor")


def test_large_tensors_are_probed_at_a_smaller_shape_of_the_same_proportions() -> None:
    assert probe_shape(torch.Size((300, 40))) == (300, 40)
    assert probe_shape(torch.Size(())) == (1,)
    small = probe_shape(torch.Size((32768, 4096)))
    assert len(small) == 2 and small[0] * small[1] <= 1.1 * PROBE_MAX_NUMEL and 7.9 < small[0] / small[1] < 8.1
    assert probe_shape(torch.Size((1, 1 << 20)))[0] == 1  # a single row stays one row


def test_owners_balance_bytes_in_a_unit_and_work_across_units() -> None:
    d = 64
    block = [torch.Size(s) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]  # qkv, proj, fc, fc's projection
    work = [0, 0]
    owners = plan_owners(block, work)
    filled = [sum(s.numel() for s, o in zip(block, owners, strict=True) if o == r) for r in range(2)]
    assert filled == [7 * d * d, 5 * d * d]  # the largest first, each to the emptier segment: the best split
    work = [0] * 4
    per_rank = [0] * 4
    for _ in range(4):  # four identical blocks on four ranks: the largest matrix goes round
        for shape, owner in zip(block, plan_owners(block, work), strict=True):
            per_rank[owner] += work_of(shape)
    # Without turns one rank would do every block's largest matrix: 1.33 x the mean.
    assert max(per_rank) <= 1.1 * sum(per_rank) / 4, per_rank
