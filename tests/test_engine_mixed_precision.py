"""Mixed precision: half-precision gathers and reductions, fp32 master shards, against a reference doing the same casts.

bf16 matmuls have no fast kernels on these CPUs, so the model stays tiny and the steps few.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_fsdp import MixedPrecision, fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT, initialize, max_relative_error, reduce_scatter_kind

LOCAL_BATCH = 2
# The sharded run reduces W half-precision gradients of local batches (divided by W first); the reference computes
# the global batch's gradient in one half-precision backward. Both round differently at the dtype's 8 (bf16) or 11
# (fp16) bits, so after SGD steps the weights agree to a fraction of a percent, not to fp32's 1e-5.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _batches(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (LOCAL_BATCH * world_size, TINY_GPT.block_size + 1), generator=data)
    return tokens[:, :-1], tokens[:, 1:]


def _reference_step(master: nn.Module, low: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """What mixed precision means, written out: compute in the low copy, step the fp32 master."""
    with torch.no_grad():
        for low_param, param in zip(low.parameters(), master.parameters(), strict=True):
            low_param.copy_(param)
    loss = low(inputs, targets)
    loss.backward()
    for low_param, param in zip(low.parameters(), master.parameters(), strict=True):
        param.grad = low_param.grad.float()
        low_param.grad = None
    return loss.item()


def _check_parity_and_dtypes(rank: int, world_size: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    master = GPT(TINY_GPT)
    low = copy.deepcopy(master).to(dtype)
    model = fully_shard(copy.deepcopy(master), {Block}, mixed_precision=MixedPrecision(dtype, dtype, dtype))
    seen_dtypes: set[torch.dtype] = set()
    model.blocks[0].mlp.fc.register_forward_pre_hook(lambda m, _: seen_dtypes.add(m.weight.dtype))
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, master))
    local = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for step in range(3):
        inputs, targets = _batches(step, world_size)
        model(inputs[local], targets[local]).backward()
        _reference_step(master, low, inputs, targets)
        assert all(p.grad.dtype == torch.float32 for p in model.parameters()), "sharded gradients must be fp32"
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    assert seen_dtypes == {dtype}, f"forward computed with {seen_dtypes}, not {dtype}"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "the optimizer's shards must stay fp32"
    with summon_full_params(model, writeback=False):
        for (name, param), ref_param in zip(model.named_parameters(), master.parameters(), strict=True):
            error = max_relative_error(param.float(), ref_param)
            assert error < TOLERANCE[dtype], f"[{dtype}] {name}: relative error {error:.2e}"


def _check_bytes_buffers_and_inputs(rank: int, world_size: int) -> None:
    inputs, targets = _batches(0, 1)

    def counted(precision: MixedPrecision | None) -> CollectiveCounter:
        torch.manual_seed(0)
        model = fully_shard(GPT(TINY_GPT), {Block}, mixed_precision=precision)
        initialize(model, inputs, targets)
        with CollectiveCounter() as counter:
            model(inputs, targets).backward()
        return counter

    fp32 = counted(None)
    bf16 = counted(MixedPrecision(param_dtype=torch.bfloat16))
    bf16_fp32_reduce = counted(MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert bf16.bytes["all_gather"] * 2 == fp32.bytes["all_gather"], "bf16 gathers move half the bytes"
    reduce = reduce_scatter_kind()
    assert bf16.bytes[reduce] * 2 == fp32.bytes[reduce], "reduce_dtype defaults to param_dtype"
    assert bf16_fp32_reduce.bytes[reduce] == fp32.bytes[reduce], "an fp32 reduce_dtype reduces in fp32"
    assert {e.dtype for e in bf16.events if e.kind != "barrier"} == {torch.bfloat16}

    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))
            self.input_dtypes: list[torch.dtype] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.input_dtypes.append(x.dtype)
            return self.linear(x) * self.scale

    precision = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, cast_forward_inputs=True)
    model = fully_shard(WithBuffer(), mixed_precision=precision)
    assert model.scale.dtype == torch.bfloat16, "floating-point buffers take buffer_dtype"
    output = model(torch.randn(3, 4))
    assert model.input_dtypes == [torch.bfloat16] and output.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_parity_with_fp32_master_shards(dtype: torch.dtype) -> None:
    run_distributed(_check_parity_and_dtypes, 2, dtype)


def test_half_precision_halves_the_bytes_and_casts_buffers_and_inputs() -> None:
    run_distributed(_check_bytes_buffers_and_inputs, 2)


class _TinyMixed(nn.Module):
    """A root parameter and two units, one of them with rows that do not divide by the ranks (padded shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x * self.scale).square().mean()


