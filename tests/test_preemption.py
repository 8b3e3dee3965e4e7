"""Signals delivered inside ``training_step`` under SLURM's auto-requeue (tests/scripts/preemption.py): the requeue
signal's HPC checkpoint is written at the end of the batch it arrived in, on every rank (at the next batch's end when
it lands inside the optimizer step; with gradient accumulation, manual optimization, at the end of training), the
requeue goes ahead, and the resumed run ends
where an uninterrupted one did; a SIGTERM to one rank ends both within seconds, not after the group's timeout.

Both ranks are started here with SLURM's variables, as ``srun`` would start them; ``scontrol`` is a script on PATH
that records how it was called (Lightning runs it as a subprocess on rank 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_fsdp.runtime.launch import free_port
from tests.engine_harness import ATOL, RTOL
from tests.strategy_scripts import SCRIPTS

JOB_ID = "4242"
BOUND_S = 300  # the subprocesses' bound: a hang runs into it
SIGTERM_BOUND_S = 30  # every rank must have ended this soon after the SIGTERM (the group's timeout is 600 s)


def _start_ranks(out: Path, mode: str) -> list[subprocess.Popen]:
    """Both ranks of tests/scripts/preemption.py, with the variables ``srun`` sets and a recording ``scontrol``."""
    bin_dir = out / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{out / "scontrol.log"}"\n')
    scontrol.chmod(0o755)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NAME": "preemption-test",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.1",
    }
    command = [sys.executable, str(SCRIPTS / "preemption.py"), str(out), mode]
    return [
        subprocess.Popen(
            command,
            env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]


def _wait(ranks: list[subprocess.Popen]) -> tuple[list[str], list[float]]:
    """Each rank's output and the time it ended; every rank is killed should the bound pass."""
    outputs, ended = [], []
    try:
        for rank in ranks:
            outputs.append(rank.communicate(timeout=BOUND_S)[0])
            ended.append(time.time())
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    return outputs, ended


def _global_step(checkpoint: Path) -> int:
    """The step a checkpoint was saved after: a full file's, or a sharded folder's ``meta.pt``."""
    return torch.load(checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint, weights_only=True)["global_step"]


def _close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str) -> None:
    assert actual.keys() == expected.keys(), label
    for name, value in expected.items():
        torch.testing.assert_close(
            actual[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{label} {name}: {m}"
        )


def test_a_requeue_signal_inside_a_step_saves_at_its_end_on_every_rank_and_resumes_exactly(tmp_path: Path) -> None:
    ranks = _start_ranks(tmp_path, "requeue")
    outputs, _ = _wait(ranks)
    for rank, (process, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank} exited with {process.returncode}:\n{output[-5000:]}"
    # One requeue per batch end that acted, from rank 0 only, for the job the variables name.
    assert (tmp_path / "scontrol.log").read_text().splitlines() == [f"requeue {JOB_ID}"] * 9
    assert (tmp_path / "one_rank" / "hpc_ckpt_1.ckpt").is_file()
    assert (tmp_path / "both_ranks" / "hpc_ckpt_1.ckpt" / "meta.pt").is_file()  # sharded: a folder
    # The step of each HPC checkpoint (see tests/scripts/preemption.py): a signal in training_step is acted on at the
    # end of its own batch, one that lands after the flags were sent (inside the optimizer step) at the next batch's
    # end, and one inside the last batch's optimizer step at the end of training.
    acted = {"one_rank": [3], "both_ranks": [3], "apart": [1, 4, 6], "accumulated": [0, 2], "manual": [2, 5]}
    for run, steps in acted.items():
        assert [_global_step(path) for path in sorted((tmp_path / run).glob("hpc_ckpt_*.ckpt"))] == steps, run

    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    for run in ("one_rank", "both_ranks"):
        signalled = torch.load(tmp_path / f"{run}-signalled.pt", weights_only=True)
        resumed = torch.load(tmp_path / f"{run}-resumed.pt", weights_only=True)
        assert resumed["start_step"] == 3, f"{run}: resumed from step {resumed['start_step']}, not the HPC save's 3"
        _close(signalled["final"], straight["final"], f"{run}, the signalled run")
        _close(resumed["final"], straight["final"], f"{run}, resumed from the HPC checkpoint")


def test_a_sigterm_to_one_rank_inside_a_step_ends_every_rank_within_seconds(tmp_path: Path) -> None:
    ranks = _start_ranks(tmp_path, "sigterm")
    outputs, ended = _wait(ranks)
    report = f"rank 0:\n{outputs[0][-3000:]}\nrank 1:\n{outputs[1][-3000:]}"
    assert (tmp_path / "signalled_at").is_file(), f"rank 1 never sent the signal:\n{report}"
    took = max(ended) - float((tmp_path / "signalled_at").read_text())
    assert took < SIGTERM_BOUND_S, f"the ranks ended {took:.1f} s after the SIGTERM:\n{report}"
    assert ranks[1].returncode == 143, report  # Lightning's SIGTERMException, as a process ended by SIGTERM
    assert "left with SIGTERMException(143)" in outputs[1], report
    assert ranks[0].returncode == 1, report
    assert "PeerTerminatedError: rank 1 received SIGTERM" in outputs[0], report
    assert "every rank stopped after step 2" in outputs[0], report  # signalled in step 2, acted on at its end
    # Every rank stops at the same point, so a save in on_exception (a collective) is written.
    assert _global_step(tmp_path / "term" / "on_exception.ckpt") == 2, report


@pytest.fixture(autouse=True)
def _no_slurm_from_the_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks get exactly the SLURM variables set above, even when the tests themselves run under SLURM."""
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        monkeypatch.delenv(name)
