"""``Fabric(precision=...)`` for the sharded model: the shared dtypes of each setting, behind Fabric's interface.

Fabric's precision plugins and the Trainer's differ in their hooks (Fabric's ``backward`` takes a plain module, its
``optimizer_step`` no closure), not in what each precision means. So :class:`FabricFSDPPrecision` keeps the
``PrecisionDtypes`` of ``adapter/precision.py`` for everything about dtypes -- the engine's ``MixedPrecision`` for
``"-mixed"``, the model's dtype for ``"-true"``, autocast in the step -- and adds Fabric's loss scaling around it:
``"16-mixed"`` scales with a :class:`~lightning_fsdp.ShardedGradScaler`, whose skip decision every rank shares.

Fabric builds its own plugin from ``Fabric(precision=...)`` before it knows the strategy's needs;
:func:`as_fabric_fsdp_precision` turns it into this one. Fabric turns ``precision="16-mixed"`` on the CPU into
``"bf16-mixed"`` (with a warning) before any strategy sees it; fp16 on the CPU needs
``Fabric(plugins=FabricFSDPPrecision("16-mixed"))``.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.adapter.precision import SUPPORTED_PRECISIONS, DtypesPrecision

__all__ = ["FabricFSDPPrecision", "as_fabric_fsdp_precision"]


class FabricFSDPPrecision(DtypesPrecision):
    """Fabric's precision plugin for :class:`~lightning_fsdp.FabricFSDPStrategy`.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        scaler: the loss scaler for ``"16-mixed"``; a :class:`ShardedGradScaler` with torch's defaults when None.
        device: the device type ``torch.autocast`` runs on under ``"-mixed"``; the strategy sets its own.
    """

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        step_output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]  # skipped on every rank alike
        self.scaler.update()
        return step_output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale before clipping; every rank agrees on inf/NaN here (see :class:`ShardedGradScaler`)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)


def as_fabric_fsdp_precision(plugin: Precision) -> FabricFSDPPrecision:
    """The :class:`FabricFSDPPrecision` equivalent of the plugin Fabric built from ``Fabric(precision=...)``.

    Only Fabric's generic plugins are translated (full, AMP-style mixed, half); a plain ``GradScaler`` of a
    ``"16-mixed"`` plugin is replaced by a sharded one (ranks would otherwise skip different steps). Any other plugin
    would manage dtypes behind the engine's back, so it is refused with the supported list.
    """
    if isinstance(plugin, FabricFSDPPrecision):
        return plugin
    precision = str(getattr(plugin, "precision", "unknown"))
    generic = type(plugin) in (Precision, MixedPrecision, HalfPrecision)
    if generic and precision in SUPPORTED_PRECISIONS:
        return FabricFSDPPrecision(precision, device=getattr(plugin, "device", None))  # type: ignore[arg-type]
    raise ValueError(
        f"Fabric(precision={precision!r}) (plugin {type(plugin).__name__}) cannot drive a model sharded by "
        f"lightning_fsdp; use one of {', '.join(map(repr, SUPPORTED_PRECISIONS))}, or pass FabricFSDPPrecision(...) "
        "in plugins=."
    )
