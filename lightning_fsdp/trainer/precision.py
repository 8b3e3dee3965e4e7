"""``Trainer(precision=...)`` for the sharded model: :class:`FSDPPrecision`, Lightning's plugin interface over the
dtypes that ``adapter/precision.py`` gives each setting, with the Trainer's own hooks (loss scaling around the
closure, clipping over shards).

Lightning builds its own precision plugin from the ``precision`` flag before it knows the strategy's needs;
:class:`~lightning_fsdp.FSDPStrategy` turns that plugin into an :class:`FSDPPrecision` with
:func:`as_fsdp_precision`, the way Lightning's own FSDP strategy insists on its ``FSDPPrecision``.
Lightning turns ``Trainer(precision="16-mixed", accelerator="cpu")`` into ``"bf16-mixed"`` (with a warning) before
any strategy sees it; fp16 on CPU needs ``FSDPStrategy(precision_plugin=FSDPPrecision("16-mixed"))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.adapter.precision import (
    SUPPORTED_PRECISIONS,
    DtypesPrecision,
    ShardedGradScaler,
    unsupported,
)
from lightning_fsdp.engine import clip_grad_norm_, clip_grad_value_

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FSDPPrecision", "ShardedGradScaler", "as_fsdp_precision"]


class FSDPPrecision(DtypesPrecision, Precision):
    """Lightning's precision plugin for :class:`~lightning_fsdp.FSDPStrategy` (what each setting means:
    ``adapter/precision.py``).

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        scaler: the loss scaler for ``"16-mixed"``; a :class:`ShardedGradScaler` with torch's defaults when None.
        device: the device type ``torch.autocast`` runs on under ``"-mixed"``; the strategy sets its own at setup.
    """

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # Unscale before the user's hook and clipping see the gradients; every rank agrees on inf/NaN here.
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return closure_result  # the training step skipped backward: nothing to step
        step_output = self.scaler.step(optimizer, **kwargs)  # skipped on every rank alike when any found inf
        self.scaler.update()
        return step_output

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of the whole, unsharded gradient (``torch.nn.utils.clip_grad_norm_`` on shards would
        clip every rank by its own piece's norm)."""
        clip_grad_norm_(list(self.main_params(optimizer)), clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_value_(list(self.main_params(optimizer)), clip_val)


def as_fsdp_precision(plugin: Precision) -> FSDPPrecision:
    """The :class:`FSDPPrecision` equivalent of the plugin Lightning built from ``Trainer(precision=...)``.

    Only Lightning's generic plugins are translated (full, AMP-style mixed, half); any other plugin would manage
    dtypes behind the engine's back, so it is refused with the supported list.
    """
    if isinstance(plugin, FSDPPrecision):
        return plugin
    precision = str(getattr(plugin, "precision", "unknown"))
    generic = type(plugin) in (Precision, MixedPrecision, HalfPrecision)
    if generic and precision in SUPPORTED_PRECISIONS:
        return FSDPPrecision(precision)  # type: ignore[arg-type]
    if generic or precision not in SUPPORTED_PRECISIONS:
        raise ValueError(unsupported(precision))
    raise ValueError(
        f"the precision plugin {type(plugin).__name__} cannot drive a model sharded by lightning_fsdp; set "
        f"Trainer(precision=...) to one of {', '.join(map(repr, SUPPORTED_PRECISIONS))} instead."
    )
