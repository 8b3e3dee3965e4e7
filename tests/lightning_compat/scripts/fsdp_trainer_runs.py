"""The Trainer-level tests of Lightning 2.6.5's ``tests/tests_pytorch/strategies/test_fsdp.py``, against ``myfsdp``.

Lightning's launcher starts rank 1 by running this file again, so the tests' bodies run here, one after another in
one pair of processes (spawns are expensive), and each writes OUT_DIR/<case>.json: {"ok": true} or the error. The
pytest side (``test_fsdp_strategy.py``) asserts per case. Mechanical changes against Lightning's file:

- ``accelerator="gpu"/"cuda"``, ``devices=2`` -> ``accelerator="cpu"``, ``devices=2`` (2 gloo ranks); the
  ``RunIf(min_cuda_gpus=...)``, ``standalone`` and ``bf16_cuda`` markers dropped; ``tmp_path`` -> a folder per case
  under OUT_DIR; ``devices=1`` tests run with 2 ranks too (one rank has nothing to shard).
- ``strategy="fsdp"`` / Lightning's ``FSDPStrategy`` -> ``lightning_fsdp.FSDPStrategy`` with the same arguments.
- Manual wrapping: torch's ``wrap()`` in ``configure_model`` is a no-op outside torch's ``enable_wrap`` (which only
  Lightning's strategy enters), so ``TestFSDPModel`` builds the same layers and the units it wrapped by hand come
  from ``auto_wrap_policy={nn.Linear, nn.Sequential}`` (the wrapped layers 0 and 2 and the Sequential).
- ``isinstance(m, FullyShardedDataParallel)`` -> ``unit_of(m) is not None`` (the module is a sharding unit, in place);
  ``m.mixed_precision.param_dtype`` -> the dtype the unit's gathered parameters have in forward (recorded by a
  forward pre-hook), ``reduce_dtype``/``buffer_dtype`` -> the unit's policy, or the model dtype without one.
- ``isinstance(trainer.strategy.precision_plugin, FSDPPrecision)`` -> ours ``lightning_fsdp.FSDPPrecision``.
- Devices in ``test_module_init_context``/``test_configure_model``/``test_modules_without_parameters``: "cuda" ->
  "cpu", the ranks' device here.
- ``"16-mixed"`` on CPU: Lightning's Trainer turns it into ``"bf16-mixed"`` before any strategy sees it.
- ``test_strategy_load_optimizer_states_multiple`` mocked ``_load_raw_module_state`` and Mock optimizers; here it
  saves a real checkpoint with one optimizer and resumes a module that has two (and the other way round).
- ``test_lazy_load_full_state_dict`` mocked Lightning's ``_lazy_load``; here ``torch.load`` is spied on (wrapped, not
  replaced) and must have read the file memory-mapped (``mmap=True``), our way of not holding a second copy.
- ``self.layer`` (the Sequential) of ``TestFSDPModel`` is checked through its wrapped layers 0 and 2: with all its
  parameters in their units it has none left, and a unit without parameters is not made (deliberate).
- ``test_set_timeout`` mocked ``init_process_group``; here the default group's timeout is read after setup.
- ``test_activation_checkpointing`` checked torch's ``checkpoint_wrapper`` kwargs with mocks; here the modules of the
  policy's classes are the checkpointed ones after setup (``is_checkpointed``), the others not.
- No case is seeded where Lightning's is not: ranks that build the model with different initial values all take
  rank 0's, as under DDP (the cases share a pair of processes whose random streams drift apart).
  ``_train_batchnorm`` seeds (our item: it compares two runs with each other).
Additions beyond Lightning's file (our items): ``sync_batchnorm_matches_ddp`` (a BatchNorm model under
``sync_batchnorm=True`` against ddp with the same CPU-capable sync plugin, and ddp without it as the control), and
``float_input_<precision>`` (a float-input model with LayerNorm and BatchNorm trains under bf16-mixed and 16-mixed),
``optimizer_state_layout_and_files_with_param_names`` (``optimizer_state`` has torch's keys, with an optimizer built
from ``parameters()`` and from ``named_parameters()``; a checkpoint with ``param_names`` in its groups, as they were
written before, resumes exactly).

After each case its ranks run Lightning's check that a test leaves no thread behind (``thread_police.py``, as the
``thread_police_duuu_daaa_duuu_daaa`` fixture of Lightning's conftest runs it after each test): a thread the case
left alive, after the Trainer's teardown, fails it with Lightning's sentence.

Usage: python tests/lightning_compat/scripts/fsdp_trainer_runs.py OUT_DIR [CASE ...]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint
from thread_police import check_threads_since
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, always_wrap_policy, size_based_auto_wrap_policy
from torchmetrics import Accuracy

from lightning_fsdp import FSDPPrecision, FSDPStrategy
from lightning_fsdp.engine.features.activation_checkpointing import is_checkpointed
from lightning_fsdp.engine.runtime.registry import unit_of
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run
from lightning_fsdp.trainer.sync_batchnorm import CPUCapableSyncBatchNorm

OUT = Path(sys.argv[1])
CASES: dict[str, Callable[[Path], dict[str, Any] | None]] = {}


def case(fn: Callable[[Path], dict[str, Any] | None]) -> Callable[[Path], dict[str, Any] | None]:
    CASES[fn.__name__] = fn
    return fn


def _compute_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    """The dtype of each Linear's weight as its forward saw it (the gathered parameter), filled in by hooks."""
    seen: dict[str, torch.dtype] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            # A post-hook registered before sharding runs before the engine's, which reshards: the weight is the
            # gathered one here (a pre-hook would run before the gather and see the fp32 shard).
            sub.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, m.weight.dtype))
    return seen


