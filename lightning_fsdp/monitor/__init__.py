"""Where a sharded run's step and memory go: ``FSDPMonitor``, a Trainer callback also driven by hand under Fabric.

``engine/diagnostics/step_stats.py`` counts what the engine's units move and how long they block; ``interval.py`` turns
every rank's counts into the split of a step; ``memory.py`` reads a rank's memory; ``advice.py`` says what to change;
``monitor.py`` times the steps, writes ``fsdp_monitor.jsonl`` and logs the metrics.
"""

from lightning_fsdp.monitor.monitor import FILE_NAME, METRICS, FSDPMonitor

__all__ = ["FILE_NAME", "METRICS", "FSDPMonitor"]
