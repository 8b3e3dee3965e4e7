"""Bad input gets one sentence that names the problem and the fix, before anything is changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp import fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT


def test_uninitialized_process_group_is_refused() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(GPT(TINY_GPT), {Block})


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo group in the test process: enough for input checks that cross no rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding_strategy": "ZERO3"}, r"sharding_strategy='ZERO3' is not supported; use one of 'FULL_SHARD'"),
        ({"backward_prefetch": "EARLY"}, r"backward_prefetch='EARLY' is not supported; use one of 'BACKWARD_PRE'"),
        ({"policy": {nn.Conv2d}}, r"selects no submodule of GPT.*candidates: .*Block"),
        ({"policy": {"Block"}}, r"policy holds 'Block', which is not an nn.Module class"),
    ],
)
def test_bad_arguments_are_refused_before_sharding(kwargs: dict, message: str) -> None:
    model = GPT(TINY_GPT)
    shapes = [p.shape for p in model.parameters()]
    with pytest.raises((ValueError, TypeError), match=message):
        fully_shard(model, **{"policy": {Block}, **kwargs})
    assert [p.shape for p in model.parameters()] == shapes, "a refused call left the model half-sharded"


@pytest.mark.usefixtures("single_rank_group")
def test_sharding_twice_is_refused() -> None:
    model = fully_shard(GPT(TINY_GPT), {Block})
    with pytest.raises(ValueError, match="already sharded"):
        fully_shard(model)


@pytest.mark.usefixtures("single_rank_group")
def test_mixed_dtypes_in_one_unit_are_refused_with_the_odd_parameter_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].bias.data = model[1].bias.data.double()
    with pytest.raises(ValueError, match=r"different dtypes.*1\.bias"):
        fully_shard(model)


@pytest.mark.usefixtures("single_rank_group")
def test_one_rank_computes_what_the_plain_model_computes() -> None:
    torch.manual_seed(0)
    reference = GPT(TINY_GPT)
    torch.manual_seed(0)
    model = fully_shard(GPT(TINY_GPT), {Block})
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1))
    loss, ref_loss = model(tokens[:, :-1], tokens[:, 1:]), reference(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, ref_param.grad, msg=f"{name}: gradient differs")


BAD_VALUES = [
    ({"sharding_strategy": "ZERO3"}, {"sharding_strategy": "ZERO3"}),
    ({"backward_prefetch": "EARLY"}, {"backward_prefetch": "EARLY"}),
    ({"policy": {int}}, {"auto_wrap_policy": {int}}),
    ({"policy": set()}, {"auto_wrap_policy": set()}),
    ({"policy": nn.Linear(2, 2)}, {"auto_wrap_policy": nn.Linear(2, 2)}),
    ({"policy": 3}, {"auto_wrap_policy": 3}),
]


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(("engine_kwargs", "strategy_kwargs"), BAD_VALUES)
def test_the_strategy_and_fully_shard_refuse_a_bad_value_alike(engine_kwargs: dict, strategy_kwargs: dict) -> None:
    """One vocabulary: the strategy adapts Lightning's forms onto the engine's validation, so a bad value gets the
    same exception and the same sentence (naming the argument it was given as) from both."""
    from lightning_fsdp import FSDPStrategy

    with pytest.raises(ValueError) as from_engine:
        fully_shard(GPT(TINY_GPT), **{"policy": {Block}, **engine_kwargs})
    with pytest.raises(ValueError) as from_strategy:
        FSDPStrategy(**strategy_kwargs)
    assert type(from_engine.value) is type(from_strategy.value)
    assert str(from_strategy.value).replace("auto_wrap_policy", "policy") == str(from_engine.value)


class _Holder(nn.Module):
    """A LightningModule's shape: the root unit holds the GPT as a child and its forward (the step) calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(TINY_GPT)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


def _call_submodules_outside_the_forward(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    holder = fully_shard(_Holder(), {Block})
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, 8))
    holder(tokens).float().square().mean().backward()  # a training step: the root is resharded at its end
    with pytest.raises(RuntimeError) as error:
        holder.model(tokens)  # a callback's ``pl_module.model(x)``
    message = str(error.value)
    assert message.startswith("GPT `model` was called on its own while the sharded unit it belongs to (_Holder)")
    assert "call the sharded _Holder itself" in message and "summon_full_params" in message, message
    with torch.no_grad():
        expected = holder(tokens)  # a no-grad forward reshards the root at its end too
        with pytest.raises(RuntimeError, match="GPT `model` was called on its own"):
            holder.model(tokens)
        with summon_full_params(holder, writeback=False):
            assert torch.equal(holder.model(tokens), expected)
    gpt = fully_shard(GPT(TINY_GPT), {Block})  # fully_shard's module is the root: its own children are guarded
    with pytest.raises(
        RuntimeError, match="Linear `lm_head` was called on its own .* sharded unit it belongs to \\(GPT\\)"
    ):
        gpt.lm_head(torch.zeros(2, TINY_GPT.n_embd))
    gpt.blocks[0](torch.zeros(1, 4, TINY_GPT.n_embd))  # a unit of its own gathers itself


def test_a_submodule_called_outside_the_sharded_forward_is_refused_with_a_sentence() -> None:
    run_distributed(_call_submodules_outside_the_forward, 2)