def _expected_dtype(precision: str) -> torch.dtype:
    return {"16": torch.float16, "bf16": torch.bfloat16}.get(precision.split("-")[0], torch.float32)


def _assert_unit(module: nn.Module, precision: str, compute_dtypes: dict[str, torch.dtype], name: str) -> None:
    unit = unit_of(module)
    assert unit is not None, f"{name} is not a sharding unit"
    expected = _expected_dtype(precision)
    policy = unit.options.mixed_precision
    reduce_dtype = policy.effective_reduce_dtype or next(iter(module.parameters())).dtype
    buffer_dtype = policy.buffer_dtype or next(iter(module.parameters())).dtype
    assert reduce_dtype == buffer_dtype == expected, (name, reduce_dtype, buffer_dtype, expected)
    for linear_name, dtype in compute_dtypes.items():
        assert dtype == expected, (linear_name, dtype, expected)


class SymmetricFailure(AssertionError):
    """A failed check every rank raises at the same point: the ranks stay in step and the next case can run."""


class TestFSDPModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.layer: nn.Module | None = None
        self.compute_dtypes: dict[str, torch.dtype] = {}

    def _init_model(self) -> None:
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def configure_model(self) -> None:
        if self.layer is None:
            self._init_model()
        if unit_of(self.layer[0]) is not None:  # the model is already sharded: no need to build again
            return
        self.compute_dtypes = _compute_dtypes(self.layer)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.layer.parameters(), lr=0.1)

    def on_train_batch_start(self, batch, batch_idx):
        assert batch.dtype == torch.float32

    def on_train_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_test_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_validation_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_predict_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def _assert_layer_fsdp_instance(self) -> None:
        assert isinstance(self.trainer.strategy.precision_plugin, FSDPPrecision)
        precision = self.trainer.precision
        # Deliberate difference: the Sequential holds no parameter of its own once its Linears are units, and a
        # unit without parameters would gather nothing, so it is none; its layers' units are checked instead.
        for layer_num in [0, 2]:
            _assert_unit(self.layer[layer_num], precision, self.compute_dtypes, f"layer.{layer_num}")


MANUAL_UNITS = {nn.Linear, nn.Sequential}  # what TestFSDPModel wrapped by hand


