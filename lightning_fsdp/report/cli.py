"""``lightning-fsdp report RUN_DIR``: argparse rather than LightningCLI, since it builds no Trainer."""

from __future__ import annotations

import argparse

from lightning_fsdp.report.data import MONITOR_FILE, ReportError
from lightning_fsdp.report.html import REPORT_FILE, write_report

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-fsdp report",
        description=f"Write one self-contained HTML page about a sharded run from the {MONITOR_FILE} that "
        "lightning_fsdp.FSDPMonitor wrote (and the CSVLogger's metrics.csv beside it, when there is one): step "
        "time breakdown and loss, memory per rank, communication per unit, stragglers and the monitor's warnings.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's logger folder, e.g. runs/demo/version_0")
    parser.add_argument(
        "--out",
        default=None,
        help=f"where to write the page (default: RUN_DIR/{REPORT_FILE}); an existing file is replaced only if it "
        "is a report written by this command",
    )
    options = parser.parse_args(argv)
    try:
        path = write_report(options.run_dir, options.out)
    except (OSError, ReportError) as err:
        parser.exit(2, f"lightning-fsdp report: error: {err}\n")
    print(f"report: {path.resolve()}")
