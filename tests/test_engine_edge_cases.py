"""The cases real models hit: shared parameters, re-entered and unused units, odd shapes, eval, full parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp import fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.runtime.registry import fsdp_param_of, unit_of, units_under
from lightning_fsdp.engine.runtime.unit import ShardState, TrainingState
from tests.distributed import run_distributed
from tests.engine_harness import RTOL, TINY_GPT, Run, max_relative_error, run_parity

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
WIDTH = 12


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class HalfUsedLayer(nn.Module):
    """A unit that runs every step but one of whose parameters never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(WIDTH, WIDTH)
        self.spare = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class Awkward(nn.Module):
    """Every awkward case at once, for W=4.

    ``repeat`` runs twice per forward; ``ignored`` runs but its output is dropped; ``never`` does not run;
    ``partly`` has an unused parameter; ``scale`` is 0-dim; ``tiny`` has 3 rows (rank 3 of 4 holds none);
    ``inp`` has 12 rows of 8 and ``out`` 5 rows (neither divisible by 4); ``offset`` is a buffer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.repeat = Layer()
        self.ignored = Layer()
        self.never = Layer()
        self.partly = HalfUsedLayer()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.tiny = nn.Parameter(torch.randn(3, WIDTH) * 0.1)
        self.out = nn.Linear(WIDTH, 5)
        self.register_buffer("offset", torch.randn(WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.repeat(self.repeat(self.inp(x)))
        self.ignored(h)
        h = self.partly(h) * self.scale + self.offset
        h = h + (h @ self.tiny.t()).sum(dim=-1, keepdim=True)
        return self.out(h)


def _batch(step: int, world_size: int) -> torch.Tensor:
    return torch.randn(3 * world_size, 8, generator=torch.Generator().manual_seed(step))


def _check_awkward_model(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        reference = Awkward()
        model = fully_shard(copy.deepcopy(reference), {Layer, HalfUsedLayer}, sharding_strategy=strategy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
        for step in range(4):
            x = _batch(step, world_size)
            model(x[rank * 3 : (rank + 1) * 3]).pow(2).mean().backward()
            reference(x).pow(2).mean().backward()
            for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
                # A rank that holds no element of a parameter (a 1-row one on 4 ranks) gives it no gradient.
                expected = ref_param.grad is None or param.numel() == 0
                assert (param.grad is None) == expected, f"[{strategy}] {name}: grad presence differs"
            optimizer.step()
            ref_optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.zero_grad()
            with torch.no_grad():  # an evaluation forward between steps gives the reference's output
                error = max_relative_error(model(x)[rank * 3 : (rank + 1) * 3], reference(x)[rank * 3 : (rank + 1) * 3])
            assert error < RTOL, f"[{strategy}] no_grad forward differs from the reference by {error:.2e}"
            gathered = [unit for unit in units_under(model) if any(p.is_unsharded_allocated for p in unit.params)]
            assert not gathered, f"[{strategy}] {gathered} left gathered after a no_grad forward"
            assert all(u.training_state is TrainingState.IDLE for u in units_under(model))
        assert torch.equal(model.offset, reference.offset), "buffers are not the engine's to touch"
        with summon_full_params(model, writeback=False):
            for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
                error = max_relative_error(param.detach(), ref_param.detach())
                assert error < RTOL, f"[{strategy}] {name}: relative error {error:.2e} after training"
        if strategy != "NO_SHARD":
            _check_shard_shapes(model, reference, rank, world_size)


def _check_shard_shapes(model: nn.Module, reference: nn.Module, rank: int, world_size: int) -> None:
    """``model.parameters()`` are the shards: rows [r*c, (r+1)*c), some empty, and together the whole model."""
    local = dict(model.named_parameters())
    assert local["tiny"].shape == ((1 if rank < 3 else 0), WIDTH), f"rank {rank}: tiny is {tuple(local['tiny'].shape)}"
    assert local["scale"].shape == ((1 if rank == 0 else 0),), f"rank {rank}: scale is {tuple(local['scale'].shape)}"
    assert local["out.weight"].shape == ((2 if rank < 2 else 1 if rank == 2 else 0), WIDTH)
    total = torch.tensor(sum(p.numel() for p in model.parameters()))
    dist.all_reduce(total)
    assert total.item() == sum(p.numel() for p in reference.parameters())


def _check_tied_and_nested_units(rank: int, world_size: int) -> None:
    # The embedding and every Linear (inside blocks too) are units of their own; the head's weight is the
    # embedding's, so it belongs to their common ancestor -- the root -- and stays one parameter.
    policy = {Block, nn.Embedding, nn.Linear}
    model = fully_shard(GPT(TINY_GPT), policy)
    assert model.wte.weight is model.lm_head.weight, "weight tying was broken by sharding"
    assert unit_of(model.wte) is None and unit_of(model.lm_head) is None, "a unit owns a parameter shared outside it"
    assert fsdp_param_of(model.wte.weight).owners == [(model.wte, "weight"), (model.lm_head, "weight")]
    assert unit_of(model.blocks[0].attn.qkv) is not None, "nested units inside a block were not formed"
    for strategy in STRATEGIES:
        run_parity(rank, world_size, Run(shard={"policy": policy, "sharding_strategy": strategy}, steps=3))


def _check_summon_full_params(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = GPT(TINY_GPT)
    model = fully_shard(copy.deepcopy(reference), {Block})
    with summon_full_params(model), torch.no_grad():
        assert model.blocks[1].mlp.fc.weight.shape == reference.blocks[1].mlp.fc.weight.shape
        assert torch.equal(model.blocks[1].mlp.fc.weight, reference.blocks[1].mlp.fc.weight)
        model.blocks[1].mlp.fc.weight.mul_(0.5)  # an edit that must stick
    with summon_full_params(model, writeback=False), torch.no_grad():
        assert torch.equal(model.blocks[1].mlp.fc.weight, reference.blocks[1].mlp.fc.weight * 0.5)
        model.blocks[1].mlp.fc.weight.zero_()  # an edit that must not
    with summon_full_params(model):
        assert torch.equal(model.blocks[1].mlp.fc.weight, reference.blocks[1].mlp.fc.weight * 0.5)
        full_state = {k: v.clone() for k, v in model.state_dict().items()}
    assert full_state.keys() == reference.state_dict().keys()
    assert model.blocks[1].mlp.fc.weight.shape[0] < reference.blocks[1].mlp.fc.weight.shape[0], "shards again"


def _check_ignored_modules_and_params(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    ignored_block, ignored_param = model.blocks[0], model.ln_f.weight
    fully_shard(model, {Block}, ignored_modules=[ignored_block], ignored_params=[ignored_param])
    torch.manual_seed(0)
    reference = GPT(TINY_GPT)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        untouched = name.startswith("blocks.0.") or name == "ln_f.weight"
        assert (fsdp_param_of(param) is None) == untouched, f"{name}: ignored={untouched} but sharded={not untouched}"
        if untouched:
            assert torch.equal(param, ref_param), f"{name} was changed although ignored"
    assert unit_of(ignored_block) is None, "an ignored module became a unit"
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    reference(tokens[:, :-1], tokens[:, 1:]).backward()
    torch.testing.assert_close(ignored_param.grad, reference.ln_f.weight.grad, msg="ignored: local, unreduced")


def test_ignored_modules_and_params_stay_whole() -> None:
    run_distributed(_check_ignored_modules_and_params, 2)


def test_awkward_model_parity_and_shapes_on_four_ranks() -> None:
    run_distributed(_check_awkward_model, 4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tied_weights_and_nested_units(world_size: int) -> None:
    run_distributed(_check_tied_and_nested_units, world_size)


def test_summon_full_params_reads_and_writes_back() -> None:
    run_distributed(_check_summon_full_params, 2)


class TwoBackwardsPerForward(nn.Module):
    """A root whose forward runs backward itself, twice: Lightning's training_step under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(TINY_GPT)

    def forward(self, batches: list[torch.Tensor]) -> torch.Tensor:
        losses = []
        for tokens in batches:
            loss = self.model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses)