class TestBoringModel(BoringModel):
    def __init__(self, wrap_min_params: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.should_be_wrapped = [wrap_min_params < (32 * 32 + 32), None, wrap_min_params < (32 * 2 + 2)]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class TestFSDPModelAutoWrapped(TestBoringModel):
    def on_train_batch_start(self, batch, batch_idx):
        assert batch.dtype == torch.float32

    def on_train_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_test_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_validation_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_predict_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def _assert_layer_fsdp_instance(self) -> None:
        assert isinstance(self.layer, torch.nn.Sequential)
        assert isinstance(self.trainer.strategy.precision_plugin, FSDPPrecision)
        for layer_num in [0, 2]:
            if not self.should_be_wrapped[layer_num]:
                assert unit_of(self.layer[layer_num]) is None  # this layer is not wrapped
                continue
            _assert_unit(self.layer[layer_num], self.trainer.precision, {}, f"layer.{layer_num}")


def _run_multiple_stages(trainer, model, model_path: str | None = None):
    trainer.fit(model)
    trainer.test(model)

    model_path = trainer.strategy.broadcast(model_path)
    model_path = Path(model_path if model_path else trainer.checkpoint_callback.last_model_path)

    # Save another checkpoint after testing, without optimizer states
    trainer.save_checkpoint(model_path.with_name("after-test"))
    trainer.save_checkpoint(model_path, weights_only=True)

    if not model_path.is_dir():
        _assert_save_equality(trainer, model_path, cls=model.__class__)

    with torch.inference_mode():
        trainer.test(model)  # model is sharded, will not call `configure_model`
        trainer.test(ckpt_path=model_path)
        trainer.predict(model)
        trainer.predict(ckpt_path=model_path)


def _assert_save_equality(trainer, ckpt_path, cls=TestFSDPModel):
    model_state_dict = trainer.strategy.lightning_module_state_dict()

    if trainer.is_global_zero:
        saved_model = cls.load_from_checkpoint(ckpt_path)
        if cls is TestFSDPModel:  # its layers are built in configure_model
            saved_model.configure_model()
            saved_model.load_state_dict(torch.load(ckpt_path, weights_only=True)["state_dict"])
        assert len(model_state_dict) == len(saved_model.state_dict())
        for ddp_param, shard_param in zip(model_state_dict.values(), saved_model.state_dict().values(), strict=True):
            assert torch.equal(ddp_param, shard_param)


# ----- the cases -----------------------------------------------------------------------------------------------------


@case
def strategy_sync_batchnorm(tmp_path: Path) -> None:
    model = TestFSDPModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy=MANUAL_UNITS),
        precision="32-true",
        max_epochs=1,
        sync_batchnorm=True,
    )
    _run_multiple_stages(trainer, model, os.path.join(tmp_path, "last.ckpt"))


@case
def modules_without_parameters(tmp_path: Path) -> None:
    class MetricsModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.metric = Accuracy("multiclass", num_classes=10)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def setup(self, stage) -> None:
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")
            self.metric(torch.rand(2, 10, device=self.device), torch.randint(0, 10, size=(2,), device=self.device))
            return loss

    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy=FSDPStrategy(), max_steps=1)
    trainer.fit(MetricsModel())


def _strategy_checkpoint(state_dict_type: str, precision: str, tmp_path: Path) -> None:
    model = TestFSDPModel()
    strategy = FSDPStrategy(state_dict_type=state_dict_type, auto_wrap_policy=MANUAL_UNITS)
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_epochs=1
    )
    _run_multiple_stages(trainer, model, os.path.join(tmp_path, "last.ckpt"))


for _type in ("sharded", "full"):
    for _precision in ("32-true", "bf16-mixed"):
        case_name = f"strategy_checkpoint_{_type}_{_precision}"
        CASES[case_name] = partial(_strategy_checkpoint, _type, _precision)


def custom_auto_wrap_policy(module, recurse, nonwrapped_numel: int) -> bool:
    return nonwrapped_numel >= 2


