"""LitGPT 0.5.13's own ``pretrain``, ``finetune_full`` and ``finetune/lora_legacy.py`` on our strategy, beside DDP.

Each command runs unmodified through LitGPT's command line on two gloo ranks, once with Lightning's FSDPStrategy
swapped for ours by name (what a LitGPT user does: the scripts take no strategy argument) and once with DDP in its
place, from the same offline base checkpoint (see ``tests/scripts/litgpt_scripts.py``). The claims:

- training matches DDP's: the final weights agree to ~1e-5 (pretraining compiles the model, as the script does);
- what our strategy saved is what LitGPT's tools read: ``ckpt["model"]`` of every ``lit_model.pth``, the LoRA file
  that ``merge_lora`` (run by the LoRA script itself) merges, and ``litgpt generate`` on the merged model;
- a pretraining run resumed (``--resume true``) from its step-2 checkpoint ends equal to the uninterrupted run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests.distributed import run_distributed
from tests.scripts.litgpt_scripts import run_litgpt, write_base_checkpoint

RTOL, ATOL = 1e-5, 1e-6
TIMEOUT = 420.0
EVAL = ["--eval.interval", "100", "--eval.max_iters", "1", "--eval.initial_validation", "false"]
FINETUNE = [
    "--precision", "32-true", "--devices", "2", "--logger_name", "csv",
    "--data", "JSON", "--data.val_split_fraction", "0.25", "--data.num_workers", "0",
    "--train.save_interval", "2", "--train.log_interval", "1", "--train.global_batch_size", "4",
    "--train.micro_batch_size", "1", "--train.lr_warmup_steps", "1", "--train.epochs", "1", "--train.max_steps", "4",
    "--train.max_seq_length", "16", "--eval.max_new_tokens", "2", *EVAL,
]  # fmt: skip


def _pretrain(base: Path, out: Path, *extra: str) -> list[str]:
    return [
        "pretrain", "tiny-llama-test", "--model_config", str(base / "model_config.yaml"), "--out_dir", str(out),
        "--precision", "32-true", "--devices", "2", "--logger_name", "csv",
        "--data", "tests.scripts.litgpt_scripts.Tokens",
        "--train.save_interval", "2", "--train.log_interval", "1", "--train.global_batch_size", "8",
        "--train.micro_batch_size", "2", "--train.max_tokens", "2048", "--train.lr_warmup_steps", "1",
        "--train.min_lr", "1e-4", *EVAL, "--eval.final_validation", "false", *extra,
    ]  # fmt: skip


def _finetune(command: str, base: Path, out: Path, *extra: str) -> list[str]:
    argv = [command, str(base), "--out_dir", str(out), *FINETUNE, "--data.json_path", str(base / "data.json")]
    if command == "finetune_lora_legacy":
        argv += ["--lora_r", "2", "--lora_alpha", "4", "--lora_dropout", "0"]
    return argv + list(extra)


def _model(path: Path) -> dict[str, torch.Tensor]:
    """The model state a LitGPT tool reads from ``path`` (its ``lazy_load(path).get("model", ...)``)."""
    checkpoint = torch.load(path, weights_only=False, map_location="cpu")  # files this test's runs just wrote
    return checkpoint.get("model", checkpoint)


def _assert_same_model(actual: dict, expected: dict, label: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys(), f"{label}: {sorted(actual.keys() ^ expected.keys())}"
    for name, value in expected.items():
        torch.testing.assert_close(
            actual[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{label}: {n}: {m}"
        )


def test_pretrain_matches_ddp_and_resumes_exactly(tmp_path: Path) -> None:
    base = tmp_path / "base"
    write_base_checkpoint(base)
    for strategy in ("ddp", "ours"):
        run_distributed(run_litgpt, 2, strategy, _pretrain(base, tmp_path / strategy), timeout=TIMEOUT)
    ours, ddp = _model(tmp_path / "ours/final/lit_model.pth"), _model(tmp_path / "ddp/final/lit_model.pth")
    _assert_same_model(ours, ddp, "pretrain, ours against ddp")
    assert not torch.equal(
        ours["lm_head.weight"], _model(tmp_path / "ours/step-00000002/lit_model.pth")["lm_head.weight"]
    )

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ours/step-00000002", resumed / "step-00000002")
    run_distributed(run_litgpt, 2, "ours", _pretrain(base, resumed, "--resume", "true"), timeout=TIMEOUT)
    _assert_same_model(_model(resumed / "final/lit_model.pth"), ours, "resumed against uninterrupted", 0, 0)


def test_finetuning_matches_ddp_and_feeds_litgpt_tools(tmp_path: Path) -> None:
    base = tmp_path / "base"
    write_base_checkpoint(base)
    for command in ("finetune_full", "finetune_lora_legacy"):
        for strategy in ("ddp, initialising", "ours"):
            argv = _finetune(command, base, tmp_path / command / strategy.split(",")[0])
            run_distributed(run_litgpt, 2, strategy, argv, timeout=TIMEOUT)
    full = tmp_path / "finetune_full"
    _assert_same_model(_model(full / "ours/final/lit_model.pth"), _model(full / "ddp/final/lit_model.pth"), "full")
    lora = tmp_path / "finetune_lora_legacy"
    for name in ("lit_model.pth.lora", "lit_model.pth"):  # the adapter our strategy saved, what merge_lora made of it
        _assert_same_model(_model(lora / "ours/final" / name), _model(lora / "ddp/final" / name), f"lora {name}")
    assert torch.load(lora / "ours/final/lit_model.pth.lora", weights_only=True)  # plain data, as LitGPT reads it
    generated = subprocess.run(
        [sys.executable, "-m", "litgpt", "generate", str(lora / "ours/final"), "--prompt", "the a of",
         "--max_new_tokens", "3", "--precision", "32-true"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert generated.returncode == 0, generated.stderr[-3000:]
