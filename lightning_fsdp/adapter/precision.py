"""What each ``precision`` setting means for a sharded model, shared by the Trainer's plugin and Fabric's.

Lightning's two precision interfaces differ in their hooks (the Trainer's ``optimizer_step`` takes a closure,
Fabric's ``backward`` a plain module), not in what a precision means; :class:`PrecisionDtypes` is that meaning, and
``trainer/precision.py`` and ``fabric/precision.py`` each put it behind their framework's plugin:

- ``"32-true"``: everything fp32; no engine policy.
- ``"bf16-mixed"`` / ``"16-mixed"``: the engine gathers parameters, reduces gradients and keeps buffers in the
  half type, while the sharded parameters the optimizer steps stay fp32 (master weights). Floating-point inputs of
  every unit are cast to the half type (torch FSDP's ``cast_root_forward_inputs``), and the step runs under
  ``torch.autocast`` in the half type. ``"16-mixed"`` also scales the loss with :class:`ShardedGradScaler`.
- ``"bf16-true"`` / ``"16-true"``: the model itself is converted to the half type; no master weights.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.engine import MixedPrecision as EngineMixedPrecision

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
SUPPORTED_PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
_HALF_TYPES = {"bf16": torch.bfloat16, "16": torch.float16}


class ShardedGradScaler(torch.amp.GradScaler):
    """A loss scaler whose skip decision is the same on every rank.

    Each rank only sees the gradient rows of its own shards, so an inf or NaN can show up on one rank alone. Plain
    ``GradScaler`` would then skip the step there and take it everywhere else, and the shards of one parameter
    would drift apart. Here the found-inf flags are all-reduced (max) over ``process_group`` right after unscaling,
    so every rank skips the same steps and backs off its scale alike. (torch's FSDP ``ShardedGradScaler`` does the
    same; ours relies on the optimizer's gradients being plain local tensors, which the engine guarantees.)

    Args:
        device: where the scale lives; ``"cuda"`` when CUDA is available, else ``"cpu"``. torch's scaler disables
            itself if asked for ``"cuda"`` on a machine without it.
        process_group: the ranks that must agree; the default group when None.
        **kwargs: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``enabled``.
    """

    def __init__(
        self, device: str | None = None, process_group: dist.ProcessGroup | None = None, **kwargs: Any
    ) -> None:
        super().__init__(device or ("cuda" if torch.cuda.is_available() else "cpu"), **kwargs)
        self.process_group = process_group

    @override
    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        if not self.is_enabled() or not (dist.is_available() and dist.is_initialized()):
            return
        found_per_device = self._found_inf_per_device(optimizer)
        assert self._scale is not None  # set by the first scale(); unscale_ above checked it
        agreed = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for found in found_per_device.values():
            agreed = torch.maximum(agreed, found.to(agreed.device))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.process_group)
        for found in found_per_device.values():
            found.copy_(agreed)


class PrecisionDtypes:
    """The dtypes of one ``precision`` setting (see the module docstring) and the contexts and casts they need.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        scaler: the loss scaler for ``"16-mixed"``; a :class:`ShardedGradScaler` with torch's defaults when None.
        device: the device type ``torch.autocast`` runs on under ``"-mixed"``; the strategy sets its own at setup.
    """

    def __init__(
        self, precision: PrecisionName, scaler: ShardedGradScaler | None = None, device: str | None = None
    ) -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(unsupported(precision))
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} does not scale the loss; pass scaler only with '16-mixed'.")
        self.precision = precision
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.scaler = scaler if scaler is not None or precision != "16-mixed" else ShardedGradScaler()
        half_name, _, kind = precision.partition("-")
        self._half_dtype = _HALF_TYPES.get(half_name)
        # The dtype the model's own tensors have: the half type only for "-true"; "-mixed" keeps fp32 masters.
        self._model_dtype = self._half_dtype if kind == "true" and self._half_dtype is not None else torch.float32

    @property
    def mixed_precision_config(self) -> EngineMixedPrecision:
        """The dtypes parameters are computed in, gradients reduced in and buffers kept in, as Lightning's plugin
        reports them: the half type for ``"bf16-*"`` and ``"16-*"``, fp32 for ``"32-true"``."""
        dtype = self._half_dtype or torch.float32
        return EngineMixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)

    @property
    def engine_mixed_precision(self) -> EngineMixedPrecision | None:
        """The engine policy for ``"-mixed"``: gather, reduce and keep buffers in the half type, casting units'
        floating-point inputs to it. None otherwise: under ``"-true"`` the model itself already has the dtype."""
        if self._half_dtype is None or not self.precision.endswith("-mixed"):
            return None
        dtype = self._half_dtype
        return EngineMixedPrecision(dtype, dtype, dtype, cast_forward_inputs=True)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self._model_dtype) if self._model_dtype is not torch.float32 else module

    def model_dtype_context(self) -> AbstractContextManager:
        """New floating-point tensors take the model's dtype (``"-true"``)."""
        return _default_dtype(self._model_dtype) if self._model_dtype is not torch.float32 else nullcontext()

    def forward_context(self) -> AbstractContextManager:
        """``"-mixed"``: autocast, as Lightning's FSDP plugin, for the ops that mix the half weights with fp32 tensors
        the step makes itself (targets, masks). ``"-true"``: new tensors made inside the step take the model's dtype."""
        if self._half_dtype is not None and self.precision.endswith("-mixed"):
            return torch.autocast(self.device, dtype=self._half_dtype)
        return self.model_dtype_context()

    def convert_input(self, data: Any) -> Any:
        if self._model_dtype is torch.float32:
            return data
        return apply_to_collection(data, Tensor, _cast_floating, self._model_dtype)

    def convert_output(self, data: Any) -> Any:
        if self._model_dtype is torch.float32:
            return data
        return apply_to_collection(data, Tensor, _cast_floating, torch.get_default_dtype())

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)


