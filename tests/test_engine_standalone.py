"""The engine imports torch only, and ``import lightning_fsdp`` still registers the strategy names with Lightning.

Each case runs in a fresh interpreter: this test process has imported Lightning long ago.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LIGHTNING_MODULES = "sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))"

ENGINE_ALONE = f"""
import sys
import lightning_fsdp.engine
from lightning_fsdp.engine import fully_shard
from lightning_fsdp import MixedPrecision, clip_grad_norm_
assert {LIGHTNING_MODULES} == [], {LIGHTNING_MODULES}
import lightning_fsdp
assert {LIGHTNING_MODULES} == [], "import lightning_fsdp alone imports no Lightning either"
from lightning_fsdp import FSDPStrategy  # loads Lightning from inside our own module: registers without a cycle
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
for name, strategy, cpu_offload in (("myfsdp", "FULL_SHARD", False), ("myfsdp_shard_grad_op", "SHARD_GRAD_OP", False),
                                    ("myfsdp_cpu_offload", "FULL_SHARD", True)):
    built = StrategyRegistry.get(name)
    assert type(built) is FSDPStrategy, (name, built)
trainer = Trainer(strategy="myfsdp", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
assert type(trainer.strategy) is FSDPStrategy, trainer.strategy
"""

# One of our Lightning-dependent modules imported first: it imports Lightning while half-initialised itself, and the
# registration that runs inside that import must not import it again.
OUR_LIGHTNING_MODULE_FIRST = """
from lightning_fsdp.precision import FSDPPrecision
from lightning_fsdp.averaging import ShardedEMA
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from lightning_fsdp import FabricFSDPStrategy, FSDPStrategy
assert type(StrategyRegistry.get("myfsdp")) is FSDPStrategy
assert type(STRATEGY_REGISTRY.get("myfsdp_cpu_offload")) is FabricFSDPStrategy
"""

LIGHTNING_FIRST = """
from lightning.pytorch.strategies import StrategyRegistry
assert "myfsdp" not in StrategyRegistry
import lightning_fsdp
assert "myfsdp" in StrategyRegistry, "registered at once when Lightning is already loaded"
"""


def _run(code: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_engine_imports_no_lightning_and_the_package_registers_the_strategy_names() -> None:
    _run(ENGINE_ALONE)
    _run(OUR_LIGHTNING_MODULE_FIRST)
    _run(LIGHTNING_FIRST)
