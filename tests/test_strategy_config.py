"""FSDPStrategy's configuration, in this process: the registered names, and one clear sentence for each wrong input,
raised when the strategy or the Trainer is built (or, for the mesh, before the process group exists)."""

from __future__ import annotations

import inspect
import re
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

import lightning_fsdp
from lightning_fsdp import CrossHostPrecision, FabricFSDPStrategy, FSDPPrecision, FSDPStrategy, MixedPrecision
from lightning_fsdp.adapter.lightning_arguments import TORCH_FSDP_DEFAULTS
from lightning_fsdp.demos.gpt import Block


def cpu_trainer(strategy: object, **kwargs: object) -> L.Trainer:
    """Building a Trainer launches nothing: processes start only in fit/validate/test/predict."""
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, **kwargs)


def assert_one_sentence(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert message.endswith("."), message
    assert not re.search(r"\.\s+[A-Z]", message), f"more than one sentence: {message}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"


def test_importing_the_package_registers_the_strategy_names() -> None:
    assert lightning_fsdp.FSDPStrategy is FSDPStrategy
    default = cpu_trainer("myfsdp").strategy
    assert isinstance(default, FSDPStrategy)
    assert (default.sharding_strategy, default.cpu_offload) == ("FULL_SHARD", False)
    assert cpu_trainer("myfsdp_shard_grad_op").strategy.sharding_strategy == "SHARD_GRAD_OP"
    offload = cpu_trainer("myfsdp_cpu_offload").strategy
    assert (offload.sharding_strategy, offload.cpu_offload) == ("FULL_SHARD", True)


def test_class_paths_in_policies_are_imported() -> None:
    strategy = FSDPStrategy(
        auto_wrap_policy=["lightning_fsdp.demos.gpt.Block"], activation_checkpointing_policy="torch.nn.Linear"
    )
    assert strategy.auto_wrap_policy == {Block}
    assert strategy.activation_checkpointing_policy == {torch.nn.Linear}


@pytest.mark.parametrize(
    ("precision", "engine_dtype", "model_dtype"),
    [
        ("32-true", None, torch.float32),
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("bf16-true", None, torch.bfloat16),
        ("16-true", None, torch.float16),
    ],
)
def test_trainer_precision_maps_onto_the_engine(
    precision: str, engine_dtype: torch.dtype | None, model_dtype: torch.dtype
) -> None:
    strategy = cpu_trainer("myfsdp", precision=precision).strategy
    assert isinstance(strategy.precision_plugin, FSDPPrecision)
    config = strategy.mixed_precision_config  # as Lightning reports it: the compute dtype, always
    compute_dtype = engine_dtype or model_dtype
    assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (compute_dtype,) * 3
    engine = strategy.precision_plugin.engine_mixed_precision  # what the engine gets: a policy for "-mixed" only
    if engine_dtype is None:
        assert engine is None
    else:
        assert (engine.param_dtype, engine.reduce_dtype, engine.buffer_dtype) == (engine_dtype,) * 3
        assert engine.cast_forward_inputs  # a float batch meets the half weights in the half type
    assert strategy.precision_plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype == model_dtype


def test_fp16_mixed_gets_the_sharded_scaler_and_an_explicit_policy_wins() -> None:
    plugin = FSDPPrecision("16-mixed")
    assert isinstance(plugin.scaler, lightning_fsdp.ShardedGradScaler)
    assert plugin.mixed_precision_config == MixedPrecision(torch.float16, torch.float16, torch.float16)
    explicit = MixedPrecision(param_dtype=torch.bfloat16)
    strategy = FSDPStrategy(mixed_precision=explicit, precision_plugin=plugin)
    assert strategy.mixed_precision_config is explicit


def test_a_wrong_sharding_strategy() -> None:
    with pytest.raises(ValueError) as error:
        FSDPStrategy(sharding_strategy="ZERO3")
    assert_one_sentence(error, "sharding_strategy='ZERO3'", "'FULL_SHARD'", "'HYBRID_SHARD'")


def test_an_auto_wrap_class_path_that_does_not_import() -> None:
    with pytest.raises(ValueError) as error:
        FSDPStrategy(auto_wrap_policy={"lightning_fsdp.demos.gpt.Blok"})
    assert_one_sentence(error, "auto_wrap_policy", "'lightning_fsdp.demos.gpt.Blok'")
    with pytest.raises(ValueError) as error:
        FSDPStrategy(activation_checkpointing_policy=["no_such_package.Block"])
    assert_one_sentence(error, "activation_checkpointing_policy", "'no_such_package.Block'", "No module named")


def test_a_device_mesh_that_does_not_match_the_world_size() -> None:
    trainer = cpu_trainer(FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(3, 1)))
    with pytest.raises(ValueError) as error:
        trainer.strategy.setup_environment()  # raises before init_process_group
    assert_one_sentence(error, "device_mesh=(3, 1)", "3 ranks", "this run has 2")
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("precision", ["64-true", "transformer-engine"])
def test_an_unsupported_precision(precision: str) -> None:
    class OtherPrecision(Precision):  # stands in for plugins whose packages are not installed here
        pass

    OtherPrecision.precision = precision
    with pytest.raises(ValueError) as error:
        if precision == "64-true":
            cpu_trainer("myfsdp", precision=precision)  # through Trainer(precision=...)
        else:
            FSDPStrategy(precision_plugin=OtherPrecision())
    assert_one_sentence(error, f"precision={precision!r}", "'bf16-mixed'")


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"backward_prefetch": "BEFORE"}, ["backward_prefetch='BEFORE'", "'BACKWARD_PRE'"]),
        ({"state_dict_type": "shards"}, ["state_dict_type='shards'", "'full'"]),
        ({"device_mesh": (1, 2)}, ["device_mesh=(1, 2)", "HYBRID_SHARD"]),
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 0)}, ["(replicate, shard)"]),
        ({"cpu_offload": "yes"}, ["cpu_offload must be True, False, None or", "CPUOffload"]),
        ({"sync_grads_each_micro_batch": 1}, ["sync_grads_each_micro_batch"]),
        ({"timeout": 20}, ["timeout must be a datetime.timedelta"]),
        ({"auto_wrap_policy": set()}, ["auto_wrap_policy is an empty set"]),
        ({"auto_wrap_policy": {int}}, ["not an nn.Module class"]),
        ({"auto_wrap_policy": 3}, ["auto_wrap_policy=3 is not a policy"]),
        ({"activation_checkpointing_policy": torch.nn.Linear(2, 2)}, ["a Linear instance", "pass its class"]),
        ({"mixed_precision": torch.bfloat16}, ["lightning_fsdp.MixedPrecision", "bf16-mixed"]),
        ({"param_init_fn": "reset"}, ["param_init_fn must be a callable"]),
        ({"reshard_after_forward": 0}, ["reshard_after_forward must be True, False, None or a positive number"]),
        (
            {"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": 2},
            ["reshard_after_forward=2 needs sharding_strategy FULL_SHARD or HYBRID_SHARD"],
        ),
        ({"cross_host_precision": "fp8"}, ["cross_host_precision='fp8' is not supported", "'int8'"]),
        ({"cross_host_precision": {"gather": "fp8"}}, ["CrossHostPrecision.gather='fp8' is not supported"]),
        ({"gather_embedding_by_rows": "no"}, ["gather_embedding_by_rows must be True or False"]),
    ],
)
def test_every_argument_is_checked(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        FSDPStrategy(**kwargs)
    assert_one_sentence(error, *fragments)


def test_good_arguments_pass() -> None:
    strategy = FSDPStrategy(
        auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, Block),
        activation_checkpointing_policy=Block,
        sharding_strategy="hybrid_shard",
        device_mesh=[1, 2],
        timeout=timedelta(seconds=20),
        backward_prefetch=None,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        param_init_fn=lambda module: None,
    )
    assert strategy.activation_checkpointing_policy == {Block}
    assert (strategy.sharding_strategy, strategy.device_mesh, strategy.backward_prefetch) == (
        "HYBRID_SHARD",
        (1, 2),
        None,
    )