def _strategy_full_state_dict(wrap_min_params: int, tmp_path: Path) -> None:
    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    correct_state_dict = model.state_dict()  # State dict before wrapping

    strategy = FSDPStrategy(auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=wrap_min_params))
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="16-mixed",
        max_epochs=1,
        barebones=True,
    )
    trainer.fit(model)

    full_state_dict = trainer.strategy.lightning_module_state_dict()

    if trainer.global_rank != 0:
        assert len(full_state_dict) == 0
        return

    assert len(correct_state_dict) == len(full_state_dict)
    assert all(_ex == _co for _ex, _co in zip(full_state_dict.keys(), correct_state_dict.keys(), strict=True))


def _checkpoint_multi_gpus(model: BoringModel, strategy: Any, tmp_path: Path) -> None:
    ck = ModelCheckpoint(save_last=True)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="32-true",
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        callbacks=[ck],
    )
    _run_multiple_stages(trainer, model)


CASES["checkpoint_multi_gpus_manually_wrapped"] = lambda tmp: _checkpoint_multi_gpus(
    TestFSDPModel(), FSDPStrategy(auto_wrap_policy=MANUAL_UNITS), tmp
)
CASES["checkpoint_multi_gpus_autowrap_2x"] = lambda tmp: _checkpoint_multi_gpus(
    TestFSDPModelAutoWrapped(), FSDPStrategy(auto_wrap_policy=custom_auto_wrap_policy), tmp
)
CASES["checkpoint_multi_gpus_autowrap_use_orig_params"] = lambda tmp: _checkpoint_multi_gpus(
    TestFSDPModelAutoWrapped(), FSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True), tmp
)
for _min_params in (2, 1024, 100000000):
    CASES[f"strategy_full_state_dict_{_min_params}"] = partial(_strategy_full_state_dict, _min_params)


def _invalid_parameters_in_optimizer(use_orig_params: bool | None, tmp_path: Path) -> dict[str, Any]:
    fsdp_kwargs = {} if use_orig_params is None else {"use_orig_params": use_orig_params}
    trainer = Trainer(
        default_root_dir=tmp_path, strategy=FSDPStrategy(**fsdp_kwargs), accelerator="cpu", devices=2, fast_dev_run=1
    )

    class EmptyParametersModel(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    trainer.fit(EmptyParametersModel())

    class NoFlatParametersModel(BoringModel):
        def configure_optimizers(self):
            layer = torch.nn.Linear(4, 5)
            return torch.optim.Adam(layer.parameters(), lr=1e-2)

    # Deliberate difference: an optimizer that holds no parameter of the model is refused for every
    # use_orig_params (Lightning refuses it only with use_orig_params=False, where torch flattens parameters).
    try:
        trainer.fit(NoFlatParametersModel())
    except ValueError as error:
        return {"error": str(error)}
    raise AssertionError("an optimizer over a foreign Linear was accepted")


for _orig in (None, False, True):
    CASES[f"invalid_parameters_in_optimizer_{_orig}"] = partial(_invalid_parameters_in_optimizer, _orig)


@case
def activation_checkpointing(tmp_path: Path) -> None:
    class Block1(nn.Linear):
        pass

    class Block2(nn.Linear):
        pass

    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.layer0 = nn.Sequential(Block1(32, 32), Block1(32, 32))
            self.layer1 = Block2(32, 32)
            self.layer2 = nn.Linear(32, 32)

        def forward(self, x):
            return self.layer(self.layer2(self.layer1(self.layer0(x))))

    for policy, checkpointed in (({Block1}, (Block1,)), (ModuleWrapPolicy({Block1, Block2}), (Block1, Block2))):
        model = Model()
        trainer = Trainer(
            default_root_dir=tmp_path,
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(activation_checkpointing_policy=policy),
            max_steps=2,
            barebones=True,
        )
        trainer.fit(model)
        for module in model.modules():
            assert is_checkpointed(module) == isinstance(module, checkpointed), type(module).__name__


@case
def set_timeout(tmp_path: Path) -> None:
    test_timedelta = timedelta(seconds=30)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(timeout=test_timedelta),
        max_steps=1,
        barebones=True,
    )
    trainer.fit(BoringModel())
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert backend.options._timeout == test_timedelta