def _check_backward_inside_forward(rank: int, world_size: int) -> None:
    # With {Block} the root owns the embeddings; with no policy the root is the only unit, so no unit's output
    # hook announces the backward at all.
    for strategy, policy in [(s, {Block}) for s in STRATEGIES] + [("FULL_SHARD", None)]:
        torch.manual_seed(0)
        reference = GPT(TINY_GPT)
        root = fully_shard(TwoBackwardsPerForward(), policy, sharding_strategy=strategy)
        with torch.no_grad(), summon_full_params(root):
            root.model.load_state_dict(reference.state_dict())
        optimizer = torch.optim.SGD(root.parameters(), lr=0.1)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(2):
            same_on_every_rank = torch.Generator().manual_seed(step)
            shape = (2, TINY_GPT.block_size + 1)
            batches = [torch.randint(0, TINY_GPT.vocab_size, shape, generator=same_on_every_rank) for _ in range(2)]
            root(batches)
            for tokens in batches:
                reference(tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            ref_optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.zero_grad()
        with summon_full_params(root, writeback=False):
            for (name, param), ref_param in zip(root.model.named_parameters(), reference.parameters(), strict=True):
                error = max_relative_error(param.detach(), ref_param.detach())
                assert error < RTOL, f"[{strategy}] {name}: relative error {error:.2e}"


class StepAsForward(nn.Module):
    """A root whose forward is re-entered: the strategy runs a LightningModule's training_step as the root's forward,
    and the step calls the module's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(TINY_GPT)
        self.as_step = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.as_step:
            self.as_step = False
            return self(tokens)
        return self.model(tokens[:, :-1], tokens[:, 1:])


def _check_reentered_and_raising_forwards(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = GPT(TINY_GPT)
    root = fully_shard(StepAsForward(), {Block})
    with torch.no_grad(), summon_full_params(root):
        root.model.load_state_dict(reference.state_dict())
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (root, reference))
    for step in range(3):
        tokens = torch.randint(
            0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=torch.Generator().manual_seed(step)
        )
        root.as_step = True
        root(tokens).backward()
        reference(tokens[:, :-1], tokens[:, 1:]).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        if step == 0:
            # A forward that raises after the blocks ran (an out-of-range target, as out-of-memory would), caught by
            # the caller: every unit ends its forward resharded, and training goes on.
            with pytest.raises(IndexError):
                root(
                    torch.full_like(tokens, TINY_GPT.vocab_size - 1).index_fill_(
                        1, torch.tensor([TINY_GPT.block_size]), TINY_GPT.vocab_size
                    )
                )
            for unit in units_under(root):
                assert unit.training_state is TrainingState.IDLE and not unit.in_forward, unit
                assert unit.shard_state is ShardState.SHARDED, unit
    with summon_full_params(root, writeback=False):
        for (name, param), ref_param in zip(root.model.named_parameters(), reference.parameters(), strict=True):
            error = max_relative_error(param.detach(), ref_param.detach())
            assert error < RTOL, f"[re-entered forward] {name}: relative error {error:.2e}"


def _check_forwards_inside_and_around_backward(rank: int, world_size: int) -> None:
    _check_backward_inside_forward(rank, world_size)
    _check_reentered_and_raising_forwards(rank, world_size)


def test_backward_inside_the_root_forward_keeps_it_gathered_and_forwards_may_nest_or_raise() -> None:
    run_distributed(_check_forwards_inside_and_around_backward, 2)
