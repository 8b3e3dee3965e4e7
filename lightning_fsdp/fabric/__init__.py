"""Lightning Fabric on our engine: ``Fabric(strategy="myfsdp")`` and its precision plugin.

``import lightning_fsdp`` registers the strategy names with Fabric's registry as it does with the Trainer's.
"""

from lightning_fsdp.fabric.precision import FabricFSDPPrecision
from lightning_fsdp.fabric.strategy import FabricFSDPStrategy

__all__ = ["FabricFSDPPrecision", "FabricFSDPStrategy"]