def test_the_arguments_between_hosts_reach_the_engine_from_a_config() -> None:
    """LightningCLI builds the strategy from a config's fields: the shorthand string, the dataclass's fields as a
    mapping, and FSDP2's int form of reshard_after_forward all arrive as the engine takes them."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(FSDPStrategy, "strategy")
    for given, expected in (("int8", CrossHostPrecision("int8", "bf16")), ('{"gather": "bf16"}', None)):
        args = ["--strategy.reshard_after_forward", "2", "--strategy.cross_host_precision", given]
        strategy = parser.instantiate(parser.parse_args(args)).strategy
        options = strategy._engine_options()
        assert options["reshard_after_forward"] == 2
        assert options["cross_host_precision"] == (expected or CrossHostPrecision(gather="bf16"))
    assert "reshard_after_forward" not in FSDPStrategy()._engine_options()
    args = ["--strategy.gather_embedding_by_rows", "false"]
    strategy = parser.instantiate(parser.parse_args(args)).strategy
    assert strategy._engine_options()["gather_embedding_by_rows"] is False
    assert "gather_embedding_by_rows" not in FSDPStrategy()._engine_options()


def test_lightning_forms_of_the_arguments() -> None:
    """Lightning's and torch's forms: the objects are read by field, the engine gets its own forms."""
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    torch_config = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    strategy = FSDPStrategy(mixed_precision=torch_config, cpu_offload=CPUOffload(offload_params=True))
    assert strategy.mixed_precision_config is torch_config  # as Lightning reports it
    engine = strategy._engine_mixed_precision()
    assert (engine.param_dtype, engine.reduce_dtype, engine.buffer_dtype) == (torch.bfloat16, torch.float32, None)
    assert engine.cast_forward_inputs  # torch's cast_root_forward_inputs, on by default there
    assert strategy.cpu_offload is True and FSDPStrategy(cpu_offload=None).cpu_offload is False
    linear, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    strategy = FSDPStrategy(ignored_states=[linear, other.weight])
    assert (strategy.ignored_modules, strategy.ignored_params) == ([linear], [other.weight])
    with pytest.raises(ValueError) as error:
        FSDPStrategy(mixed_precision=TorchMixedPrecision(keep_low_precision_grads=True))
    assert "keep_low_precision_grads" in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"auto_wrap": True}, ["auto_wrap=True", "has no meaning for lightning_fsdp", "auto_wrap_policy"]),
        ({"ignored_modules": [torch.nn.Linear(2, 2)], "ignored_states": []}, ["ignored_states alone"]),
        ({"ignored_states": ["layer"]}, ["ignored_states holds a str"]),
        ({"device_id": "cuda"}, ["device_id must be a device index"]),
        ({"use_orig_params": "yes"}, ["use_orig_params must be True or False"]),
        ({"process_group": 3}, ["process_group must be one torch.distributed.ProcessGroup"]),
    ],
)
def test_lightning_arguments_are_checked(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        FSDPStrategy(**kwargs)
    assert_one_sentence(error, *fragments)


@pytest.mark.parametrize("strategy_class", [FSDPStrategy, FabricFSDPStrategy])
def test_kwargs_holds_the_torch_fsdp_keywords_given_as_lightning_keeps_them(strategy_class: type) -> None:
    assert dict(strategy_class().kwargs) == {"use_orig_params": True}
    assert strategy_class(use_orig_params=False).kwargs["use_orig_params"] is False
    init_fn = lambda module: None  # noqa: E731
    strategy = strategy_class(
        auto_wrap_policy={Block}, limit_all_gathers=False, param_init_fn=init_fn, sharding_strategy="SHARD_GRAD_OP"
    )
    assert dict(strategy.kwargs) == {
        "auto_wrap_policy": {Block},
        "limit_all_gathers": False,
        "param_init_fn": init_fn,
        "use_orig_params": True,
    }
    assert strategy_class(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 2)).kwargs["device_mesh"] == (1, 2)
    with pytest.raises(TypeError, match="strategy.kwargs is read-only; pass limit_all_gathers= to the strategy"):
        strategy.kwargs["limit_all_gathers"] = True


@pytest.mark.parametrize("strategy_class", [FSDPStrategy, FabricFSDPStrategy])
def test_the_kwargs_defaults_are_the_constructor_defaults(strategy_class: type) -> None:
    parameters = inspect.signature(strategy_class).parameters
    assert {name: parameters[name].default for name in TORCH_FSDP_DEFAULTS} == TORCH_FSDP_DEFAULTS


def test_the_default_units_are_the_repeated_blocks(caplog: pytest.LogCaptureFixture) -> None:
    from lightning_fsdp.demos.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2))
    with caplog.at_level("INFO"):
        assert FSDPStrategy()._wrap_policy(gpt) == {Block}
        assert FSDPStrategy()._wrap_policy(gpt) == {Block}  # told once per model class
    told = [r.getMessage() for r in caplog.records if "becomes a sharding unit" in r.getMessage()]
    assert len(told) == 1 and "lightning_fsdp.demos.gpt.Block" in told[0] and "whole_model" in told[0]
    assert FSDPStrategy(auto_wrap_policy="whole_model")._wrap_policy(gpt) is None
    assert FSDPStrategy()._wrap_policy(torch.nn.Linear(4, 4)) is None  # nothing repeated: one unit


def test_a_size_policy_that_selects_nothing_leaves_one_unit_with_a_warning() -> None:
    from functools import partial

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    strategy = FSDPStrategy(auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=int(1e8)))
    with pytest.warns(UserWarning, match="selects no submodule of Sequential, so the whole model is one unit"):
        assert strategy._wrap_policy(model) is None
    small = FSDPStrategy(auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=100))
    assert small._wrap_policy(model) is small.auto_wrap_policy  # selects the first Linear: kept as given
