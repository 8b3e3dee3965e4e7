"""The Lightning examples run as a user runs them: ``python examples/<name>.py`` on 2 CPU processes.

examples/trainer_api.py trains and tests a tiny model; examples/finetune_frozen.py then fine-tunes from its
checkpoint with part of the model frozen, and the frozen weights must come out unchanged.
examples/finetune_hf.py fine-tunes a tiny transformers Llama with LoRA and exports it for `from_pretrained`.
(examples/train_gpt.py, the engine without Lightning, has its own test: test_train_gpt_example.py.)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.strategy_scripts import run_in_session

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 120.0


def run_example(name: str, args: list[str], cwd: Path) -> str:
    command = [sys.executable, str(REPO / "examples" / name), *args]
    return run_in_session(command, cwd, TIMEOUT, name)


def reported_checkpoint(output: str) -> Path:
    match = re.search(r"^checkpoint: (.+)$", output, re.MULTILINE)
    assert match, f"no 'checkpoint:' line in:\n{output}"
    path = Path(match[1])
    assert path.is_file(), f"the reported checkpoint {path} does not exist"
    return path


@pytest.fixture(scope="module")
def trainer_api_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trainer_api")
    output = run_example(
        "trainer_api.py", ["--max-steps", "2", "--n-layer", "2", "--n-embd", "32", "--out", str(out)], out
    )
    assert re.search(r"^test loss [\d.]+, perplexity [\d.]+$", output, re.MULTILINE), output
    return reported_checkpoint(output)


def test_trainer_api_example_trains_tests_and_checkpoints(trainer_api_checkpoint: Path) -> None:
    hparams = torch.load(trainer_api_checkpoint, weights_only=True)["hyper_parameters"]
    assert hparams["n_layer"] == 2 and hparams["n_embd"] == 32


def test_finetune_example_leaves_frozen_weights_unchanged(trainer_api_checkpoint: Path, tmp_path: Path) -> None:
    args = ["--pretrained", str(trainer_api_checkpoint), "--freeze", "wte", "blocks.0", "--max-steps", "2"]
    output = run_example("finetune_frozen.py", [*args, "--out", str(tmp_path)], tmp_path)
    before = torch.load(trainer_api_checkpoint, weights_only=True)["state_dict"]
    after = torch.load(reported_checkpoint(output), weights_only=True)["state_dict"]
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert not {name for name in changed if name.startswith(("model.wte.", "model.lm_head.", "model.blocks.0."))}
    assert "model.blocks.1.mlp.fc.weight" in changed and "model.ln_f.weight" in changed


def test_finetune_hf_example_trains_lora_and_exports_for_transformers(tmp_path: Path) -> None:
    run_example("finetune_hf.py", ["--make-tiny", str(tmp_path / "tiny")], tmp_path)
    args = [
        "--pretrained",
        str(tmp_path / "tiny"),
        "--lora-rank",
        "4",
        "--max-steps",
        "2",
        "--out",
        str(tmp_path / "out"),
    ]
    output = run_example("finetune_hf.py", args, tmp_path)
    adapters = torch.load(reported_checkpoint(output), weights_only=True)["state_dict"]
    assert adapters and all(name.endswith(("lora_a", "lora_b")) for name in adapters)
    assert re.search(r"^continuation: '.*'$", output, re.MULTILINE), output
    assert (tmp_path / "out" / "hf" / "model.safetensors").is_file() and (
        tmp_path / "out" / "hf" / "config.json"
    ).is_file()
