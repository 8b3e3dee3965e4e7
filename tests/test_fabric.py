"""``Fabric(strategy="myfsdp")``: a hand-written Fabric loop on the engine, against ``Fabric(strategy="ddp")``.

One spawned run per world size carries every claim:

- parity: the same model, data and seed trained for three steps (one of them two micro-batches under
  ``fabric.no_backward_sync``, every step clipped with ``fabric.clip_gradients``) give ddp's losses, gradient norms
  and weights to ~1e-5 relative, for every sharding strategy and the registered names; on the tiny GPT (tied
  embedding) and on a float-input model with a buffer computed at init and a frozen first block;
- checkpoints (2 ranks): ``fabric.save``/``fabric.load`` round trips in both forms resume exactly; the full file has
  Fabric's layout (``ckpt["model"]`` a plain state dict ``weights_only`` reads), the older layout still loads,
  ``convert`` reads it; a Trainer's
  checkpoints load in Fabric and Fabric's in a Trainer; ``fabric.load_raw`` takes ddp's plain state dicts;
  ``filter=``; ``init_module(empty_init=True)``; precision plugins; refusals that leave model, optimizer and files
  as they were; and examples/fabric_loop.py's loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_fsdp  # noqa: F401  (registers the strategy names)
from lightning_fsdp import FabricFSDPPrecision, FabricFSDPStrategy, FSDPStrategy, ShardedGradScaler
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import full_optimizer_state
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.state.state_dict import full_state_dict
from tests.distributed import run_distributed

# Dims that divide by neither 2 nor 4 (61 rows, 18-wide rows), as in the engine's parity tests.
TINY = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=18, bias=True)
OTHER = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=14, bias=True)
RTOL, ATOL = 1e-5, 1e-6
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fabric_loop.py"


class TinyLit(L.LightningModule):
    """The demo GPT as a LightningModule, so that a Trainer and Fabric save and load the same parameter names."""

    def __init__(self, config: GPTConfig = TINY) -> None:
        super().__init__()
        self.model = GPT(config)

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return self.model(inputs, targets)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(batch[:, :-1], batch[:, 1:])

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.model(batch[:, :-1], batch[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self)


class FloatBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x))


class FloatNet(nn.Module):
    """Float inputs, a buffer computed at init, and a frozen first block (LoRA-style partly frozen units)."""

    def __init__(self, width: int = 18) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FloatBlock(width) for _ in range(3))
        self.head = nn.Linear(width, 7)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.blocks[0].requires_grad_(False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x), y)


class Opaque:
    """Not plain data: unpickling it needs the user's trust."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-5, weight_decay=0.1)


def gpt_batches(rank: int, steps: int = 3) -> list[list[tuple[Tensor, Tensor]]]:
    """Per step, this rank's micro-batches (the second step has two): different data on every rank."""
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, TINY.vocab_size, (max(steps + 1, 3), 3, TINY.block_size + 1), generator=generator)
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens]
    return [[micro[0]], [micro[1], micro[2]], *[[m] for m in micro[3:]]][:steps]


def float_batches(rank: int) -> list[list[tuple[Tensor, Tensor]]]:
    generator = torch.Generator().manual_seed(2000 + rank)
    pairs = [(torch.randn(4, 18, generator=generator), torch.randn(4, 7, generator=generator)) for _ in range(4)]
    return [[pairs[0]], [pairs[1], pairs[2]], [pairs[3]]]


def launch(strategy: Any, world_size: int, **kwargs: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, **kwargs)
    fabric.launch()  # the ranks exist already (LOCAL_RANK is set): no new processes, the test's process group
    return fabric


def train(
    fabric: Fabric, build: Callable[[], nn.Module], batches: list, separate: bool = False
) -> tuple[list[float], list[float], Any]:
    """Seeded build, setup (joint, or ``separate``: the module, then an optimizer of its shards), the loop; returns
    losses, clip norms and the set-up model and optimizer."""
    torch.manual_seed(0)
    model = build()
    if separate:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(adamw(model))
    else:
        model, optimizer = fabric.setup(model, adamw(model))
    losses, norms = [], []
    for micro_batches in batches:
        for index, (inputs, targets) in enumerate(micro_batches):
            with fabric.no_backward_sync(model, enabled=index < len(micro_batches) - 1):
                loss = model(inputs, targets) / len(micro_batches)
                fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.05).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="sum").item())
    return losses, norms, (model, optimizer)


def weights(model: nn.Module) -> dict[str, Tensor]:
    """Full weights on every rank: gathered from the shards, or ddp's own (the same on every rank)."""
    return full_state_dict(getattr(model, "module", model), rank0_only=False)


def optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The full optimizer state (rank 0; {} elsewhere): a collective."""
    return full_optimizer_state(getattr(model, "module", model), getattr(optimizer, "optimizer", optimizer))


def assert_same_optimizer_state(actual: dict[str, Any], expected: dict[str, Any], exact: bool = True) -> None:
    assert actual.keys() == expected.keys()
    if not actual:
        return
    assert actual["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(actual["state"][index][key], value, rtol=0 if exact else RTOL, atol=0)


def check_parity(world_size: int, rank: int, gpt_strategies: list[Any], float_strategies: list[Any]) -> None:
    cases = [
        ("the tiny GPT", TinyLit, gpt_batches(rank), gpt_strategies),
        ("FloatNet", FloatNet, float_batches(rank), float_strategies),
    ]
    for model_name, build, batches, strategies in cases:
        ddp_losses, ddp_norms, (ddp_model, _) = train(launch("ddp", world_size), build, batches)
        expected = weights(ddp_model)
        for strategy in strategies:
            label = f"{strategy!r} on {model_name}"
            separate = build is FloatNet  # the other order of setting up: setup_module, then setup_optimizers
            losses, norms, (model, _) = train(launch(strategy, world_size), build, batches, separate)
            assert_close(losses, ddp_losses, f"{label}: losses")
            assert_close(norms, ddp_norms, f"{label}: clip norms")
            got = weights(model)
            assert got.keys() == expected.keys(), label
            for name, value in expected.items():
                assert_close(got[name], value, f"{label}: {name}")
        assert ddp_norms[0] > 0.05, "clipping must change the run for the norm to be tested"


def four_ranks(rank: int, world_size: int) -> None:
    _as_launched_rank(rank, world_size)
    hybrid = {"device_mesh": (2, 2), "auto_wrap_policy": {Block, FloatBlock}}
    check_parity(
        world_size,
        rank,
        [
            "myfsdp",
            FabricFSDPStrategy(sharding_strategy="SHARD_GRAD_OP"),
            FabricFSDPStrategy(sharding_strategy="NO_SHARD"),
            FabricFSDPStrategy(sharding_strategy="HYBRID_SHARD", **hybrid),
            FabricFSDPStrategy(sharding_strategy="_HYBRID_SHARD_ZERO2", **hybrid),
        ],
        ["myfsdp"],
    )


def two_ranks(rank: int, world_size: int, tmp: str) -> None:
    _as_launched_rank(rank, world_size)
    check_parity(
        world_size,
        rank,
        ["myfsdp", "myfsdp_shard_grad_op", "myfsdp_cpu_offload"],
        [FabricFSDPStrategy(auto_wrap_policy={FloatBlock}, sharding_strategy="SHARD_GRAD_OP")],
    )
    out = Path(tmp)
    saved = check_round_trips(world_size, out)
    check_trainer_interop(world_size, out, saved)
    check_plain_state_dicts(world_size, rank, out)
    check_filter_and_refusals(world_size, out)
    check_empty_init(world_size, out)
    check_precisions(world_size, rank)
    check_example(world_size, out)


def check_round_trips(world_size: int, out: Path) -> dict[str, Tensor]:
    """Save after two steps, load into a differently seeded model: one more step on each gives the same weights."""
    saved: dict[str, Tensor] = {}
    for form in ("full", "sharded"):
        fabric = launch(FabricFSDPStrategy(state_dict_type=form), world_size)
        _, _, (model, optimizer) = train(fabric, TinyLit, gpt_batches(fabric.global_rank, steps=2))
        fabric.save(out / f"fabric-{form}", {"model": model, "optimizer": optimizer, "step": 2, "note": "kept"})
        saved = weights(model)
        torch.manual_seed(1)
        other = TinyLit()
        other, other_optimizer = fabric.setup(other, adamw(other))
        state = {"model": other, "optimizer": other_optimizer, "step": 0}
        remainder = fabric.load(out / f"fabric-{form}", state)
        assert state["step"] == 2 and remainder == {"note": "kept"}, (form, state["step"], remainder)
        _assert_weights(weights(other), saved, form)
        assert_same_optimizer_state(optimizer_state(other, other_optimizer), optimizer_state(model, optimizer))
        for net, opt in ((model, optimizer), (other, other_optimizer)):
            inputs, targets = gpt_batches(fabric.global_rank)[2][0]
            fabric.backward(net(inputs, targets))
            opt.step()
        _assert_weights(weights(other), weights(model), f"{form}: the step after loading")
    assert (out / "fabric-full").is_file() and (out / "fabric-sharded" / "meta.pt").is_file()
    check_fabric_layout(world_size, out)
    return saved


def check_fabric_layout(world_size: int, out: Path) -> None:
    """The full file has Fabric's layout: the user's keys hold plain full state dicts (weights_only reads them, an
    unsharded model and optimizer take them); a file of the older layout (the Trainer's keys) still loads."""
    fabric = launch(FabricFSDPStrategy(state_dict_type="full"), world_size)
    _, _, (model, optimizer) = train(fabric, TinyLit, gpt_batches(fabric.global_rank, steps=2))
    fabric.save(out / "layout.ckpt", {"model": model, "optimizer": optimizer, "iter_num": 2})
    expected_model, expected_optimizer = weights(model), optimizer_state(model, optimizer)
    ckpt = torch.load(out / "layout.ckpt", weights_only=True)
    assert set(ckpt) == {"model", "optimizer", "iter_num", "_lightning_fsdp"}, sorted(ckpt)
    assert ckpt["iter_num"] == 2
    _assert_weights(ckpt["model"], expected_model, "ckpt['model']")
    unsharded = TinyLit()
    unsharded.load_state_dict(ckpt["model"])  # strict: a plain state dict of the unsharded model
    names = [name for group in expected_optimizer.get("param_groups", []) for name in group["param_names"]]
    if fabric.global_rank == 0:  # keyed by name, as Lightning's Fabric FSDP writes it
        assert [n for g in ckpt["optimizer"]["param_groups"] for n in g["params"]] == names
        for index, state in expected_optimizer["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(ckpt["optimizer"]["state"][names[index]][key], value, rtol=0, atol=0)
        plain = adamw(unsharded)
        plain.load_state_dict(ckpt["optimizer"])  # torch matches by position: the unsharded optimizer takes it
        assert len(plain.state) == len(expected_optimizer["state"])

    # The older layout: the Trainer's keys and our record under "lightning_fsdp".
    old = {
        "state_dict": ckpt["model"],
        "optimizer_states": [expected_optimizer],
        "iter_num": 2,
        "lightning_fsdp": {"fabric": {"module": "model", "optimizers": ["optimizer"]}},
        "pytorch-lightning_version": L.__version__,
    }
    if fabric.global_rank == 0:
        torch.save(old, out / "old-layout.ckpt")
    fabric.barrier()
    for name in ("layout.ckpt", "old-layout.ckpt"):
        torch.manual_seed(11)
        fresh = TinyLit()
        fresh, fresh_optimizer = fabric.setup(fresh, adamw(fresh))
        state = {"model": fresh, "optimizer": fresh_optimizer, "iter_num": 0}
        assert fabric.load(out / name, state) == {}, name
        assert state["iter_num"] == 2, name
        _assert_weights(weights(fresh), expected_model, name)
        assert_same_optimizer_state(optimizer_state(fresh, fresh_optimizer), expected_optimizer)

    # lightning-fsdp convert reads the layout: into safetensors weights and into a sharded folder that resumes.
    if fabric.global_rank == 0:
        convert(out / "layout.ckpt", out / "layout.safetensors", to="safetensors", quiet=True)
        convert(out / "layout.ckpt", out / "layout-sharded", to="sharded", quiet=True)
        _assert_weights(load_file(out / "layout.safetensors"), expected_model, "convert --to safetensors")
    fabric.barrier()
    sharded = launch(FabricFSDPStrategy(state_dict_type="sharded"), world_size)
    torch.manual_seed(12)
    fresh = TinyLit()
    fresh, fresh_optimizer = sharded.setup(fresh, adamw(fresh))
    sharded.load(out / "layout-sharded", {"model": fresh, "optimizer": fresh_optimizer})
    _assert_weights(weights(fresh), expected_model, "convert --to sharded")
    assert_same_optimizer_state(optimizer_state(fresh, fresh_optimizer), expected_optimizer)


def check_trainer_interop(world_size: int, out: Path, fabric_weights: dict[str, Tensor]) -> None:
    """A Trainer's checkpoints (both forms) load in Fabric, model and optimizer; Fabric's load in a Trainer."""
    loader = DataLoader(torch.randint(0, TINY.vocab_size, (8, TINY.block_size + 1)), batch_size=2)
    for form in ("full", "sharded"):
        trainer = _trainer(FSDPStrategy(state_dict_type=form), world_size, max_steps=2)
        torch.manual_seed(0)
        lit = TinyLit()
        trainer.fit(lit, loader)
        trainer.save_checkpoint(out / f"trainer-{form}")
        fabric = launch(FabricFSDPStrategy(state_dict_type=form), world_size)
        torch.manual_seed(3)
        model = TinyLit()
        model, optimizer = fabric.setup(model, adamw(model))
        remainder = fabric.load(out / f"trainer-{form}", {"model": model, "optimizer": optimizer})
        assert remainder["global_step"] == 2, sorted(remainder)
        _assert_weights(weights(model), weights(lit), f"Trainer {form} -> Fabric")
        assert_same_optimizer_state(optimizer_state(model, optimizer), optimizer_state(lit, trainer.optimizers[0]))

        torch.manual_seed(4)
        lit = TinyLit()
        _trainer(FSDPStrategy(state_dict_type=form), world_size).validate(lit, loader, ckpt_path=out / f"fabric-{form}")
        _assert_weights(weights(lit), fabric_weights, f"Fabric {form} -> Trainer")


def check_plain_state_dicts(world_size: int, rank: int, out: Path) -> None:
    """``load_raw`` of ddp's ``state_dict()`` files, and ``load`` of a checkpoint ``Fabric(strategy="ddp")`` saved."""
    ddp = launch("ddp", world_size)
    _, _, (ddp_model, ddp_optimizer) = train(ddp, TinyLit, gpt_batches(rank, steps=2))
    if rank == 0:
        torch.save(ddp_model.module.state_dict(), out / "raw-model.pt")
        torch.save(ddp_optimizer.optimizer.state_dict(), out / "raw-optimizer.pt")
    ddp.save(out / "ddp.ckpt", {"model": ddp_model, "optimizer": ddp_optimizer, "step": 2})
    expected_state = ddp_optimizer.optimizer.state_dict()

    fabric = launch("myfsdp", world_size)
    for source in ("raw", "ddp"):
        torch.manual_seed(5)
        model = TinyLit()
        model, optimizer = fabric.setup(model, adamw(model))
        if source == "raw":
            fabric.load_raw(out / "raw-model.pt", model)
            fabric.load_raw(out / "raw-optimizer.pt", optimizer)
        else:
            state = {"model": model, "optimizer": optimizer, "step": 0}
            fabric.load(out / "ddp.ckpt", state)
            assert state["step"] == 2
        _assert_weights(weights(model), weights(ddp_model), f"{source} ddp state dicts")
        loaded = optimizer_state(model, optimizer)
        if rank == 0:
            for index, state in expected_state["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(loaded["state"][index][key], value, rtol=0, atol=0)


def check_filter_and_refusals(world_size: int, out: Path) -> None:
    fabric = launch(FabricFSDPStrategy(state_dict_type="full"), world_size)
    _, _, (model, optimizer) = train(fabric, TinyLit, gpt_batches(fabric.global_rank, steps=1))
    trained = weights(model)

    # filter=: only the final norm saved; a strict load refuses the partial checkpoint, strict=False takes it.
    fabric.save(out / "filtered.ckpt", {"model": model}, filter={"model": lambda name, _: "ln_f" in name})
    torch.manual_seed(6)
    fresh = TinyLit()
    fresh = fabric.setup(fresh)
    before = weights(fresh)
    with pytest.raises(ValueError, match="missing"):
        fabric.load(out / "filtered.ckpt", {"model": fresh})
    _assert_weights(weights(fresh), before, "a refused load")
    fabric.load(out / "filtered.ckpt", {"model": fresh}, strict=False)
    after = weights(fresh)
    for name in before:
        torch.testing.assert_close(after[name], trained[name] if "ln_f" in name else before[name], rtol=0, atol=0)

    # A save never replaces what is not a checkpoint of its form; the file and folder stay as they were.
    foreign = out / "notes.txt"
    folder = out / "user-folder"
    if fabric.global_rank == 0:
        foreign.write_text("mine")
        folder.mkdir()
        (folder / "data.csv").write_text("1,2")
    fabric.barrier()
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        fabric.save(foreign, {"model": model, "optimizer": optimizer})
    sharded = launch(FabricFSDPStrategy(state_dict_type="sharded"), world_size)
    with pytest.raises(FileExistsError, match="not part of a sharded checkpoint"):
        sharded.save(folder, {"model": model, "optimizer": optimizer})
    assert foreign.read_text() == "mine" and sorted(p.name for p in folder.iterdir()) == ["data.csv"]

    # Another model's checkpoint is refused with model and optimizer untouched.
    torch.manual_seed(7)
    other = TinyLit(OTHER)
    other, other_optimizer = fabric.setup(other, adamw(other))
    fabric.save(out / "other.ckpt", {"model": other, "optimizer": other_optimizer})
    state_before = optimizer_state(model, optimizer)
    with pytest.raises(ValueError, match="shape"):
        fabric.load(out / "other.ckpt", {"model": model, "optimizer": optimizer})
    _assert_weights(weights(model), trained, "a refused load")
    assert_same_optimizer_state(optimizer_state(model, optimizer), state_before)

    # Anything beyond plain data is unpickled only when trusted; in both forms.
    for form, strategy in (("full", fabric), ("sharded", sharded)):
        path = out / f"opaque-{form}"
        strategy.save(path, {"model": model, "extra": Opaque()})
        with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
            strategy.load(path, {"model": fresh})
        assert strategy.load(path, {"model": fresh}, weights_only=False) == {"extra": Opaque()}

    # An optimizer that has stepped holds state for the full tensors: refused at setup.
    torch.manual_seed(8)
    unsharded = TinyLit()
    stepped = adamw(unsharded)
    unsharded(*gpt_batches(0)[0][0]).backward()
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        fabric.setup(unsharded, stepped)


def check_empty_init(world_size: int, out: Path) -> None:
    """A model built on the meta device with its optimizer: both set up together, then filled from a checkpoint."""
    fabric = launch("myfsdp", world_size)
    with fabric.init_module(empty_init=True):
        model = TinyLit()
    assert all(p.is_meta for p in model.parameters())
    model, optimizer = fabric.setup(model, adamw(model))
    assert not any(p.is_meta for p in model.parameters())
    fabric.load(out / "fabric-sharded", {"model": model, "optimizer": optimizer})
    reference = launch(FabricFSDPStrategy(state_dict_type="sharded"), world_size)
    torch.manual_seed(9)
    expected = TinyLit()
    expected = reference.setup(expected)
    reference.load(out / "fabric-sharded", {"model": expected})
    _assert_weights(weights(model), weights(expected), "empty_init, then loaded")
    fabric.backward(model(*gpt_batches(fabric.global_rank)[0][0]))
    optimizer.step()


def check_precisions(world_size: int, rank: int) -> None:
    """bf16-mixed keeps fp32 shards, bf16-true makes them bf16, 16-mixed scales with one scale on every rank."""
    plugins = {
        "bf16-mixed": {"precision": "bf16-mixed"},
        "bf16-true": {"precision": "bf16-true"},
        "16-mixed": {"plugins": [FabricFSDPPrecision("16-mixed")]},
    }
    for name, kwargs in plugins.items():
        fabric = launch("myfsdp", world_size, **kwargs)
        losses, _, (model, _) = train(fabric, TinyLit, gpt_batches(rank, steps=2))
        dtypes = {p.dtype for p in model.parameters()}
        assert dtypes == {torch.bfloat16 if name == "bf16-true" else torch.float32}, (name, dtypes)
        assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
        if name == "16-mixed":
            scaler = fabric.strategy.precision.scaler
            assert isinstance(scaler, ShardedGradScaler)
            scales = [None] * world_size
            dist.all_gather_object(scales, scaler.get_scale())
            assert len(set(scales)) == 1, scales


def check_example(world_size: int, out: Path) -> None:
    """examples/fabric_loop.py's loop: trains, saves, and resumes from what it saved."""
    spec = importlib.util.spec_from_file_location("fabric_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(["--steps", "3", "--n-embd", "16", "--out", str(out / "example"), "--batch-size", "2"])
    strategy = FabricFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=args.state_dict_type)
    first = example.train(launch(strategy, world_size), args)
    resumed = argparse.Namespace(**{**vars(args), "steps": 4, "resume": out / "example" / "fabric-ckpt"})
    strategy = FabricFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=args.state_dict_type)
    second = example.train(launch(strategy, world_size), resumed)
    assert 0 < second < first + 1, (first, second)


def _trainer(strategy: FSDPStrategy, world_size: int, **kwargs: Any) -> L.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": world_size,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(strategy=strategy, **{**options, **kwargs})


def _assert_weights(actual: dict[str, Tensor], expected: dict[str, Tensor], label: str) -> None:
    assert actual.keys() == expected.keys(), label
    for name, value in expected.items():
        assert_close(actual[name], value, f"{label}: {name}", rtol=0, atol=0)


def assert_close(actual: Any, expected: Any, label: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda message: f"{label}: {message}")


def _as_launched_rank(rank: int, world_size: int) -> None:
    """Make Fabric and the Trainer take this process as an externally launched rank of the test's group."""
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world_size)})


def test_fabric_two_ranks(tmp_path: Path) -> None:
    run_distributed(two_ranks, 2, str(tmp_path), timeout=300)


def test_fabric_four_ranks() -> None:
    run_distributed(four_ranks, 4, timeout=300)
