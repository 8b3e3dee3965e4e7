"""Our FSDP engine against torch's FSDP2 and DDP: step time, memory, communication and loss, on one machine.

The code is the package ``benchmarks/engine_bench`` (its docstring, printed by ``--help``, says how and why it
measures); this script is its command line, runnable from a checkout without installing the package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# Run as a script (`python benchmarks/bench_engine.py`) from a checkout where the package is not installed:
# make the repository root importable, as `pip install -e .` would. The benchmarks folder (sys.path[0]) holds
# engine_bench, and spawned ranks inherit both.
if importlib.util.find_spec("lightning_fsdp") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_bench.main import main  # noqa: E402

if __name__ == "__main__":
    main()
