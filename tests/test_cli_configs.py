"""Every config in configs/ runs through the ``lightning-fsdp`` CLI on 2 CPU processes and leaves a checkpoint.

Each run is a subprocess (Lightning's launcher re-runs the command line for the second rank) with a tiny model
and two optimizer steps; the CUDA configs run with the accelerator, device count and precision overridden, the
multi-node one on one node with a mesh that matches the 2 processes. The runs share one working folder, as a
user's would: the fine-tuning config starts from the checkpoint the demo config wrote there.
"""

from __future__ import annotations

import csv
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_fsdp.cli import main
from lightning_fsdp.report import MONITOR_FILE, REPORT_FILE
from tests.strategy_scripts import run_in_session

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TINY_GPT = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "32"]
TINY = [
    *("--data.block_size", "32", "--data.batch_size", "4", "--data.max_bytes", "30000"),
    *("--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"),
    *("--trainer.log_every_n_steps", "1"),
]
ON_TWO_CPU_PROCESSES = [
    *("--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.precision", "32-true"),
    *("--data.num_workers", "0"),
]
OVERRIDES = {
    "demo.yaml": TINY_GPT,
    "finetune_frozen.yaml": TINY_GPT,
    "cuda_bf16.yaml": [*TINY_GPT, *ON_TWO_CPU_PROCESSES],
    # Lightning's FSDP arguments (null defaults, deprecated alias, torch-FSDP keywords); hybrid over a (1, 2) mesh.
    "from_lightning_fsdp.yaml": [
        *TINY_GPT,
        *ON_TWO_CPU_PROCESSES,
        *("--trainer.strategy.init_args.device_mesh", "[1, 2]"),
    ],
    "hybrid_multinode.yaml": [
        *TINY_GPT,
        *ON_TWO_CPU_PROCESSES,
        *("--trainer.num_nodes", "1", "--trainer.strategy.init_args.device_mesh", "[1, 2]"),
    ],
    # A transformers Llama (the tiny one examples/finetune_hf.py --make-tiny writes into the working folder).
    "finetune_hf_llama.yaml": ["--model.init_args.lora_rank", "2"],
}
MODEL_CLASS = {"finetune_hf_llama.yaml": "lightning_fsdp.demos.hf_causal_lm.HFCausalLM"}
TIMEOUT = 120.0


@dataclass(frozen=True)
class Run:
    output: str
    checkpoint: Path
    logs: Path


def run_fit(config: str, cwd: Path) -> Run:
    """``lightning-fsdp fit --config configs/<config>`` with the test overrides; fails the test unless it succeeds."""
    command = [sys.executable, "-m", "lightning_fsdp.cli", "fit", "--config", str(CONFIGS / config)]
    command += [*TINY, *OVERRIDES[config]]
    output = run_in_session(command, cwd, TIMEOUT, config)
    checkpoint = re.search(r"^checkpoint: (.+)$", output, re.MULTILINE)
    logs = re.search(r"^logs: (.+)$", output, re.MULTILINE)
    assert checkpoint and logs, f"{config}: no 'checkpoint:'/'logs:' lines at the end of:\n{output}"
    run = Run(output, Path(checkpoint[1]), Path(logs[1]))
    assert run.checkpoint.exists(), f"{config}: the reported checkpoint {run.checkpoint} does not exist"
    assert run.checkpoint.is_relative_to(cwd) and run.logs.is_relative_to(cwd)
    return run