def _optimizer_round_trip(wrap_min_params: int, tmp_path: Path, save_with: str) -> None:
    """test_strategy_save_optimizer_states (save_with="fsdp") and test_strategy_load_optimizer_states ("ddp")."""
    fsdp = FSDPStrategy(auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=wrap_min_params))
    fsdp_kwargs = {"strategy": fsdp, "precision": "16-mixed", "barebones": True}
    first = fsdp_kwargs if save_with == "fsdp" else {"strategy": "ddp"}
    second = {"strategy": "ddp"} if save_with == "fsdp" else fsdp_kwargs
    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params) if save_with == "fsdp" else TestBoringModel()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, max_epochs=1, **first)
    trainer.fit(model)
    model_path = trainer.strategy.broadcast(os.path.join(tmp_path, "last.ckpt"))
    trainer.save_checkpoint(model_path)

    model_state_dict = trainer.strategy.lightning_module_state_dict()
    optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())
    if save_with == "fsdp" and trainer.global_rank != 0:
        assert len(model_state_dict) == 0
        assert len(optimizer_state_dict) == 0

    model = TestBoringModel() if save_with == "fsdp" else TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, max_epochs=1, **second)
    trainer.fit(model, ckpt_path=model_path)

    restored_model_state_dict = trainer.strategy.lightning_module_state_dict()
    restored_optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())
    if save_with == "ddp" and trainer.global_rank != 0:
        assert len(restored_model_state_dict) == 0
        assert len(restored_optimizer_state_dict) == 0
    failure = None
    if trainer.global_rank == 0:
        try:
            assert len(model_state_dict) == len(restored_model_state_dict)
            assert len(optimizer_state_dict) == len(restored_optimizer_state_dict)
            torch.testing.assert_close(model_state_dict, restored_model_state_dict, atol=0, rtol=0)
            torch.testing.assert_close(optimizer_state_dict, restored_optimizer_state_dict, atol=0, rtol=0)
            _assert_same_keys(optimizer_state_dict, restored_optimizer_state_dict)  # our item: the keys by name
        except AssertionError as error:
            failure = str(error)
    failure = trainer.strategy.broadcast(failure)  # every rank fails together, so the next case still runs
    if failure is not None:
        raise SymmetricFailure(failure)


