"""The README's demo, end to end: examples/train_gpt.py under torchrun on 2 CPU ranks trains and reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
SUMMARY = re.compile(
    r"^done: 6 steps on 2 ranks \((?P<strategy>\w+)\), loss (?P<first>[\d.]+) -> (?P<last>[\d.]+), \d+ ms/step, "
    r"params (?P<total>[\d.]+)M \((?P<local>[\d.]+)M per rank\)$",
    re.MULTILINE,
)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_train_gpt_runs_under_torchrun_and_lowers_the_loss(strategy: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE)]
    command += ["--steps", "6", "--n-layer", "1", "--n-embd", "64", "--batch-size", "8"]
    command += ["--sharding-strategy", strategy]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, f"train_gpt.py failed:\n{result.stdout}\n{result.stderr}"

    assert len(re.findall(r"^step \d+ \| loss [\d.]+ \| grad-norm [\d.]+ \| \d+ ms$", result.stdout, re.M)) == 6
    summary = SUMMARY.search(result.stdout)
    assert summary, f"no summary line in:\n{result.stdout}"
    assert summary["strategy"] == strategy
    assert float(summary["last"]) < float(summary["first"]) - 0.5
    total, local = float(summary["total"]), float(summary["local"])
    if strategy == "NO_SHARD":
        assert local == total
    else:
        assert local == pytest.approx(total / 2, abs=0.01)  # each rank holds half of every parameter's rows
