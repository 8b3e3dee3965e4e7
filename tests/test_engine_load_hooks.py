"""``model.load_state_dict(full_state_dict)`` and ``fabric.load_raw`` on a sharded model run the modules' own loading.

The model renames keys in its ``_load_from_state_dict`` as LitGPT's LoRA attention does (``qkv.weight`` ->
``qkv.linear.weight``), has a frozen base layer, a buffer and a tied pair of weights, and row counts that divide by
neither 2 nor 4. One spawned run per world size carries every claim:

- after ``fully_shard``, ``load_state_dict`` of a full state dict in the old names gives, gathered, bit for bit what
  the unsharded model loads, under every sharding strategy, CPU offload and bf16 mixed precision (the fp32 masters
  get the fp32 values); ``strict=False`` reports the same missing keys; training on from there matches the unsharded
  model to ~1e-5;
- a refusal changes nothing: torch's own error for missing and unexpected keys (after renaming), one sentence for a
  wrong full shape (a shard's shape included) and for ``assign=True``;
- LitGPT's own LoRA GPT takes its base GPT's state dict as the unsharded one does (``strict=False``);
- ``fabric.load_raw`` of such a file (strict and not) gives what ``Fabric(strategy="ddp")`` gives, weights and the
  next forward's loss; so does ``model.load_state_dict`` of Lightning's ``lazy_load`` of it (LitGPT's route), and
  ``load_raw`` still refuses to unpickle anything beyond plain data without the opt-in.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_fsdp.engine import MixedPrecision, fully_shard
from lightning_fsdp.engine.state.state_dict import full_state_dict
from tests.distributed import run_distributed
from tests.engine_harness import max_relative_error

WIDTH = 9  # qkv has 27 rows, the rest 9: no even split over 2 or 4 ranks
RTOL = 1e-5
BF16 = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, cast_forward_inputs=True)
RENAMED = {"qkv.weight": "qkv.linear.weight", "qkv.bias": "qkv.linear.bias"}


class LoRALinear(nn.Module):
    """A frozen base ``linear`` plus a trainable low-rank update, as LitGPT's ``LoRALinear``."""

    def __init__(self, n_in: int, n_out: int, rank: int = 2) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.linear.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, n_in) * 0.3)
        self.lora_B = nn.Parameter(torch.randn(n_out, rank) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) + x @ self.lora_A.T @ self.lora_B.T


class Attention(nn.Module):
    """Takes base checkpoints (``qkv`` a plain ``nn.Linear`` there) by renaming their keys on load, as LitGPT does."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = LoRALinear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(torch.tanh(self.qkv(x)))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for old, new in RENAMED.items():
            if prefix + old in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = Attention()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.out.weight = self.inp.weight  # tied
        self.head = nn.Linear(WIDTH, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        x = self.inp(x * self.scale)
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(self.out(x)), y)


class Opaque:
    """Not plain data: unpickling it needs the user's trust."""


