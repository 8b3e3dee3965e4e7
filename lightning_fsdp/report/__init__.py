"""A sharded run's report: one HTML page from the monitor's ``fsdp_monitor.jsonl`` and the logger's ``metrics.csv``.

``data`` reads and checks the files into dataclasses, ``html`` draws the page and writes it, ``cli`` is
``lightning-fsdp report RUN_DIR``. ``lightning-fsdp fit`` writes the report itself after training when the run
had the monitor (``lightning_fsdp/cli.py``).
"""

from lightning_fsdp.report.cli import main
from lightning_fsdp.report.data import MONITOR_FILE, ReportError, RunRecord, load_run
from lightning_fsdp.report.html import REPORT_FILE, render_html, write_report

__all__ = ["MONITOR_FILE", "REPORT_FILE", "ReportError", "RunRecord", "load_run", "main", "render_html", "write_report"]
