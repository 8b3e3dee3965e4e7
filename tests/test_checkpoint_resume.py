"""Checkpoints through the Trainer (tests/scripts/checkpoint_resume.py, tests/scripts/checkpoint_kill.py): an 8-step
run interrupted at step 4 ends where the uninterrupted one did -- full and sharded, resumed with ``myfsdp``, ddp and
one device, sharded at other world sizes -- and what is on disk is readable by Lightning and safetensors, and survives
a save killed mid-write.

Five launches in all: the 2-process ``main`` script, the killed run for each form, and the resumes on 1 and 4
processes; the two killed runs run at the same time, and so do the two resumes. The tolerance is the engine parity
tests' (tests/engine_harness.py, [Note: parity tolerance]).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.sharded import read_checked_metadata
from lightning_fsdp.cli import main as cli_main
from tests.engine_harness import ATOL, RTOL
from tests.scripts.strategy_common import LitGPT
from tests.strategy_scripts import SCRIPTS, run_script

STEP4 = "epoch=0-step=4.ckpt"
STEP8 = "epoch=1-step=8.ckpt"
KILL_MODES = ("full", "sharded")


@pytest.fixture(scope="module")
def main_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("main")
    run_script("checkpoint_resume.py", out, "main")
    return out


def _checkpoint_step(path: Path) -> int:
    """The global step a complete checkpoint (file or folder) records; a folder is checked for torn files first."""
    if path.is_dir():
        read_checked_metadata(path)
        return torch.load(path / "meta.pt", weights_only=False)["global_step"]
    return torch.load(path, weights_only=False)["global_step"]


def _run_at_once(commands: dict[str, list[str]], returncode: int) -> None:
    """Run the commands at the same time, each in a session of its own; fail unless each exits with ``returncode``.

    A launch imports Lightning in its ranks one after the other (rank 0 starts rank 1 once it has imported it), which
    leaves a core idle for the other launch. The sessions let a timeout kill every rank, and let a script SIGKILL its
    own process group, which must not be pytest's.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = {
        label: subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        for label, command in commands.items()
    }
    try:
        outputs = {label: process.communicate(timeout=300) for label, process in processes.items()}
    finally:
        for process in processes.values():
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the other ranks, should they outlive rank 0
            except ProcessLookupError:
                pass
            process.wait()
    for label, process in processes.items():
        stdout, stderr = outputs[label]
        assert process.returncode == returncode, f"{label}: rc {process.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each form's killed run: its folder, and what its checkpoint folder held right after the kill."""
    outs = {mode: tmp_path_factory.mktemp(f"killed_{mode}") for mode in KILL_MODES}
    commands = {
        mode: [sys.executable, str(SCRIPTS / "checkpoint_kill.py"), str(outs[mode]), mode] for mode in KILL_MODES
    }
    _run_at_once(commands, returncode=-signal.SIGKILL)
    runs = {}
    for mode, out in outs.items():
        folder = out / "ckpts"
        names = sorted(p.name for p in folder.iterdir())
        steps = {name: _checkpoint_step(folder / name) for name in names if name.endswith(".ckpt")}
        runs[mode] = (out, {"names": names, "steps": steps})
    return runs


@pytest.fixture(scope="module")
def resumed_at(
    tmp_path_factory: pytest.TempPathFactory, main_out: Path, killed: dict[str, tuple[Path, dict[str, Any]]]
) -> dict[int, Path]:
    """The sharded step-4 folder from 2 ranks resumed on 1 and on 4; on 1 also the killed runs, from ``last``."""
    outs = {devices: tmp_path_factory.mktemp(f"w{devices}") for devices in (1, 4)}
    commands = {}
    for devices, out in outs.items():
        extra = [str(killed[mode][0]) for mode in KILL_MODES] if devices == 1 else []
        script = [sys.executable, str(SCRIPTS / "checkpoint_resume.py"), str(out)]
        commands[f"resume on {devices}"] = [*script, "resume", str(devices), str(main_out), *extra]
    _run_at_once(commands, returncode=0)
    return outs