def _assert_same_keys(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The same keys at the top, in every group and in every parameter's state (what ``assert_close`` compares too,
    said by name)."""
    assert ours.keys() == theirs.keys(), (list(ours), list(theirs))
    assert [sorted(g) for g in ours["param_groups"]] == [sorted(g) for g in theirs["param_groups"]], (
        [sorted(g) for g in ours["param_groups"]],
        [sorted(g) for g in theirs["param_groups"]],
    )
    assert {i: sorted(s) for i, s in ours["state"].items()} == {i: sorted(s) for i, s in theirs["state"].items()}


for _min_params in (2, 1024, 100000000):
    CASES[f"strategy_save_optimizer_states_{_min_params}"] = partial(
        lambda n, tmp: _optimizer_round_trip(n, tmp, "fsdp"), _min_params
    )
    CASES[f"strategy_load_optimizer_states_{_min_params}"] = partial(
        lambda n, tmp: _optimizer_round_trip(n, tmp, "ddp"), _min_params
    )


class NamedParametersModel(TestFSDPModelAutoWrapped):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.named_parameters(), lr=0.1)


@case
def optimizer_state_layout_and_files_with_param_names(tmp_path: Path) -> None:
    """Our item. ``optimizer_state``, and the checkpoint's optimizer state, have the keys ``optimizer.state_dict()``
    has: no ``param_names`` unless the optimizer's groups have them (built from ``named_parameters``), then its own.
    A checkpoint written before, with ``param_names`` in every group, resumes with the optimizer restored exactly."""

    def trainer() -> Trainer:
        strategy = FSDPStrategy(auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=2))
        return Trainer(
            default_root_dir=tmp_path, accelerator="cpu", devices=2, max_epochs=1, strategy=strategy, barebones=True
        )

    def on_rank0(first: Trainer, check: Callable[[], None]) -> None:
        failure = None
        if first.global_rank == 0:
            try:
                check()
            except Exception as error:  # noqa: BLE001 -- any failure, raised on every rank below
                failure = f"{type(error).__name__}: {error}"
        failure = first.strategy.broadcast(failure)  # every rank fails together, so the next case still runs
        if failure is not None:
            raise SymmetricFailure(failure)

    def keys(state: dict[str, Any]) -> list[list[str]]:
        return [sorted(group) for group in state["param_groups"]]

    for make in (TestFSDPModelAutoWrapped, NamedParametersModel):
        model, first = make(), trainer()
        first.fit(model)
        path = first.strategy.broadcast(os.path.join(tmp_path, f"{make.__name__}.ckpt"))
        old = os.path.join(tmp_path, f"{make.__name__}-old.ckpt")
        first.save_checkpoint(path)
        saved = first.strategy.optimizer_state(model.optimizers())
        own = model.optimizers().optimizer.state_dict()  # torch's own, over this rank's shards

        def check_and_write_old(saved=saved, own=own, model=model, path=path, old=old) -> None:
            assert saved.keys() == own.keys() and keys(saved) == keys(own), (keys(saved), keys(own))
            for ours, theirs in zip(saved["param_groups"], own["param_groups"], strict=True):
                assert ours.get("param_names") == theirs.get("param_names")
            checkpoint = torch.load(path, weights_only=False)
            assert keys(checkpoint["optimizer_states"][0]) == keys(own)
            names = [name for name, _ in model.named_parameters()]
            for group in checkpoint["optimizer_states"][0]["param_groups"]:
                group["param_names"] = [names[index] for index in group["params"]]  # as files had them before
            torch.save(checkpoint, old)

        on_rank0(first, check_and_write_old)
        first.strategy.barrier()
        model, second = make(), trainer()
        second.fit(model, ckpt_path=old)
        restored = second.strategy.optimizer_state(model.optimizers())

        def check_restored(saved=saved, restored=restored) -> None:
            _assert_same_keys(saved, restored)
            names = [[group.pop("param_names", None) for group in s["param_groups"]] for s in (saved, restored)]
            assert names[0] == names[1], names  # strings, which assert_close does not compare
            torch.testing.assert_close(saved, restored, atol=0, rtol=0)

        on_rank0(second, check_restored)


@case
def strategy_load_optimizer_states_multiple(tmp_path: Path) -> dict[str, Any]:
    class TwoOptimizers(BoringModel):
        def __init__(self, count: int) -> None:
            super().__init__()
            self.count = count
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            for optimizer in self.optimizers() if self.count > 1 else [self.optimizers()]:
                loss = self.step(batch)
                self.manual_backward(loss)
                optimizer.step()
                optimizer.zero_grad()

        def configure_optimizers(self):
            return [torch.optim.Adam(self.parameters(), lr=1e-2) for _ in range(self.count)]

    def trainer() -> Trainer:
        strategy = FSDPStrategy(state_dict_type="full")
        return Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy=strategy, max_steps=1)

    errors = {}
    for saved, configured in ((2, 1), (1, 2)):
        t = trainer()
        t.fit(TwoOptimizers(saved))
        path = t.strategy.broadcast(str(tmp_path / f"{saved}-states.ckpt"))
        t.save_checkpoint(path)
        try:
            trainer().fit(TwoOptimizers(configured), ckpt_path=path)
        except ValueError as error:  # Lightning: RuntimeError, "1 optimizers but the checkpoint contains 2 ..."
            errors[f"{configured}-of-{saved}"] = str(error)
            continue
        raise AssertionError(f"{saved} saved optimizer states were loaded into {configured} optimizers")
    return errors


@case
def configure_model(tmp_path: Path) -> None:
    precision, expected_dtype = "32-true", torch.float32
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy=always_wrap_policy),
        precision=precision,
        max_epochs=1,
        enable_checkpointing=False,
        logger=False,
    )

    class MyModel(BoringModel):
        def configure_model(self):
            self.layer = torch.nn.Linear(32, 2)
            expected_device = torch.device("cpu")
            assert self.layer.weight.device == expected_device
            assert self.layer.weight.dtype == expected_dtype

        def configure_optimizers(self):
            return torch.optim.AdamW(self.layer.parameters(), lr=0.1)

        def on_fit_start(self):
            assert self.layer.weight.device == torch.device("cpu")
            assert self.layer.weight.dtype == expected_dtype

    trainer.fit(MyModel())


def _module_init_context(precision: str, expected_dtype: torch.dtype, tmp_path: Path) -> None:
    class Model(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def on_train_start(self):
            assert self.layer.weight.device == torch.device("cpu")
            assert self.layer.weight.dtype == expected_dtype
            optimizer = self.optimizers(use_pl_optimizer=False)
            assert optimizer.param_groups[0]["params"][0].device.type == "cpu"

    def _run_setup_assertions(empty_init, expected_device):
        trainer = Trainer(
            default_root_dir=tmp_path,
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(auto_wrap_policy={torch.nn.Linear}),
            precision=precision,
            max_steps=1,
            barebones=True,
            enable_checkpointing=False,
            logger=False,
        )
        with trainer.init_module(empty_init=empty_init):
            model = Model()
        assert model.layer.weight.device == expected_device
        assert model.layer.weight.dtype == expected_dtype
        trainer.fit(model)

    _run_setup_assertions(empty_init=False, expected_device=torch.device("cpu"))
    _run_setup_assertions(empty_init=True, expected_device=torch.device("meta"))


for _precision, _dtype in (("32-true", torch.float32), ("16-true", torch.float16), ("bf16-true", torch.bfloat16)):
    CASES[f"module_init_context_{_precision}"] = partial(_module_init_context, _precision, _dtype)


class TestFSDPCheckpointModel(BoringModel):
    def __init__(self, params_to_compare=None):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.params_to_compare = params_to_compare

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def on_train_start(self):
        if self.params_to_compare is None:
            return
        for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters(), strict=True):
            torch.testing.assert_close(p0, p1, atol=0, rtol=0, equal_nan=True)


@case
def save_load_sharded_state_dict(tmp_path: Path) -> dict[str, Any]:
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded")
    trainer_kwargs = {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }
    model = TestFSDPCheckpointModel()
    trainer = Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model)
    params_before = [p.detach().clone() for p in trainer.model.parameters()]

    checkpoint_path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    files = sorted(os.listdir(checkpoint_path))

    metadata = torch.load(checkpoint_path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata
    assert len(metadata["callbacks"]) == 1  # model checkpoint callback
    assert "state_dict" not in metadata
    assert "optimizer_states" not in metadata

    trainer_kwargs.update(max_epochs=2)
    model = TestFSDPCheckpointModel(params_to_compare=params_before)
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded")
    trainer = Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model, ckpt_path=checkpoint_path)
    return {"files": files}


@case
def lazy_load_full_state_dict(tmp_path: Path) -> None:
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy=FSDPStrategy(), max_steps=1)
    trainer.fit(BoringModel())
    path = trainer.strategy.broadcast(str(tmp_path / "test.ckpt"))
    trainer.save_checkpoint(path)
    with mock.patch("torch.load", wraps=torch.load) as spy:
        Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy=FSDPStrategy(), max_steps=2).fit(
            BoringModel(), ckpt_path=path
        )
    reads = [call for call in spy.call_args_list if str(call.args[0] if call.args else "") == path]
    assert reads, "the checkpoint file was not read through torch.load"
    assert all(call.kwargs.get("mmap") for call in reads), reads


@case
def save_sharded_and_consolidate_and_load(tmp_path: Path) -> None:
    class CustomModel(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy=always_wrap_policy, state_dict_type="sharded"),
        max_steps=3,
    )
    trainer.fit(CustomModel())

    checkpoint_path_sharded = trainer.strategy.broadcast(str(trainer.checkpoint_callback.best_model_path))
    checkpoint_path_full = trainer.strategy.broadcast(str(tmp_path / "checkpoint_full.ckpt"))
    if trainer.global_rank == 0:
        checkpoint = _load_distributed_checkpoint(Path(checkpoint_path_sharded))
        checkpoint = _format_checkpoint(checkpoint)
        torch.save(checkpoint, checkpoint_path_full)
    trainer.strategy.barrier()

    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", max_steps=4)
    trainer.fit(CustomModel(), ckpt_path=checkpoint_path_full)


# ----- additions for our items (not in Lightning's file) -------------------------------------------------------------


class BatchNormModel(BoringModel):
    """Float inputs through LayerNorm, Linear and BatchNorm: what a token-id GPT never exercises."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(RandomDataset(32, 64), batch_size=4)  # 4 a rank: unsynced BN works too


