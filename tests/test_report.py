"""``lightning-fsdp report``: the monitor's file read into data, the page it makes, and that page in a real browser.

The run folders are written here by hand in the monitor's format (the contract ``lightning_fsdp.FSDPMonitor``
writes), with the numbers chosen so each section's figures can be checked: rank 1 is the slowest in six of eight
intervals, the third unit's name needs escaping, the last line is cut off as a killed run leaves it. The browser
test renders the written page in headless Chromium, as someone opening the file would, and checks what it drew.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from matplotlib.image import imread

from lightning_fsdp.cli import main as cli_main
from lightning_fsdp.cli import report_artifacts
from lightning_fsdp.monitor import FSDPMonitor
from lightning_fsdp.report import REPORT_FILE, ReportError, load_run, render_html, write_report

UNITS = ["transformer.h.0", "transformer.h.1", "<root & friends>"]
STEPS = [10 * i for i in range(1, 9)]
SECTIONS = ["summary", "step-time", "memory", "communication", "stragglers", "warnings"]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def header(**changes: object) -> dict:
    line = {
        "kind": "run",
        "version": 1,
        "world_size": 2,
        "hosts": ["node-a", "node-a"],
        "units": UNITS,
        "parameters": 812345,
        "estimate_bytes_per_rank": 60_000_000,
        "device": "cpu",
        "every_n_steps": 10,
        "flops_per_sample": None,
        "peak_flops": None,
        "started": 1_700_000_000.0,
        "written_by_a_newer_monitor": {"ignored": True},
    }
    return {**line, **changes}


def interval(index: int) -> dict:
    """Interval ``index`` (1-based): rank 1 is the straggler except in every third interval."""
    ranks = [
        {
            "rank": rank,
            "step_s": 0.150,
            "compute_s": 0.080 + 0.010 * rank,
            "exposed_comm_s": 0.030,
            "peer_wait_s": 0.020 if rank == 0 else 0.0,
            "peak_bytes": 50_000_000 + 1_000_000 * index + 3_000_000 * rank,
            "resident_bytes": 30_000_000,
            "limit_bytes": 70_000_000,
            "samples_per_s": 100.0,
            "tokens_per_s": None,
        }
        for rank in range(2)
    ]
    return {
        "kind": "interval",
        "step": 10 * index,
        "steps": 10,
        "time": 1_700_000_000.0 + index,
        "ranks": ranks,
        "units": {
            name: {"gathered_bytes": 2**20 * (k + 1), "reduced_bytes": 2**19 * (k + 1)} for k, name in enumerate(UNITS)
        },
        "transports": {"shm": {"gathered_bytes": 6 * 2**20, "reduced_bytes": 3 * 2**20}},
        "straggler": {"rank": 0 if index % 3 == 0 else 1, "slower_by_s": 0.010 * index, "slower_by": 0.05 * index},
        "samples_per_s": 200.0,
        "tokens_per_s": None,
        "mfu": None,
    }


def write_run(folder: Path, lines: list[dict] | None = None, *, tail: str = "", metrics: bool = True) -> Path:
    """A run folder as the monitor and the CSVLogger leave it; ``tail`` is appended raw after the last line."""
    folder.mkdir(parents=True, exist_ok=True)
    if lines is None:
        lines = [header(), *(interval(i) for i in range(1, 5))]
        lines.append({"kind": "warning", "step": 40, "code": "straggler", "message": "rank 1 is <b>slower</b> by 20%"})
        lines += [interval(i) for i in range(5, 9)]
    text = "".join(json.dumps(line) + "\n" for line in lines) + tail
    (folder / "fsdp_monitor.jsonl").write_text(text)
    if metrics:
        rows = ["epoch,step,train_loss,val_loss,fsdp/gathered_bytes"]
        rows += [f"0,{step},{3.0 - step / 100},,1024" for step in range(0, 80, 5)]
        rows += [f"0,{step},,{3.1 - step / 100}," for step in (39, 79)]
        (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    return folder


# ---- the data layer ----------------------------------------------------------------------------------------


def test_load_run_reads_every_kind_and_skips_a_cut_off_last_line(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", tail='{"kind": "interval", "step": 9'))
    assert run.header.world_size == 2 and run.header.units == tuple(UNITS) and run.header.peak_flops is None
    assert [i.step for i in run.intervals] == STEPS
    assert run.unreadable_lines == (11,)  # header, 8 intervals, a warning, then the cut-off line
    first = run.intervals[0]
    assert first.ranks[1].compute_s == pytest.approx(0.090) and first.ranks[1].tokens_per_s is None
    assert first.units["<root & friends>"].reduced_bytes == 3 * 2**19
    assert first.straggler is not None and first.straggler.rank == 1
    assert [(w.step, w.code) for w in run.warnings] == [(40, "straggler")]
    assert sorted(run.losses) == ["train_loss", "val_loss"]
    assert run.losses["val_loss"] == ((39, pytest.approx(2.71)), (79, pytest.approx(2.31)))


def test_a_run_without_metrics_csv_or_nullable_fields_still_reports(tmp_path: Path) -> None:
    sparse = interval(1)
    sparse.update(straggler=None, units=None, transports={})
    sparse["ranks"][0].update(peak_bytes=None, limit_bytes=None, compute_s=None)
    sparse["ranks"][1].update(limit_bytes=2**40)  # a CPU rank's share of a large host: far above its peak
    folder = write_run(tmp_path / "run", [header(estimate_bytes_per_rank=None, hosts=None), sparse], metrics=False)
    run = load_run(folder)
    assert run.losses == {} and run.intervals[0].straggler is None and run.intervals[0].units == {}
    page = render_html(run)
    assert "no metrics.csv beside the monitor file" in page
    assert "No interval named a slowest rank" in page and "No traffic was recorded" in page
    assert "Not drawn, more than 4 times the highest peak: limit 1.0 TiB." in page


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (None, r"has no fsdp_monitor.jsonl: pass the logger's folder of a run trained with the .*FSDPMonitor"),
        ([], r"does not start with a run header line .* not written by lightning_fsdp.FSDPMonitor"),
        ([interval(1), header()], r"does not start with a run header line"),
        ([header(version=2)], r"is in monitor format version 2, but this lightning_fsdp reads version 1 only"),
    ],
    ids=["no-monitor-file", "empty", "interval-first", "unknown-version"],
)
def test_what_is_not_a_monitor_file_is_refused_in_one_sentence(tmp_path: Path, lines, expected, capsys) -> None:
    folder = tmp_path / "run"
    if lines is None:
        folder.mkdir()
    else:
        write_run(folder, lines)
    with pytest.raises(ReportError, match=expected):
        load_run(folder)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["report", str(folder)])
    assert exit_info.value.code == 2
    assert re.search(r"lightning-fsdp report: error: .*" + expected, capsys.readouterr().err)
    assert not (folder / REPORT_FILE).exists()


def test_a_report_replaces_its_own_page_but_never_a_foreign_file(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run")
    page = write_report(folder)
    assert page == folder / REPORT_FILE and page.stat().st_mode & 0o777 == 0o644
    page.write_text(page.read_text().replace("FSDP report", "an older report"))
    write_report(folder)
    assert "an older report" not in page.read_text()
    foreign = tmp_path / "notes.html"
    foreign.write_text("<html>my own notes</html>")
    with pytest.raises(ReportError, match=r"notes.html exists and is not a report written by lightning-fsdp report"):
        write_report(folder, foreign)
    assert foreign.read_text() == "<html>my own notes</html>"
    assert sorted(p.name for p in folder.iterdir()) == ["fsdp_monitor.jsonl", REPORT_FILE, "metrics.csv"]


# ---- the page ----------------------------------------------------------------------------------------------


def test_the_page_holds_every_section_with_the_runs_numbers(tmp_path: Path) -> None:
    page = render_html(load_run(write_run(tmp_path / "run")))
    for section in SECTIONS:
        assert f'<section id="{section}">' in page
    assert page.count("<svg") == 4  # step time + loss, memory, units, transports
    assert "812,345" in page and "node-a (ranks 0, 1)" in page and "1 to 80 (8 intervals, one every 10 steps)" in page
    # Escaped wherever a name from the file appears: tables, chart labels, warnings.
    assert "<root & friends>" not in page and "<b>slower</b>" not in page
    assert page.count("&lt;root &amp; friends&gt;") >= 2 and "&lt;b&gt;slower&lt;/b&gt;" in page
    # The per-unit table: the third unit moves 3 MiB gathered and 1.5 MiB reduced per step.
    assert _row(page, "&lt;root &amp; friends&gt;") == ["&lt;root &amp; friends&gt;", "3.0 MiB", "1.5 MiB"]
    # Stragglers: rank 1 was slowest in 6 of 8 intervals, leading by 45 ms on average and by 40% at most.
    assert _row(page, "6 of 8") == ["1", "6 of 8", "45.0 ms", "40.0%"]
    assert _row(page, "2 of 8") == ["0", "2 of 8", "45.0 ms", "30.0%"]
    assert _row(page, "15.0%") == ["30", "0", "30.0 ms", "15.0%"]
    # Memory at the last interval: rank 1 peaked at 61 MB of a 70 MB limit.
    assert _row(page, "87.1%") == ["1", "58.2 MiB", "28.6 MiB", "66.8 MiB", "87.1%"]
    assert "1 × <code>straggler</code>" in page
    # Nothing is fetched when the page is viewed.
    assert not re.search(r"<script|<link|<img[^>]+src=\"?http|@import|url\(\s*['\"]?http", page)


def _row(page: str, cell: str) -> list[str]:
    """The cells of the first table row that has a cell equal to ``cell``."""
    for row in re.findall(r"<tr>(.*?)</tr>", page):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        if cell in cells:
            return cells
    raise AssertionError(f"no table row has a cell {cell!r}")


def test_cli_writes_where_out_says_and_fit_reports_a_monitored_run(tmp_path: Path, capsys) -> None:
    folder = write_run(tmp_path / "run")
    out = tmp_path / "elsewhere.html"
    cli_main(["report", str(folder), "--out", str(out)])
    assert capsys.readouterr().out == f"report: {out.resolve()}\n" and out.is_file()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["report", "--help"])
    assert exit_info.value.code == 0 and "usage: lightning-fsdp report" in capsys.readouterr().out

    # After fit: the report of a monitored run, and none without a monitor even where a stale record lies.
    for callbacks, expected in (([FSDPMonitor()], f"report: {(folder / REPORT_FILE).resolve()}"), ([], None)):
        trainer = SimpleNamespace(
            log_dir=str(folder), is_global_zero=True, checkpoint_callback=None, callbacks=callbacks
        )
        report_artifacts(trainer)
        lines = capsys.readouterr().out.splitlines()
        assert lines[1] == f"logs: {folder.resolve()}"
        assert lines[2:] == ([expected] if expected else [])


# ---- in a browser ------------------------------------------------------------------------------------------

# Appended to a copy of the page only: the report itself has no scripts. It writes each chart's laid-out size
# into the DOM, which --dump-dom then shows.
MEASURE = """<script>
for (const node of document.querySelectorAll("figure svg, section")) {
  const box = node.getBoundingClientRect();
  node.setAttribute("data-rendered", Math.round(box.width) + "x" + Math.round(box.height));
}
</script>"""


def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "no Chromium found (looked for chromium, chromium-browser, google-chrome on PATH): the report's browser test "
        "needs one. On Debian/Ubuntu as root: apt-get update && apt-get install -y chromium (scripts/test.sh does "
        "that itself); elsewhere install Chromium or Chrome with the system's package manager"
    )


def run_browser(tmp_path: Path, *args: str) -> str:
    command = [browser(), "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={tmp_path / 'profile'}"]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{command[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_page_renders_in_a_browser_with_every_section_and_chart(tmp_path: Path) -> None:
    page = write_report(write_run(tmp_path / "run"))
    measured = tmp_path / "measured.html"
    measured.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    dom = run_browser(tmp_path, "--dump-dom", measured.as_uri())
    sizes = dict(re.findall(r'<section id="([\w-]+)" data-rendered="(\d+x\d+)"', dom))
    assert sorted(sizes) == sorted(SECTIONS)
    charts = [tuple(map(int, size.split("x"))) for size in re.findall(r'<svg[^>]* data-rendered="(\d+x\d+)"', dom)]
    assert len(charts) == 4 and all(width > 500 and height > 100 for width, height in charts), charts
    assert "&lt;root &amp; friends&gt;" in dom and "<root & friends>" not in dom

    screenshot = tmp_path / "report.png"
    run_browser(tmp_path, f"--screenshot={screenshot}", "--window-size=1280,4000", page.as_uri())
    pixels = imread(screenshot)  # fails on anything that is not a PNG
    assert pixels.shape[:2] == (4000, 1280)
    rgb = pixels[..., :3]
    inked = (rgb.min(axis=-1) < 0.8).mean()
    colored = ((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.3).mean()  # the bars and lines, not black text
    assert inked > 0.02, f"the screenshot is nearly blank: {inked:.2%} of it is drawn"
    assert colored > 0.005, f"the screenshot has almost no colored pixels ({colored:.2%}): the charts did not draw"
