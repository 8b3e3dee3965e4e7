"""The engine imports torch only, and ``import lightning_fsdp`` still registers the strategy names with Lightning.

Each case runs in a fresh interpreter: this test process has imported Lightning long ago. The three run at once:
each spends its time importing on one core.
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
assert all(StrategyRegistry[name]["strategy"] is FSDPStrategy for name in ("myfsdp", "myfsdp_cpu_offload"))
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
from lightning_fsdp.trainer.precision import FSDPPrecision
from lightning_fsdp.averaging import ShardedEMA
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from lightning_fsdp import FabricFSDPStrategy, FSDPStrategy
assert type(StrategyRegistry.get("myfsdp")) is FSDPStrategy
assert type(STRATEGY_REGISTRY.get("myfsdp_cpu_offload")) is FabricFSDPStrategy
assert StrategyRegistry["myfsdp"]["strategy"] is FSDPStrategy, "the class, as Lightning registers its own"
assert STRATEGY_REGISTRY["myfsdp_cpu_offload"]["strategy"] is FabricFSDPStrategy
assert STRATEGY_REGISTRY["myfsdp_cpu_offload"]["init_params"] == {"cpu_offload": True}
"""

LIGHTNING_FIRST = """
from lightning.pytorch.strategies import StrategyRegistry
assert "myfsdp" not in StrategyRegistry
import sys
import lightning_fsdp
assert "myfsdp" in StrategyRegistry, "registered at once when Lightning is already loaded"
assert "lightning_fsdp.trainer.strategy" not in sys.modules
registered = StrategyRegistry["myfsdp_shard_grad_op"]["strategy"]  # imports the class on first read
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import Trainer
from lightning_fsdp import FabricFSDPStrategy, FSDPStrategy
assert registered is FSDPStrategy and STRATEGY_REGISTRY["myfsdp"]["strategy"] is FabricFSDPStrategy
assert StrategyRegistry["myfsdp_shard_grad_op"]["init_params"] == {"sharding_strategy": "SHARD_GRAD_OP"}
trainer = Trainer(strategy="myfsdp_cpu_offload", accelerator="cpu", devices=1, logger=False)
assert isinstance(trainer.strategy, StrategyRegistry["myfsdp_cpu_offload"]["strategy"]) and trainer.strategy.cpu_offload
"""


def _start(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_engine_imports_no_lightning_and_the_package_registers_the_strategy_names() -> None:
    cases = {"engine alone": ENGINE_ALONE, "ours first": OUR_LIGHTNING_MODULE_FIRST, "Lightning first": LIGHTNING_FIRST}
    processes = {label: _start(code) for label, code in cases.items()}
    try:
        for label, process in processes.items():
            _, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, f"{label}:\n{stderr[-3000:]}"
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