def _train_batchnorm(tmp_path: Path, strategy: Any, **kwargs: Any) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = BatchNormModel()
    losses: list[float] = []
    model.on_train_batch_end = lambda outputs, *args: losses.append(float(outputs["loss"]))
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        barebones=True,
        **kwargs,
    )
    trainer.fit(model)
    state = trainer.strategy.lightning_module_state_dict() if isinstance(strategy, FSDPStrategy) else model.state_dict()
    return {k: v.float() for k, v in state.items()}, losses


@case
def sync_batchnorm_matches_ddp(tmp_path: Path) -> dict[str, Any]:
    ours, _ = _train_batchnorm(tmp_path, FSDPStrategy(), sync_batchnorm=True)
    ddp, _ = _train_batchnorm(tmp_path, "ddp", plugins=[CPUCapableSyncBatchNorm()])
    unsynced, _ = _train_batchnorm(tmp_path, "ddp")
    if dist.get_rank() != 0:
        return None

    def max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in a)

    return {"error_vs_ddp": max_error(ours, ddp), "ddp_sync_vs_unsynced": max_error(ddp, unsynced)}


def _float_input(precision: str, tmp_path: Path) -> dict[str, Any]:
    plugin = FSDPPrecision(precision) if precision == "16-mixed" else None  # the Trainer maps 16-mixed on CPU to bf16
    strategy = FSDPStrategy(precision_plugin=plugin) if plugin else FSDPStrategy()
    kwargs = {} if plugin else {"precision": precision}
    _, losses = _train_batchnorm(tmp_path, strategy, **kwargs)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    return {"losses": losses}