class DtypesPrecision(FabricPrecision):
    """The hooks of Lightning's precision plugin that only concern dtypes, answered by one :class:`PrecisionDtypes`:
    the same for the Trainer's plugin (whose base class extends Fabric's) and Fabric's, which add their own loss
    scaling and clipping.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        scaler: the loss scaler for ``"16-mixed"``; a :class:`ShardedGradScaler` with torch's defaults when None.
        device: the device type ``torch.autocast`` runs on under ``"-mixed"``; the strategy sets its own at setup.
    """

    def __init__(
        self, precision: PrecisionName, scaler: ShardedGradScaler | None = None, device: str | None = None
    ) -> None:
        self._dtypes = PrecisionDtypes(precision, scaler, device)  # validates; the one definition of each setting
        self.precision = precision  # type: ignore[assignment]
        self.scaler = self._dtypes.scaler

    @property
    def device(self) -> str:
        return self._dtypes.device

    @device.setter
    def device(self, device: str) -> None:
        self._dtypes.device = device

    @property
    def mixed_precision_config(self) -> EngineMixedPrecision:
        """The dtypes parameters are computed in, gradients reduced in and buffers kept in (as Lightning reports)."""
        return self._dtypes.mixed_precision_config

    @property
    def engine_mixed_precision(self) -> EngineMixedPrecision | None:
        """The engine policy for ``"-mixed"``; None under ``"-true"``, where the model itself has the dtype."""
        return self._dtypes.engine_mixed_precision

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self._dtypes.convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self._dtypes.model_dtype_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self._dtypes.model_dtype_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self._dtypes.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self._dtypes.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self._dtypes.convert_output(data)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._dtypes.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._dtypes.load_state_dict(state_dict)


def unsupported(precision: object) -> str:
    return (
        f"precision={precision!r} is not supported by lightning_fsdp's FSDPStrategy; use one of "
        f"{', '.join(map(repr, SUPPORTED_PRECISIONS))}."
    )


def _cast_floating(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """Make ``dtype`` the default for new floating-point tensors inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