SUMMON_CONFIGS = [
    {"sharding_strategy": "FULL_SHARD"},
    {"sharding_strategy": "FULL_SHARD", "cpu_offload": True},
    {"sharding_strategy": "SHARD_GRAD_OP"},
    {"sharding_strategy": "NO_SHARD"},
    {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)},
]


def _masters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _assert_bitwise_equal(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert found[name].dtype == value.dtype and torch.equal(found[name], value), f"{what}: {name}"


def _steps(pairs: list[tuple[nn.Module, torch.optim.Optimizer]], inputs: torch.Tensor) -> None:
    for model, optimizer in pairs:
        model(inputs).backward()
        optimizer.step()
        optimizer.zero_grad()


def _check_summon_shows_and_keeps_the_masters(rank: int, world_size: int) -> None:
    from lightning_fsdp.engine.state.state_dict import full_state_dict

    precision = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for config in SUMMON_CONFIGS:
        torch.manual_seed(0)
        reference = _TinyMixed()
        model, twin = (
            fully_shard(copy.deepcopy(reference), {nn.Linear}, mixed_precision=precision, **config) for _ in range(2)
        )
        seen: set[torch.dtype] = set()
        model.blocks[2].register_forward_pre_hook(lambda m, _, seen=seen: seen.add(m.weight.dtype))
        pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (model, twin)]
        _steps(pairs, inputs)
        before = _masters(model)
        full = full_state_dict(model, rank0_only=False)
        with summon_full_params(model):  # a read-only look, with the default writeback
            inside = {name: param.detach().cpu().clone() for name, param in model.named_parameters()}
            assert all(p.dtype == torch.float32 and p.shape == full[n].shape for n, p in model.named_parameters())
        _assert_bitwise_equal(inside, full, f"{config} inside summon equals the fp32 masters")
        _assert_bitwise_equal(_masters(model), before, f"{config} a read-only summon rounds no master")
        seen.clear()
        _steps(pairs, inputs)  # training afterwards: bf16 gathers, the same steps as a model never summoned
        assert seen == {torch.bfloat16}, f"{config}: the forward after summon computed with {seen}"
        _assert_bitwise_equal(_masters(model), _masters(twin), f"{config} training after summon")

        full = full_state_dict(model, rank0_only=False)
        edit = torch.tensor(0.123456789)  # not a bf16 value
        with summon_full_params(model), torch.no_grad():
            model.blocks[2].weight[2, 5] = edit
            model.scale.mul_(3.0)
        with summon_full_params(model, writeback=False), torch.no_grad():
            model.blocks[0].weight.zero_()  # discarded
        after = full_state_dict(model, rank0_only=False)
        assert after["blocks.2.weight"][2, 5] == edit, f"{config}: the edit sticks exactly"
        assert torch.equal(after["scale"], full["scale"] * 3.0), config
        assert torch.equal(after["blocks.0.weight"], full["blocks.0.weight"]), f"{config}: writeback=False"
        untouched = {k: v for k, v in after.items() if k not in ("scale", "blocks.2.weight")}
        _assert_bitwise_equal(untouched, {k: full[k] for k in untouched}, f"{config} edits change nothing else")


def test_summon_full_params_shows_the_fp32_masters_and_never_rounds_them() -> None:
    run_distributed(_check_summon_shows_and_keeps_the_masters, 2)