for _precision in ("bf16-mixed", "16-mixed"):
    CASES[f"float_input_{_precision}"] = partial(_float_input, _precision)


def main() -> None:
    names = sys.argv[2:] or list(CASES)
    # The process group is created once, by the first case, and reused: the timeout case must come first.
    names.sort(key=lambda name: name != "set_timeout")
    for name in names:
        tmp_path = OUT / "runs" / name
        tmp_path.mkdir(parents=True, exist_ok=True)
        threads_before = set(threading.enumerate())
        try:
            extra = CASES[name](tmp_path) or {}
            record: dict[str, Any] = {"ok": True, **extra}
        except Exception as error:  # recorded per case: the pytest side fails that case with this traceback
            record = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        try:  # Lightning's check, in the ranks where the threads live: see thread_police.py
            check_threads_since(threads_before)
        except AssertionError as error:  # no collective is involved: the next case can run
            record = {"ok": False, "error": f"{SymmetricFailure.__name__}: {error}", "traceback": str(error)}
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        (OUT / f"{name}.rank{rank}.json").write_text(json.dumps(record, default=str))
        if not record["ok"] and not record["error"].startswith(SymmetricFailure.__name__):
            # the ranks may now be out of step in their collectives: stop rather than hang
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    exit_after_distributed_run()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py


if __name__ == "__main__":
    main()
