"""Lightning 2.6.5's ``tests/tests_pytorch/plugins/precision/test_fsdp.py``, ported to ``lightning_fsdp.FSDPPrecision``.

Mechanical changes:

- ``from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision`` -> ``from lightning_fsdp import
  FSDPPrecision``; torch's ``ShardedGradScaler`` -> ours (``lightning_fsdp.ShardedGradScaler``, which agrees on
  skipped steps over the shard group).
- The forward-context tests ran on CUDA (``RunIf(min_cuda_gpus=1)``); here the autocast device is the CPU, read with
  ``torch.get_autocast_dtype("cpu")``. ``_DtypeContextManager`` (a Lightning internal) -> the default dtype inside.
- Expected error messages: ours (wording, one line each where it differs).
Deliberate differences are marked ``# deliberate:`` with one line of why.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest.mock import ANY, MagicMock, Mock

import pytest
import torch

from lightning_fsdp import FSDPPrecision, ShardedGradScaler


@contextmanager
def null_ctx(*args, **kwargs):
    yield


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("16-true", (torch.float16, torch.float16, torch.float16)),
        ("bf16-true", (torch.bfloat16, torch.bfloat16, torch.bfloat16)),
        ("16-mixed", (torch.float16, torch.float16, torch.float16)),
        ("bf16-mixed", (torch.bfloat16, torch.bfloat16, torch.bfloat16)),
        ("32-true", (torch.float32, torch.float32, torch.float32)),
    ],
)
def test_fsdp_precision_config(precision, expected):
    plugin = FSDPPrecision(precision=precision)
    # deliberate: no "enables computation in lower precision" warning for "-true": we keep no fp32 copy to warn about.
    config = plugin.mixed_precision_config
    assert config.param_dtype == expected[0]
    assert config.buffer_dtype == expected[1]
    assert config.reduce_dtype == expected[2]


@pytest.mark.parametrize(
    ("precision", "expected_dtype"),
    [
        ("32-true", torch.float32),
        ("bf16-mixed", torch.float32),
        ("16-mixed", torch.float32),
        ("bf16-true", torch.bfloat16),
        ("16-true", torch.float16),
    ],
)
def test_convert_module(precision, expected_dtype):
    precision = FSDPPrecision(precision=precision)
    module = torch.nn.Linear(2, 2)
    assert module.weight.dtype == module.bias.dtype == torch.float32
    module = precision.convert_module(module)
    assert module.weight.dtype == module.bias.dtype == expected_dtype


@pytest.mark.parametrize(
    ("precision", "expected_dtype"),
    [
        ("32-true", torch.float32),
        ("bf16-mixed", torch.float32),
        ("16-mixed", torch.float32),
        ("bf16-true", torch.bfloat16),
        ("16-true", torch.float16),
    ],
)
def test_module_init_context(precision, expected_dtype):
    plugin = FSDPPrecision(precision=precision)
    assert torch.get_default_dtype() == torch.float32
    with plugin.module_init_context():
        assert torch.get_default_dtype() == expected_dtype
    assert torch.get_default_dtype() == torch.float32


def test_fsdp_precision_default_scaler():
    precision = FSDPPrecision(precision="16-mixed")
    assert isinstance(precision.scaler, ShardedGradScaler)


def test_fsdp_precision_scaler_with_bf16():
    with pytest.raises(ValueError, match="precision='bf16-mixed' does not scale the loss"):  # wording
        FSDPPrecision(precision="bf16-mixed", scaler=Mock())

    precision = FSDPPrecision(precision="bf16-mixed")
    assert precision.scaler is None


def test_fsdp_precision_forward_context_f16():
    precision = FSDPPrecision(precision="16-mixed", device="cpu")
    assert isinstance(precision.scaler, ShardedGradScaler)
    assert torch.get_default_dtype() == torch.float32
    with precision.forward_context():
        assert torch.get_autocast_dtype("cpu") == torch.float16
        assert torch.is_autocast_enabled("cpu")
    assert isinstance(precision.forward_context(), torch.autocast)
    assert precision.forward_context().fast_dtype == torch.float16

    precision = FSDPPrecision(precision="16-true")
    assert precision.scaler is None
    assert torch.get_default_dtype() == torch.float32
    with precision.forward_context():
        assert torch.get_default_dtype() == torch.float16
    assert torch.get_default_dtype() == torch.float32


def test_fsdp_precision_forward_context_bf16():
    precision = FSDPPrecision(precision="bf16-mixed", device="cpu")
    assert precision.scaler is None
    with precision.forward_context():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert isinstance(precision.forward_context(), torch.autocast)
    assert precision.forward_context().fast_dtype == torch.bfloat16

    precision = FSDPPrecision(precision="bf16-true")
    assert precision.scaler is None
    with precision.forward_context():  # forward context is not using autocast ctx manager
        assert torch.get_default_dtype() == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")


def test_fsdp_precision_backward():
    precision = FSDPPrecision(precision="16-mixed")
    precision.scaler = Mock()
    precision.scaler.scale = Mock(side_effect=(lambda x: x))
    tensor = Mock()
    model = Mock(trainer=Mock(callbacks=[], profiler=MagicMock()))
    precision.pre_backward(tensor, model)
    precision.backward(tensor, model, None, "positional-arg", keyword="arg")
    precision.scaler.scale.assert_called_once_with(tensor)
    model.backward.assert_called_once_with(tensor, "positional-arg", keyword="arg")


def test_fsdp_precision_optimizer_step_with_scaler():
    precision = FSDPPrecision(precision="16-mixed")
    precision.scaler = Mock()
    model = Mock(trainer=Mock(callbacks=[], profiler=MagicMock()))
    optimizer = Mock()
    closure = Mock()

    precision.optimizer_step(optimizer, model, closure, keyword="arg")
    precision.scaler.step.assert_called_once_with(optimizer, keyword="arg")
    precision.scaler.update.assert_called_once()


def test_fsdp_precision_optimizer_step_without_scaler():
    precision = FSDPPrecision(precision="bf16-mixed")
    assert precision.scaler is None
    model = Mock(trainer=Mock(callbacks=[], profiler=MagicMock()))
    optimizer = Mock()
    closure = Mock()

    precision.optimizer_step(optimizer, model, closure, keyword="arg")
    optimizer.step.assert_called_once_with(closure=ANY, keyword="arg")


def test_invalid_precision_with_fsdp_precision():
    FSDPPrecision("16-mixed")
    FSDPPrecision("bf16-mixed")

    with pytest.raises(ValueError, match="precision='64-true' is not supported by lightning_fsdp"):  # wording
        FSDPPrecision(precision="64-true")
