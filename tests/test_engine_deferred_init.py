"""Deferred init: a meta-device model materialised unit by unit equals the eager one, in bounded memory."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fsdp import fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.init.materialize import track_meta_build
from lightning_fsdp.engine.runtime.registry import fsdp_param_of
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT
from tests.init_models import NanoBlock, NanoGPT

DEEP = GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=64)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    with summon_full_params(model, writeback=False):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


def _assert_same_on_every_rank(state: dict[str, torch.Tensor], world_size: int) -> None:
    for name, tensor in state.items():
        gathered = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(gathered, tensor)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"ranks disagree on {name}"


def _check_meta_init(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    eager = GPT(TINY_GPT)
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        with torch.device("meta"):
            model = GPT(TINY_GPT)
        torch.manual_seed(0)  # every rank initialises the same values
        fully_shard(model, {Block}, sharding_strategy=strategy)
        leftovers = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        assert not leftovers, f"[{strategy}] still on the meta device: {leftovers}"
        assert model.wte.weight is model.lm_head.weight, "deferred init broke weight tying"
        state = _full_state(model)
        for name, param in eager.named_parameters():
            assert torch.equal(state[name], param.detach()), f"[{strategy}] {name} differs from the eager model"
        _assert_same_on_every_rank(state, world_size)
    # Different seeds on every rank: sync_module_states makes rank 0's values everyone's, for meta and eager models.
    for on_meta in (True, False):
        torch.manual_seed(rank)
        with torch.device("meta" if on_meta else "cpu"):
            model = GPT(TINY_GPT)
        torch.manual_seed(rank)
        fully_shard(model, {Block}, sync_module_states=True)
        state = _full_state(model)
        for name, param in eager.named_parameters():
            assert torch.equal(state[name], param.detach()), f"[meta={on_meta}] {name} is not rank 0's value"


def _check_peak_is_one_unit(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        model = GPT(DEEP)
    full_bytes_alive: list[int] = []

    def init_and_measure(module: nn.Module) -> None:
        module.reset_parameters()
        # Every materialised full-size parameter of the model right now (shards and meta tensors excluded).
        full = {id(p): p for p in model.parameters() if not p.is_meta and fsdp_param_of(p) is None}
        full_bytes_alive.append(sum(p.numel() * p.element_size() for p in full.values()))

    fully_shard(model, {Block}, param_init_fn=init_and_measure)
    block_bytes = sum(p.numel() * 4 for p in GPT(DEEP).blocks[0].parameters())
    root_bytes = sum(p.numel() * 4 for n, p in GPT(DEEP).named_parameters() if not n.startswith("blocks."))
    model_bytes = sum(p.numel() * 4 for p in GPT(DEEP).parameters())
    peak = max(full_bytes_alive)
    assert peak <= block_bytes + root_bytes, f"peak {peak} B > one block {block_bytes} B + root {root_bytes} B"
    assert model_bytes >= 4 * peak, f"the model ({model_bytes} B) is not several units; the check says nothing"


class _FullBytesAlive(TorchDispatchMode):
    """After every op: the bytes of the model's materialised full-size parameters (shards and meta excluded)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.samples: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        full = {id(p): p for p in self.model.parameters() if not p.is_meta and fsdp_param_of(p) is None}
        self.samples.append(sum(p.numel() * p.element_size() for p in full.values()))
        return out


def _check_replayed_init_sharded(rank: int, world_size: int) -> None:
    """nanoGPT's init (one apply() sweep, then every block's projections re-drawn by name at the very end) replayed
    unit by unit: the eager values on every rank, while the full tensors alive stay about one block plus the root."""
    torch.manual_seed(0)
    eager = NanoGPT(depth=8)
    with torch.device("meta"), track_meta_build():
        model = NanoGPT(depth=8)
    torch.manual_seed(0)
    with _FullBytesAlive(model) as alive:
        fully_shard(model, {NanoBlock})
    state = _full_state(model)
    for name, param in eager.named_parameters():
        assert torch.equal(state[name], param.detach()), f"{name} differs from the eager model"
    for name, buffer in eager.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), f"buffer {name} differs from the eager model"
    _assert_same_on_every_rank(state, world_size)
    block_bytes = sum(p.numel() * 4 for p in eager.blocks[0].parameters())
    root_bytes = sum(p.numel() * 4 for n, p in eager.named_parameters() if not n.startswith("blocks."))
    peak = max(alive.samples)
    assert peak <= block_bytes + root_bytes, f"peak {peak} B > one block {block_bytes} B + root {root_bytes} B"
    assert sum(p.numel() * 4 for p in eager.parameters()) >= 4 * peak, "the model is not several units"


class Raw(nn.Module):
    """A module with a parameter of its own and no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def _check_initializer_errors(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Raw())
    with pytest.raises(ValueError, match=r"module '1' \(Raw\) was built on the meta device but has no reset_param"):
        fully_shard(model)
    assert all(p.is_meta for p in model.parameters()), "the refused call materialised part of the model"
    fully_shard(model, param_init_fn=lambda m: [nn.init.ones_(p) for p in m.parameters(recurse=False)])
    with summon_full_params(model):
        assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())


def test_meta_init_equals_eager_on_every_rank_and_syncs_rank_zero() -> None:
    run_distributed(_check_meta_init, 2)


def test_deferred_init_peaks_at_one_unit_plus_shards() -> None:
    run_distributed(_check_peak_is_one_unit, 2)


def test_replayed_init_equals_eager_on_every_rank_and_peaks_at_one_unit_plus_shards() -> None:
    run_distributed(_check_replayed_init_sharded, 2)


def test_module_without_initializer_is_named_before_anything_is_materialised() -> None:
    run_distributed(_check_initializer_errors, 2)