@pytest.fixture(scope="module")
def step4_sharded_as_full(main_out: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    destination = tmp_path_factory.mktemp("converted") / "step4.ckpt"
    convert(main_out / "sharded" / STEP4, destination, "full", quiet=True)
    return torch.load(destination, weights_only=False)


def result(folder: Path, name: str) -> dict[str, Any]:
    return torch.load(folder / f"{name}.pt", weights_only=False)


def assert_close_to(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == reference.keys()
    for name, expected in reference.items():
        scale = expected.abs().max() + ATOL / RTOL
        error = ((ours[name] - expected).abs().max() / scale).item()
        assert error < RTOL, f"{what}: {name} is off by {error:.2e} relative to the uninterrupted run"


def assert_restored(start: dict[str, Any], checkpoint: dict[str, Any]) -> None:
    """What training started from is exactly what the checkpoint holds: model, optimizer, scheduler, loop."""
    assert start["global_step"] == checkpoint["global_step"]
    assert start["weights"].keys() == checkpoint["state_dict"].keys()
    for name, value in checkpoint["state_dict"].items():
        assert torch.equal(start["weights"][name], value), name
    saved, restored = checkpoint["optimizer_states"][0], start["optimizer"]
    assert restored["state"].keys() == saved["state"].keys()
    for index, values in saved["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(restored["state"][index][key]), torch.as_tensor(value)), (index, key)
    for restored_group, saved_group in zip(restored["param_groups"], saved["param_groups"], strict=True):
        for key in ("lr", "initial_lr", "weight_decay", "betas", "eps"):
            assert restored_group[key] == saved_group[key], key
    assert start["scheduler"] == checkpoint["lr_schedulers"][0]


@pytest.mark.parametrize(
    ("run", "checkpoint"),
    [
        ("full_resumed", "full/" + STEP4),  # ckpt_path="last", which was the step-4 save then
        ("full_ddp", "full/" + STEP4),
        ("full_single", "full/" + STEP4),
        ("ddp_to_myfsdp", "ddp/" + STEP4),
        ("sharded_resumed", None),  # ckpt_path="last": a link to the step-4 folder
    ],
)
def test_an_interrupted_run_resumes_to_the_uninterrupted_result(
    main_out: Path, step4_sharded_as_full: dict[str, Any], run: str, checkpoint: str | None
) -> None:
    resumed = result(main_out, run)
    saved = step4_sharded_as_full if checkpoint is None else torch.load(main_out / checkpoint, weights_only=False)
    assert_restored(resumed["start"], saved)
    assert resumed["start"]["epoch"] == 1  # the step-4 save ended the first epoch
    assert resumed["global_step"] == 8
    assert_close_to(resumed["final"], result(main_out, "straight")["final"], run)


@pytest.mark.parametrize("devices", [1, 4])
def test_a_sharded_checkpoint_from_2_ranks_resumes_on_other_world_sizes(
    main_out: Path, resumed_at: dict[int, Path], step4_sharded_as_full: dict[str, Any], devices: int
) -> None:
    resumed = result(resumed_at[devices], "from_w2")
    assert_restored(resumed["start"], step4_sharded_as_full)
    assert resumed["start"]["epoch"] == 1
    assert resumed["global_step"] == 8
    # Every world size sees the same 4 samples a step (see the script), so it also lands where 2 ranks did.
    assert_close_to(resumed["final"], result(main_out, "straight")["final"], f"resumed on {devices}")


def test_top_k_rotation_removes_the_old_folders(main_out: Path) -> None:
    topk = json.loads((main_out / "topk.json").read_text())
    assert topk["listing"] == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt"]  # steps 1 and 2 were saved, then removed
    assert [Path(path).name for path in topk["best_k"]] == topk["listing"]
    for name in topk["listing"]:
        assert _checkpoint_step(main_out / "topk" / name) == int(name[-6])
    assert (main_out / "sharded" / "last.ckpt").is_symlink()  # save_last="link", pointing at the step-8 folder
    assert _checkpoint_step(main_out / "sharded" / "last.ckpt") == 8


def test_load_from_checkpoint_in_a_plain_process_gives_the_trained_weights(main_out: Path) -> None:
    model = LitGPT.load_from_checkpoint(main_out / "full" / "last.ckpt", map_location="cpu")
    trained = result(main_out, "full_resumed")["final"]
    assert model.state_dict().keys() == trained.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_lightning_consolidate_and_our_convert_give_the_same_checkpoint(main_out: Path, tmp_path: Path) -> None:
    folder = main_out / "sharded" / STEP8
    subprocess.run(
        [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(folder)]
        + ["--output_file", str(tmp_path / "lightning.ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    cli_main(["convert", str(folder), str(tmp_path / "ours.ckpt"), "--to", "full"])
    lightning = torch.load(tmp_path / "lightning.ckpt", weights_only=False)
    ours = torch.load(tmp_path / "ours.ckpt", weights_only=False)
    trained = result(main_out, "sharded_resumed")["final"]
    assert lightning["state_dict"].keys() == ours["state_dict"].keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(lightning["state_dict"][name], value) and torch.equal(ours["state_dict"][name], value)
    for key in ("global_step", "epoch", "loops", "lr_schedulers"):
        assert lightning[key] == ours[key], key
    # Optimizer state: the same tensors, keyed differently. Lightning's tool keeps the folder's form (state keyed
    # by parameter name); ours is Optimizer.state_dict()'s positional form, which ddp and one device load.
    (by_name,), (positional,) = lightning["optimizer_states"], ours["optimizer_states"]
    names = [name for group in positional["param_groups"] for name in group["param_names"]]
    assert sorted(by_name["state"]) == sorted(names)
    for index, values in positional["state"].items():
        for key, value in values.items():
            assert torch.equal(by_name["state"][names[index]][key], value), (names[index], key)


def test_safetensors_output_reads_back_as_the_weights(main_out: Path, tmp_path: Path) -> None:
    trained = result(main_out, "sharded_resumed")["final"]
    for source in (main_out / "sharded" / STEP8, main_out / "full" / "last.ckpt"):
        destination = tmp_path / f"{source.name}.safetensors"
        cli_main(["convert", str(source), str(destination), "--to", "safetensors", "--strip-prefix", "model."])
        weights = load_file(destination)
        assert weights.keys() == {name.removeprefix("model.") for name in trained}
        reference = trained if source.is_dir() else result(main_out, "full_resumed")["final"]
        for name, value in reference.items():
            assert torch.equal(weights[name.removeprefix("model.")], value), name


@pytest.mark.parametrize("mode", KILL_MODES)
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_as_last(
    killed: dict[str, tuple[Path, dict[str, Any]]], mode: str
) -> None:
    _, after_kill = killed[mode]
    partial = [name for name in after_kill["names"] if name.startswith(".partial-")]
    assert len(partial) == 1, after_kill["names"]  # the interrupted write, under a name nothing lists
    # Every checkpoint under its own name is complete; last.ckpt is still the step-4 one.
    assert after_kill["steps"] == {STEP4: 4, STEP8: 8, "last.ckpt": 4}


@pytest.mark.parametrize("index", range(len(KILL_MODES)))
def test_a_killed_run_resumes_from_last(
    main_out: Path,
    killed: dict[str, tuple[Path, dict[str, Any]]],
    resumed_at: dict[int, Path],
    index: int,
    tmp_path: Path,
) -> None:
    folder = killed[KILL_MODES[index]][0] / "ckpts"
    step4 = folder / STEP4
    if step4.is_dir():
        convert(step4, tmp_path / "step4.ckpt", "full", quiet=True)
        step4 = tmp_path / "step4.ckpt"
    resumed = result(resumed_at[1], f"killed_{index}")
    assert_restored(resumed["start"], torch.load(step4, weights_only=False))  # what last.ckpt held
    assert resumed["start"]["epoch"] == 1
    assert resumed["global_step"] == 8
    assert_close_to(resumed["final"], result(main_out, "straight")["final"], f"killed {KILL_MODES[index]} run")
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".partial-")]  # the next save cleaned up
    assert _checkpoint_step(folder / "last.ckpt") == 8
