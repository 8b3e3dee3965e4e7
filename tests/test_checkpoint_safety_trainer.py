"""The Trainer's checkpoint entry points with hostile files and users' paths (tests/scripts/checkpoint_safety.py,
one 2-process launch), and the ``lightning-fsdp fit --ckpt_path`` command line with a hostile sharded folder."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fsdp.checkpoint.full import save_full_checkpoint
from lightning_fsdp.checkpoint.sharded import save_sharded, sharded_checkpoint_state
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine import fully_shard
from tests.distributed import run_distributed
from tests.scripts.strategy_common import TINY
from tests.strategy_scripts import run_script
from tests.test_checkpoint_safety import Hostile

ROOT = Path(__file__).resolve().parents[1]


def _tiny_sharded_checkpoint(rank: int, world_size: int, folder: str) -> None:
    """A sharded checkpoint of the scripts' tiny GPT under ``model.`` (as a LightningModule names it)."""
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.model = GPT(TINY)
    fully_shard(holder, {Block})
    save_sharded(Path(folder), sharded_checkpoint_state(holder, []), {"global_step": 0, "epoch": 0})


def _hostile_files(folder: Path, marker: Path) -> None:
    """OUT/hostile: a hostile full file, and sharded folders with a hostile ``meta.pt`` and ``.metadata``."""
    folder.mkdir()
    save_full_checkpoint(folder / "evil.ckpt", {"state_dict": {}, "payload": Hostile(str(marker))})
    run_distributed(_tiny_sharded_checkpoint, 2, str(folder / "evil_meta"))
    shutil.copytree(folder / "evil_meta", folder / "evil_metadata")
    torch.save({"global_step": 0, "payload": Hostile(str(marker))}, folder / "evil_meta" / "meta.pt")
    with open(folder / "evil_metadata" / ".metadata", "wb") as handle:
        pickle.dump(Hostile(str(marker)), handle)


@pytest.fixture(scope="module")
def safety_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("safety")
    _hostile_files(out / "hostile", out / "PWNED")
    (out / "user_folder").mkdir()
    (out / "user_folder" / "results.csv").write_text("epoch,acc\n1,0.9\n")
    (out / "user_file.ckpt").write_text("my notes")
    run_script("checkpoint_safety.py", out, timeout=600)
    return out


def test_trainer_entry_points_refuse_hostile_files_and_keep_user_paths(safety_out: Path) -> None:
    messages = json.loads((safety_out / "done.json").read_text())
    assert len([label for label in messages if label.startswith(("fit ", "validate ", "test "))]) == 18
    assert not (safety_out / "PWNED").exists()
    assert sorted(p.name for p in (safety_out / "user_folder").iterdir()) == ["results.csv"]
    assert (safety_out / "user_folder" / "results.csv").read_text() == "epoch,acc\n1,0.9\n"
    assert (safety_out / "user_file.ckpt").read_text() == "my notes"
    leftovers = [p for p in safety_out.rglob(".partial-*")]
    assert not leftovers, leftovers


def test_the_cli_refuses_a_hostile_sharded_folder(safety_out: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightning_fsdp.cli", "fit", "--config", "configs/demo.yaml"]
    command += ["--trainer.max_steps", "1", "--model.n_layer", "1", "--model.n_embd", "16", "--model.n_head", "2"]
    command += ["--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(safety_out / "hostile" / "evil_meta")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, start_new_session=True
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert re.search(r"refusing to load .*evil_meta/meta.pt: it contains posix.system", output), output[-3000:]
    assert not (safety_out / "PWNED").exists()
