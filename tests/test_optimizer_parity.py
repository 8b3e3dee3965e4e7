"""Every optimizer trains what it trains unsharded: parity on real gloo ranks for optimizers that read whole tensors.

For Muon (fp32 Newton-Schulz, written in ``tests/optimizers.py``, and torch's own in bf16), Adafactor, LAMB, a Shampoo,
bitsandbytes' 8-bit AdamW and an optimizer defined here, the sharded model and the one-process reference train on the
same data from the same seed, under FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD, over shared memory, gloo and two
simulated hosts, at 2 and 4 ranks. Exact optimizers must agree to ``RTOL``; those that round on purpose (bf16
Newton-Schulz, 8-bit states) within twice the distance DDP's own all-reduce (NO_SHARD) lands from the reference.
Each run also checks what the layout promises: every tensor an optimizer reads whole is held by exactly one rank of
its shard group, which alone has its gradient and its state; one collective per unit per transition. Optimizers
that read across tensors are refused before the first step, leaving model and optimizer as they were.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import bitsandbytes
import pytest
import pytorch_optimizer
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn

from lightning_fsdp import (
    FabricFSDPStrategy,
    MixedPrecision,
    clip_grad_norm_,
    declare_update_scope,
    fully_shard,
    prepare_optimizer,
    summon_full_params,
)
from lightning_fsdp.checkpoint.full import full_optimizer_state
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from lightning_fsdp.engine.runtime.registry import fsdp_param_of, units_under
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.engine.transport import packing, shm
from lightning_fsdp.engine.transport.shm import SharedMemoryTransport
from tests.distributed import run_distributed
from tests.engine_harness import RTOL, TINY_GPT, data_moving, max_relative_error
from tests.optimizers import GlobalNormSGD, MuonFP32, NormalizedSGD, hidden_matrices

# Matrices of 4096 elements and more, where bitsandbytes keeps 8-bit states in blocks (smaller ones: 32-bit).
WIDE_GPT = GPTConfig(vocab_size=67, block_size=16, n_layer=2, n_head=2, n_embd=48, bias=True)
MUON_LR = 0.02


def _muon_fp32(model: nn.Module) -> list[torch.optim.Optimizer]:
    hidden, rest = hidden_matrices(model)
    return [MuonFP32(hidden, lr=MUON_LR), torch.optim.AdamW(rest, lr=1e-3, eps=1e-5)]


def _muon_torch(model: nn.Module) -> list[torch.optim.Optimizer]:
    hidden, rest = hidden_matrices(model)
    return [torch.optim.Muon(hidden, lr=MUON_LR), torch.optim.AdamW(rest, lr=1e-3, eps=1e-5)]


OPTIMIZERS: dict[str, Callable[[nn.Module], list[torch.optim.Optimizer]]] = {
    "muon_fp32": _muon_fp32,
    "muon_torch_bf16": _muon_torch,
    "adafactor": lambda m: [torch.optim.Adafactor(m.parameters(), lr=1e-2)],
    "lamb": lambda m: [pytorch_optimizer.Lamb(m.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-5)],
    "shampoo": lambda m: [pytorch_optimizer.Shampoo(m.parameters(), lr=1e-2)],
    "adamw_8bit": lambda m: [bitsandbytes.optim.AdamW8bit(m.parameters(), lr=1e-3, eps=1e-5)],
    "normalized_sgd": lambda m: [NormalizedSGD(m.parameters(), lr=1e-2)],
}
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass
class Case:
    optimizer: str
    shard: dict[str, Any] = field(default_factory=dict)
    config: GPTConfig = TINY_GPT
    shared_memory: bool = True
    hosts: int = 1  # simulated hosts (LIGHTNING_FSDP_HOST), the ranks of each in a row
    clip: float | None = None
    steps: int = 5

    def label(self) -> str:
        extras = [f"{k}={v}" for k, v in self.shard.items()]
        extras += ["gloo"] if not self.shared_memory else []
        extras += [f"{self.hosts} hosts"] if self.hosts > 1 else []
        extras += [f"clip={self.clip}"] if self.clip else []
        return f"{self.optimizer} {' '.join(extras)}".strip()


def _eight_bit_codes_differing(
    model: nn.Module, optimizer: torch.optim.Optimizer, reference: torch.optim.Optimizer
) -> float:
    """The fraction of bitsandbytes' block-wise 8-bit state codes that differ from the one-process run's (rank 0;
    0.0 elsewhere): the same blocks give the same codes but where the reduction's rounding moved a value across a
    code boundary, as it does for DDP."""
    full = full_optimizer_state(model, optimizer)
    ref_params = [p for group in reference.param_groups for p in group["params"]]
    worst = 0.0
    for index, state in full.get("state", {}).items():
        for key in ("state1", "state2"):
            if key in state and state[key].dtype == torch.uint8:
                expected = reference.state[ref_params[index]][key]
                assert state[key].shape == expected.shape, f"{key} of parameter {index}"
                worst = max(worst, (state[key] != expected).float().mean().item())
    return worst


class Trained(NamedTuple):
    error: float  # the largest relative difference of the weights from the one-process run's
    codes: float  # for 8-bit states: the fraction of codes that differ from the one-process run's
    optimizers: list[torch.optim.Optimizer]
    model: nn.Module


def _train(rank: int, world_size: int, case: Case) -> Trained:
    """Train the case sharded and unsharded, and compare."""
    os.environ[shm.ENV_SWITCH] = "1" if case.shared_memory else "0"
    os.environ["LIGHTNING_FSDP_HOST"] = f"simhost{rank * case.hosts // world_size}"
    torch.manual_seed(0)
    reference = GPT(case.config)
    model = fully_shard(copy.deepcopy(reference), {Block}, **case.shard)
    make = OPTIMIZERS[case.optimizer]
    optimizers, ref_optimizers = make(model), make(reference)
    data = torch.Generator().manual_seed(1)
    for _ in range(case.steps):
        tokens = torch.randint(0, case.config.vocab_size, (2 * world_size, case.config.block_size + 1), generator=data)
        local = slice(2 * rank, 2 * rank + 2)
        model(tokens[local, :-1], tokens[local, 1:]).backward()
        reference(tokens[:, :-1], tokens[:, 1:]).backward()
        if case.clip:
            norm = clip_grad_norm_(model.parameters(), case.clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), case.clip)
            assert abs(norm.item() - ref_norm.item()) <= RTOL * ref_norm.item(), f"[{case.label()}] norms differ"
        for optimizer in optimizers + ref_optimizers:
            optimizer.step()
            optimizer.zero_grad()
    codes = _eight_bit_codes_differing(model, optimizers[0], ref_optimizers[0]) if case.optimizer == "adamw_8bit" else 0
    with summon_full_params(model, writeback=False):
        error = max(
            max_relative_error(p.detach(), q.detach())
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        )
    return Trained(error, codes, optimizers, model)


def _check_held_once(model: nn.Module, optimizers: list[torch.optim.Optimizer], label: str) -> int:
    """Every parameter held whole lives on one rank of its shard group, which alone keeps optimizer state for it;
    a rank keeps state only for what it holds. Returns how many parameters are held whole."""
    whole = 0
    for name, param in model.named_parameters():
        fsdp_param = fsdp_param_of(param)
        if fsdp_param is None or fsdp_param.layout.world_size == 1:
            continue
        has_state = any(optimizer.state.get(param) for optimizer in optimizers)
        assert param.numel() or not has_state, f"[{label}] {name}: optimizer state on a rank that holds none of it"
        if fsdp_param.layout.owner is None:
            continue
        whole += 1
        held = torch.tensor([param.numel()])
        dist.all_reduce(held, group=fsdp_param.group)
        assert held.item() == fsdp_param.shape.numel(), f"[{label}] {name} is held {held.item()} elements in all"
        assert param.numel() in (0, fsdp_param.shape.numel()), f"[{label}] {name} is split: {tuple(param.shape)}"
    return whole


def _check_cases(rank: int, world_size: int, cases: list[Case]) -> None:
    ddp: dict[tuple[str, bool], Trained] = {}  # DDP's own distances, by optimizer and mixed precision
    for case in cases:
        trained = _train(rank, world_size, case)
        label = f"W={world_size} {case.label()}"
        key = (case.optimizer, "mixed_precision" in case.shard)
        if case.shard.get("sharding_strategy") == "NO_SHARD":
            ddp[key] = trained
            continue
        whole = _check_held_once(trained.model, trained.optimizers, label)
        assert whole > 0, f"[{label}] no parameter is held whole"
        bound = max(RTOL, 2 * ddp[key].error) if key in ddp else RTOL
        assert trained.error < bound, f"[{label}] relative error {trained.error:.2e} (bound {bound:.1e})"
        assert trained.codes <= max(1e-3, 2 * ddp[key].codes if key in ddp else 0), f"[{label}] 8-bit states differ"
        if "mixed_precision" in case.shard:
            assert all(p.dtype == torch.float32 for p in trained.model.parameters()), f"[{label}] masters not fp32"


def _rounding_baselines() -> list[Case]:
    """DDP's own distances (NO_SHARD all-reduces whole gradients) for the cases that round on purpose (bf16
    Newton-Schulz, 8-bit states, bf16 gathers) or amplify the sums' rounding (Shampoo's inverse roots)."""
    no_shard = {"sharding_strategy": "NO_SHARD"}
    return [
        Case("muon_torch_bf16", no_shard),
        Case("shampoo", no_shard),
        Case("adamw_8bit", no_shard, config=WIDE_GPT),
        Case("muon_fp32", {**no_shard, "mixed_precision": BF16}),
    ]


def test_two_ranks() -> None:
    cases = _rounding_baselines()
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        shard = {"sharding_strategy": strategy}
        cases += [Case(name, shard) for name in OPTIMIZERS if name != "adamw_8bit"]
        cases.append(Case("adamw_8bit", shard, config=WIDE_GPT))
    cases += [
        Case("muon_fp32", shared_memory=False),
        Case("adafactor", shared_memory=False),
        Case("muon_fp32", clip=0.05),
        Case("muon_fp32", {"cpu_offload": True}),
        Case("muon_fp32", {"mixed_precision": BF16}),
    ]
    run_distributed(_check_cases, 2, cases, timeout=400)


def test_four_ranks() -> None:
    hybrid = {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}
    cases = _rounding_baselines()
    cases += [Case(name) for name in ("muon_fp32", "adafactor", "lamb", "shampoo", "normalized_sgd")]
    cases += [Case("adamw_8bit", config=WIDE_GPT), Case("muon_torch_bf16")]
    cases += [Case(name, hybrid) for name in ("muon_fp32", "adafactor", "lamb")]
    cases += [Case("adamw_8bit", hybrid, config=WIDE_GPT)]
    cases += [Case("muon_fp32", hosts=2), Case("adafactor", hybrid, hosts=2), Case("muon_fp32", shared_memory=False)]
    run_distributed(_check_cases, 4, cases, timeout=500)


def _check_collectives_and_refusals(rank: int, world_size: int) -> None:
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=torch.Generator())
    batch = (tokens[:, :-1], tokens[:, 1:])
    counts = {}
    for name in ("muon_fp32", "adafactor"):
        torch.manual_seed(0)
        model = fully_shard(GPT(TINY_GPT), {Block})
        optimizers = OPTIMIZERS[name](model)
        for _ in range(3):  # the first step chooses the layout, the second the transports again
            with CollectiveCounter() as counter:
                model(*batch).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        counts[name] = data_moving(counter.counts)
        _check_gathers_pack_nothing(model, optimizers, batch)
    torch.manual_seed(0)
    plain = fully_shard(GPT(TINY_GPT), {Block})
    plain(*batch).backward()  # the first forward's lazy init has collectives of its own
    with CollectiveCounter() as counter:
        plain(*batch).backward()
    counts["plain"] = data_moving(counter.counts)
    assert counts["muon_fp32"] == counts["adafactor"] == counts["plain"], counts

    # Read across tensors: refused by name at the first step, nothing changed.
    for optimizer_class in (GlobalNormSGD, pytorch_optimizer.Prodigy):
        torch.manual_seed(0)
        model = fully_shard(GPT(TINY_GPT), {Block})
        optimizer = optimizer_class(model.parameters())
        model(*batch).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=rf"{optimizer_class.__name__} cannot train sharded parameters exactly"):
            optimizer.step()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert not optimizer.state
    # Declared element-wise (wrongly), Muon keeps its rows and trains another model: what the parity above catches.
    declare_update_scope(MuonFP32, "elementwise")  # this rank's process only
    trained = _train(rank, world_size, Case("muon_fp32"))
    assert trained.error > 1e-3, f"rows for Muon stayed within {trained.error:.1e} of the reference: a blind check"
    assert all(fsdp_param_of(p).layout.owner is None for p in trained.model.parameters())


def _check_gathers_pack_nothing(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """After the layout changed, shared memory is chosen again with homes for the new shards: each unit's segment of
    whole tensors lives there too, and no gather packs (see [Note: shards that live in shared memory])."""
    transport = units_under(model)[0].transport()
    assert isinstance(transport, SharedMemoryTransport) and transport.keeps_shards_at_home
    for unit in units_under(model):
        for whole in unit.wholes:
            assert whole.padded_shard.data_ptr() in {s.data_ptr() for home in transport.home_shards for s in home}
    packed: list[int] = []
    real_pack = packing.pack
    packing.pack = lambda tensors, out, start=0: (packed.append(out.numel()), real_pack(tensors, out, start))
    try:
        model(*batch).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    finally:
        packing.pack = real_pack
    assert packed == [], "a gather packed its shards"


def test_one_collective_per_unit_and_refusals_by_name() -> None:
    run_distributed(_check_collectives_and_refusals, 2)


def _check_prepared_before_any_step(rank: int, world_size: int) -> None:
    """A state loaded into the optimizer before its first step, in the rows it had then, cannot move: refused."""
    torch.manual_seed(0)
    model = fully_shard(GPT(TINY_GPT), {Block})
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    stale = copy.deepcopy(optimizer.state_dict())
    stale["state"] = {0: {"step": torch.tensor(1.0)}}
    optimizer.load_state_dict(stale)
    with pytest.raises(ValueError, match="already holds state for 'wte.weight' as this rank's rows"):
        prepare_optimizer(optimizer)


def test_state_loaded_in_rows_before_the_first_step_is_refused() -> None:
    run_distributed(_check_prepared_before_any_step, 2)


def _check_fabric(rank: int, world_size: int, folder: str) -> None:
    """``Fabric(strategy="myfsdp")``: Adafactor set up beside the model trains as in one process, and both checkpoint
    forms give weights and optimizer state back exactly."""
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world_size)})  # launched: ours
    for form in ("full", "sharded"):
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=FabricFSDPStrategy(state_dict_type=form))
        fabric.launch()
        torch.manual_seed(0)
        reference = GPT(TINY_GPT)
        net = copy.deepcopy(reference)
        model, optimizer = fabric.setup(net, torch.optim.Adafactor(net.parameters()))  # built before sharding
        ref_optimizer = torch.optim.Adafactor(reference.parameters())
        data = torch.Generator().manual_seed(1)
        for _ in range(3):
            tokens = torch.randint(0, TINY_GPT.vocab_size, (2 * world_size, 17), generator=data)
            local = slice(2 * rank, 2 * rank + 2)
            fabric.backward(model(tokens[local, :-1], tokens[local, 1:]))
            reference(tokens[:, :-1], tokens[:, 1:]).backward()
            for opt in (optimizer, ref_optimizer):
                opt.step()
                opt.zero_grad()
        weights = full_state_dict(model.module, rank0_only=False)
        for name, expected in reference.state_dict().items():
            assert max_relative_error(weights[name], expected) < RTOL, f"[fabric {form}] {name}"
        fabric.save(Path(folder) / form, {"model": model, "optimizer": optimizer})
        torch.manual_seed(1)
        other = fully_shard(GPT(TINY_GPT), {Block})  # sharded first, the optimizer built on its shards
        other, other_optimizer = fabric.setup(other, torch.optim.Adafactor(other.parameters()))
        fabric.load(Path(folder) / form, {"model": other, "optimizer": other_optimizer})
        loaded = full_state_dict(other.module, rank0_only=False)
        assert all(torch.equal(loaded[name], value) for name, value in weights.items()), f"[fabric {form}] weights"
        saved_state = full_optimizer_state(model.module, optimizer.optimizer)
        loaded_state = full_optimizer_state(other.module, other_optimizer.optimizer)
        if rank == 0:
            assert saved_state["state"].keys() == loaded_state["state"].keys()
            for index, state in saved_state["state"].items():
                assert all(torch.equal(loaded_state["state"][index][k], v) for k, v in state.items()), index


def test_fabric(tmp_path: Path) -> None:
    run_distributed(_check_fabric, 2, str(tmp_path))