def logged(run: Run, column: str) -> list[float]:
    with open(run.logs / "metrics.csv", newline="") as file:
        return [float(row[column]) for row in csv.DictReader(file) if row.get(column)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def demo_run(workdir: Path) -> Run:
    return run_fit("demo.yaml", workdir)


def test_every_config_is_covered() -> None:
    assert {path.name for path in CONFIGS.glob("*.yaml")} == set(OVERRIDES)


def print_config(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The config ``lightning-fsdp fit <args>`` would run with, parsed in-process without training: class paths
    (the strategy and its auto-wrap policy among them) resolve and every value type-checks."""
    monkeypatch.setattr(sys, "argv", ["lightning-fsdp"])  # pytest's own arguments are not the CLI's
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)


@pytest.mark.parametrize("config", sorted(OVERRIDES))
def test_config_parses(config: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    print_config(["--config", str(CONFIGS / config), *OVERRIDES[config]], monkeypatch)
    assert MODEL_CLASS.get(config, "lightning_fsdp.demos.lit_gpt.LitGPT") in capsys.readouterr().out


def test_the_config_a_run_saves_reproduces_it(
    demo_run: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # LightningCLI writes the full config of every run next to its logs; it must be a valid config again.
    print_config(["--config", str(demo_run.logs / "config.yaml")], monkeypatch)
    printed = capsys.readouterr().out
    assert "Unable to serialize" not in printed and "lightning_fsdp.demos.gpt.Block" in printed


def test_demo_trains_and_reports_checkpoint_and_logs(demo_run: Run) -> None:
    assert demo_run.checkpoint.name == "last.ckpt" and demo_run.checkpoint.parent.name == "checkpoints"
    assert (demo_run.logs / "config.yaml").is_file()
    (val_loss,), (val_ppl,) = logged(demo_run, "val_loss"), logged(demo_run, "val_ppl")
    assert val_ppl == pytest.approx(math.exp(val_loss), rel=1e-4)  # perplexity of the whole split, all ranks
    assert len(logged(demo_run, "train_loss")) == 2
    # The monitor's records beside the logs, and the HTML report of them, whose path the run prints last.
    report = re.search(r"^report: (.+)$", demo_run.output, re.MULTILINE)
    assert report, demo_run.output[-3000:]
    assert Path(report[1]) == demo_run.logs / REPORT_FILE and Path(report[1]).is_file()
    assert (demo_run.logs / MONITOR_FILE).read_text().startswith('{"kind": "run"')


def test_finetune_starts_from_the_demo_checkpoint(demo_run: Run, workdir: Path) -> None:
    run = run_fit("finetune_frozen.yaml", workdir)
    assert "runs/finetune" in run.checkpoint.as_posix()
    assert re.search(r"Non-trainable params: [1-9]", run.output), run.output  # the frozen parameters


@pytest.mark.parametrize("config", ["cuda_bf16.yaml", "hybrid_multinode.yaml", "from_lightning_fsdp.yaml"])
def test_accelerator_configs_run_on_two_cpu_processes(config: str, workdir: Path) -> None:
    run_fit(config, workdir)


def test_the_hf_config_fine_tunes_lora_adapters(workdir: Path) -> None:
    make_tiny = [sys.executable, str(REPO / "examples" / "finetune_hf.py"), "--make-tiny", "runs/tiny_llama"]
    run_in_session(make_tiny, workdir, TIMEOUT, "finetune_hf.py --make-tiny")
    run = run_fit("finetune_hf_llama.yaml", workdir)
    saved = torch.load(run.checkpoint, weights_only=True)["state_dict"]
    assert saved and all(name.endswith(("lora_a", "lora_b")) for name in saved), sorted(saved)[:4]


def test_a_config_names_the_optimizer_by_class_path(workdir: Path) -> None:
    """Adafactor named in a config (it reads whole tensors: each lives on one rank) trains and checkpoints whole."""
    extra = workdir / "adafactor.yaml"
    extra.write_text(
        "model:\n  init_args:\n    optimizer:\n      class_path: torch.optim.Adafactor\n"
        "      init_args:\n        lr: 0.01\n"
        "trainer:\n  default_root_dir: runs/adafactor\n"
        "  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args:\n        dirpath: runs/adafactor/checkpoints\n        save_last: true\n"
    )
    command = [sys.executable, "-m", "lightning_fsdp.cli", "fit", "--config", str(CONFIGS / "demo.yaml")]
    command += ["--config", str(extra), *TINY, *TINY_GPT]
    run_in_session(command, workdir, TIMEOUT, "demo.yaml with Adafactor")
    saved = torch.load(workdir / "runs" / "adafactor" / "checkpoints" / "last.ckpt", weights_only=True)
    states = saved["optimizer_states"][0]["state"].values()
    assert states and all("row_var" in state or "variance" in state for state in states), list(states)[:1]