def base_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` in the names of a checkpoint saved before ``qkv`` became a LoRA layer (what the renaming takes)."""
    renamed = {}
    for key, value in state.items():
        for old, new in RENAMED.items():
            if key.endswith(new):
                key = key.removesuffix(new) + old
        renamed[key] = value
    return renamed


def source_state() -> dict[str, Tensor]:
    """A full checkpoint in the old names, with values no fresh build has."""
    torch.manual_seed(42)
    return base_names({key: value.clone() for key, value in Net().state_dict().items()})


def fresh(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def unsharded_load(state: dict[str, Tensor], strict: bool = True) -> tuple[Net, Any]:
    reference = fresh()
    return reference, reference.load_state_dict(state, strict=strict)


def assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor], label: str) -> None:
    assert actual.keys() == expected.keys(), f"[{label}] {sorted(actual.keys() ^ expected.keys())}"
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, f"[{label}] {name}: {actual[name].dtype} != {value.dtype}"
        assert torch.equal(actual[name], value), f"[{label}] {name} differs"


def check_loads_like_unsharded(rank: int, world_size: int, label: str, **shard: Any) -> None:
    """Load, compare gathered values bit for bit, then train three steps beside the unsharded model."""
    state = source_state()
    reference, _ = unsharded_load(state)
    model = fully_shard(fresh(), {Block}, **shard)
    inputs, targets = torch.randn(4 * world_size, WIDTH), torch.randn(4 * world_size, 5)
    with torch.no_grad():  # a forward first: loading must not depend on the model never having run
        model(inputs[:4], targets[:4])
    model.load_state_dict(state)
    expected = reference.state_dict()
    if shard.get("mixed_precision") is not None:  # the buffer is kept in buffer_dtype, the masters in fp32
        expected["scale"] = expected["scale"].to(shard["mixed_precision"].buffer_dtype)
    assert_same(full_state_dict(model, rank0_only=False), expected, label)
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, f"[{label}] {name} is {param.dtype}: the masters stay fp32"

    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(trainable(reference), lr=1e-2)
    data = torch.Generator().manual_seed(7)
    for _ in range(3):
        inputs, targets = (
            torch.randn(4 * world_size, WIDTH, generator=data),
            torch.randn(4 * world_size, 5, generator=data),
        )
        local = slice(4 * rank, 4 * (rank + 1))
        model(inputs[local], targets[local]).backward()
        reference(inputs, targets).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    if shard.get("mixed_precision") is not None:
        return  # bf16 compute: the values above are the claim, not fp32 parity
    trained, expected = full_state_dict(model, rank0_only=False), reference.state_dict()
    for name, value in expected.items():
        error = max_relative_error(trained[name], value)
        assert error < RTOL, f"[{label}] {name}: relative error {error:.2e} after training on from the load"


def check_partial_and_refused_loads(rank: int, world_size: int) -> None:
    state = source_state()
    model = fully_shard(fresh(), {Block})
    before = full_state_dict(model, rank0_only=False)

    # strict=False: a base checkpoint without the LoRA weights; the same missing keys as the unsharded model reports.
    base = {key: value for key, value in state.items() if "lora_" not in key}
    reference, expected_keys = unsharded_load(base, strict=False)
    keys = model.load_state_dict(base, strict=False)
    assert sorted(keys.missing_keys) == sorted(expected_keys.missing_keys) != []
    assert keys.unexpected_keys == expected_keys.unexpected_keys == []
    assert_same(full_state_dict(model, rank0_only=False), reference.state_dict(), "strict=False")

    # Refusals: torch's own errors for keys (as the unsharded model raises them), one sentence for the rest; nothing
    # changes, not even the tensors a refused load reached first.
    model = fully_shard(fresh(), {Block})
    shard_shape = tuple(model.blocks[0].attn.qkv.linear.weight.shape)
    assert shard_shape != (3 * WIDTH, WIDTH)
    refused = [
        (base, RuntimeError, r'Missing key\(s\) in state_dict: .*"blocks\.0\.attn\.qkv\.lora_A"'),
        ({**state, "blocks.1.attn.qkv.gate": torch.ones(1)}, RuntimeError, r'Unexpected key\(s\).*qkv\.gate"'),
        (
            {**state, "blocks.1.attn.qkv.weight": torch.zeros(shard_shape)},  # this rank's rows: not a full state dict
            ValueError,
            r"^load_state_dict into the sharded model was refused and nothing was loaded: 'blocks\.1\.attn\.qkv\."
            r"linear\.weight' has shape \(\d+, 9\) in the state dict but \(27, 9\) in the model\. Pass a full",
        ),
        ({**state, "scale": torch.ones(3)}, ValueError, r"'scale' has shape \(3,\) in the state dict but \(9,\)"),
    ]
    before = full_state_dict(model, rank0_only=False)
    for bad, error, message in refused:
        with pytest.raises(error, match=message) as raised:
            model.load_state_dict(bad)
        if error is RuntimeError:  # exactly what the unsharded model says
            with pytest.raises(RuntimeError) as unsharded:
                fresh().load_state_dict(bad)
            assert str(raised.value) == str(unsharded.value)
        else:
            assert "\n" not in str(raised.value)
        assert_same(full_state_dict(model, rank0_only=False), before, f"refused {message[:30]}")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a module's own loading code failed")

    model.blocks[1].attn._load_from_state_dict = broken  # raises after blocks.0 was reached: still nothing changes
    with pytest.raises(RuntimeError, match="own loading code failed"):
        model.load_state_dict(state)
    del model.blocks[1].attn._load_from_state_dict
    assert_same(full_state_dict(model, rank0_only=False), before, "a module's loading code raised")
    with pytest.raises(ValueError, match=r"assign=True\) would replace Net's sharded parameters"):
        model.load_state_dict(state, assign=True)
    assert_same(full_state_dict(model, rank0_only=False), before, "refused assign=True")
    model.load_state_dict(state)  # and a good load afterwards still works
    assert_same(full_state_dict(model, rank0_only=False), unsharded_load(state)[0].state_dict(), "after refusals")


def check_fabric_load_raw(rank: int, world_size: int, out: Path) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.load import _lazy_load as lazy_load

    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world_size)})
    state = source_state()
    files = {"full": out / "full.pt", "base": out / "base.pt", "opaque": out / "opaque.pt"}
    if rank == 0:
        torch.save(state, files["full"])
        torch.save({key: value for key, value in state.items() if "lora_" not in key}, files["base"])
        torch.save({**state, "note": Opaque()}, files["opaque"])
    dist.barrier()
    loaded, losses = {}, {}
    batch = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(3)), torch.zeros(4, 5)
    for name in ("ddp", "myfsdp"):
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=name)
        fabric.launch()  # the ranks exist already: the test's process group
        for file, strict in (("full", True), ("base", False)):
            model = fabric.setup(fresh())
            fabric.load_raw(files[file], model, strict=strict)
            plain = {key: value.detach().clone() for key, value in model.module.state_dict().items()}
            loaded[name, file] = full_state_dict(model.module, rank0_only=False) if name == "myfsdp" else plain
            with torch.no_grad():  # the first forward (the root's lazy init and its checks) after the load
                losses[name, file] = model(*batch).item()
        if name == "myfsdp":
            model = fabric.setup(fresh())
            model.load_state_dict(lazy_load(files["full"]))  # LitGPT's load_checkpoint under other strategies
            assert_same(full_state_dict(model.module, rank0_only=False), loaded["ddp", "full"], "lazy_load")
            model = fabric.setup(fresh())
            before = full_state_dict(model.module, rank0_only=False)
            with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
                fabric.load_raw(files["opaque"], model)
            assert_same(full_state_dict(model.module, rank0_only=False), before, "refused opaque file")
    assert_same(loaded["myfsdp", "full"], unsharded_load(state)[0].state_dict(), "load_raw strict")
    for file in ("full", "base"):
        assert_same(loaded["myfsdp", file], loaded["ddp", file], f"load_raw {file} against ddp")
        assert abs(losses["myfsdp", file] - losses["ddp", file]) <= RTOL * abs(losses["ddp", file])


def check_litgpt_lora(rank: int, world_size: int) -> None:
    """LitGPT's own LoRA GPT takes its base GPT's state dict (``qkv``, ``proj``, ``fc``, ``lm_head`` renamed)."""
    import litgpt
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.lora import Block as LoRABlock
    from litgpt.lora import Config as LoRAConfig

    sizes = {"n_layer": 2, "n_head": 2, "n_embd": 18, "block_size": 16, "vocab_size": 61, "padded_vocab_size": 61}
    lora = {"lora_r": 2, "lora_alpha": 4, **dict.fromkeys(("lora_query", "lora_value", "lora_projection"), True)}
    torch.manual_seed(1)
    base = litgpt.GPT(litgpt.Config(**sizes)).state_dict()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return LoRAGPT(LoRAConfig(**sizes, **lora, lora_mlp=True, lora_head=True))

    reference = build()
    expected_keys = reference.load_state_dict(base, strict=False)
    model = fully_shard(build(), {LoRABlock})
    keys = model.load_state_dict(base, strict=False)
    assert keys.missing_keys == expected_keys.missing_keys and all("lora_" in k for k in keys.missing_keys)
    assert keys.unexpected_keys == expected_keys.unexpected_keys == []
    assert_same(full_state_dict(model, rank0_only=False), reference.state_dict(), "LitGPT LoRA")
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=RTOL, atol=1e-6)


def two_ranks(rank: int, world_size: int, out: str) -> None:
    check_loads_like_unsharded(rank, world_size, "FULL_SHARD")
    check_loads_like_unsharded(rank, world_size, "SHARD_GRAD_OP", sharding_strategy="SHARD_GRAD_OP")
    check_loads_like_unsharded(rank, world_size, "NO_SHARD", sharding_strategy="NO_SHARD")
    check_loads_like_unsharded(rank, world_size, "cpu_offload", cpu_offload=True)
    check_loads_like_unsharded(rank, world_size, "bf16", mixed_precision=BF16)
    check_partial_and_refused_loads(rank, world_size)
    check_litgpt_lora(rank, world_size)
    check_fabric_load_raw(rank, world_size, Path(out))


def four_ranks(rank: int, world_size: int) -> None:
    check_loads_like_unsharded(rank, world_size, "FULL_SHARD")
    check_loads_like_unsharded(rank, world_size, "HYBRID_SHARD", sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))


def test_load_hooks_two_ranks(tmp_path: Path) -> None:
    run_distributed(two_ranks, 2, str(tmp_path), timeout=240)


def test_load_hooks_four_ranks() -> None:
    run_distributed(four_ranks, 4, timeout=180)
