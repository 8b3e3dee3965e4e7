"""Checkpoints that are not ours, and paths that belong to the user: nothing runs, nothing is lost, nothing half-loads.

- Hostile pickles (a ``__reduce__`` that would create a marker file) in a full file, a sharded folder's ``meta.pt``
  and its DCP ``.metadata``: refused by name through every loader and ``convert``; the marker is never created.
  With the explicit opt-in (``trust``) a file holding a harmless foreign object loads.
- Every refusal -- hostile file, corrupt ``meta.pt``, another model's ``.distcp`` shards, another optimizer type --
  leaves the model's shards and the optimizer's state bit for bit as they were.
- Saves and converts never replace what is not a checkpoint of their own form; a full disk says so and leaves no
  temporary behind.
- Under mixed precision the full checkpoint holds the fp32 master shards exactly, and loads back exactly.

The Trainer's entry points (``fit/validate/test(ckpt_path=...)``, ``weights_only``, ``trust_checkpoint``,
``AsyncCheckpointIO``, the CLI) are covered in tests/test_checkpoint_safety_trainer.py.
"""

from __future__ import annotations

import fractions
import os
import pickle
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from lightning_fsdp import MixedPrecision, fully_shard
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.full import full_optimizer_state, load_full_checkpoint, save_full_checkpoint
from lightning_fsdp.checkpoint.safe_load import UntrustedCheckpointError
from lightning_fsdp.checkpoint.sharded import load_sharded, save_sharded, sharded_checkpoint_state
from lightning_fsdp.cli import main as cli_main
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.demos.lit_gpt import LitGPT
from lightning_fsdp.engine.runtime.registry import fsdp_param_of
from lightning_fsdp.engine.state.state_dict import full_state_dict
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT, train_tokens

OTHER_GPT = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=20, bias=True)


class Hostile:
    """Unpickling this runs a shell command, as an attacker's file would; the command only creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _model(config: GPTConfig = TINY_GPT, **options: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(GPT(config), {Block}, **options)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_both(model: torch.nn.Module, optimizers: list, folder: Path, name: str) -> None:
    """``folder/name.ckpt`` (full) and ``folder/name`` (sharded), as the strategy writes them."""
    save_sharded(folder / name, sharded_checkpoint_state(model, optimizers), {"global_step": 2})
    full = {
        "state_dict": full_state_dict(model),
        "optimizer_states": [full_optimizer_state(model, o) for o in optimizers],
    }
    if torch.distributed.get_rank() == 0:
        save_full_checkpoint(folder / f"{name}.ckpt", {**full, "global_step": 2})
    torch.distributed.barrier()


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": {
            id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in optimizer.state.items()
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }


def _assert_untouched(
    before: dict[str, object], model: torch.nn.Module, optimizer: torch.optim.Optimizer, what: str
) -> None:
    after = _snapshot(model, optimizer)
    for name, value in before["params"].items():
        assert torch.equal(after["params"][name], value), f"{what}: {name} changed"
    assert after["state"].keys() == before["state"].keys(), f"{what}: optimizer state created or dropped"
    for key, state in before["state"].items():
        for name, value in state.items():
            same = (
                torch.equal(after["state"][key][name], value)
                if torch.is_tensor(value)
                else after["state"][key][name] == value
            )
            assert same, f"{what}: optimizer state {name} changed"
    assert after["groups"] == before["groups"], f"{what}: hyperparameters changed"
    assert all(p.grad is None for p in model.parameters()), f"{what}: gradients left behind"


def _make_foreign_files(folder: Path, marker: Path) -> None:
    """Copies of our checkpoints with one part replaced (rank 0 only; the others wait)."""
    for name in ("evil_meta", "evil_metadata", "corrupt_meta", "foreign_shards", "trusted_meta"):
        shutil.copytree(folder / "ours", folder / name)
    torch.save({"global_step": 2, "payload": Hostile(str(marker))}, folder / "evil_meta" / "meta.pt")
    with open(folder / "evil_metadata" / ".metadata", "wb") as handle:
        pickle.dump(Hostile(str(marker)), handle)
    (folder / "corrupt_meta" / "meta.pt").write_bytes(os.urandom(4096))
    for shard in (folder / "other").glob("*.distcp"):
        shutil.copy(shard, folder / "foreign_shards" / shard.name)
    torch.save({"global_step": 2, "ratio": fractions.Fraction(1, 3)}, folder / "trusted_meta" / "meta.pt")
    full = torch.load(folder / "ours.ckpt", weights_only=True)
    torch.save({**full, "payload": Hostile(str(marker))}, folder / "evil.ckpt")
    torch.save({**full, "ratio": fractions.Fraction(1, 3)}, folder / "trusted.ckpt")
    sgd = torch.load(folder / "sgd.ckpt", weights_only=True)
    torch.save({**full, "optimizer_states": sgd["optimizer_states"]}, folder / "sgd_state.ckpt")


def _refusals(rank: int, world_size: int, folder_name: str) -> None:
    folder, marker = Path(folder_name), Path(folder_name) / "PWNED"
    model, optimizer = _model()
    train_tokens(model, optimizer, 2, seed=rank)
    _save_both(model, [optimizer], folder, "ours")
    other, other_optimizer = _model(OTHER_GPT)
    train_tokens(other, other_optimizer, 1, seed=rank)
    save_sharded(folder / "other", sharded_checkpoint_state(other, [other_optimizer]), {"global_step": 1})
    sgd_model, _ = _model()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    train_tokens(sgd_model, sgd, 1, seed=rank)
    _save_both(sgd_model, [sgd], folder, "sgd")
    if rank == 0:
        _make_foreign_files(folder, marker)
    torch.distributed.barrier()

    # A fresh model and optimizer (no state yet), and a trained pair (state present): refusals touch neither.
    hostile = r"refusing to load .*{}: it contains {}.*trust=True"
    other_optimizer = (
        r"hyperparameters \['dampening', 'momentum', 'nesterov'\] in group 0 that this AdamW does not have"
    )
    refusals = [
        (load_sharded, "evil_meta", UntrustedCheckpointError, hostile.format("evil_meta/meta.pt", "posix.system")),
        (
            load_sharded,
            "evil_metadata",
            UntrustedCheckpointError,
            hostile.format("evil_metadata/.metadata", "posix.system"),
        ),
        (load_full_checkpoint, "evil.ckpt", UntrustedCheckpointError, hostile.format("evil.ckpt", "posix.system")),
        (load_sharded, "corrupt_meta", ValueError, r"corrupt_meta/meta.pt is not a checkpoint: it is not an archive"),
        (
            load_sharded,
            "foreign_shards",
            ValueError,
            r"foreign_shards does not fit together: __\d_0.distcp holds no record",
        ),
        (load_sharded, "sgd", ValueError, other_optimizer),
        (load_full_checkpoint, "sgd_state.ckpt", ValueError, other_optimizer),
    ]
    fresh, fresh_optimizer = _model()
    for target, target_optimizer in ((fresh, fresh_optimizer), (model, optimizer)):
        before = _snapshot(target, target_optimizer)
        for load, name, error, message in refusals:
            with pytest.raises(error, match=message):
                load(folder / name, target, [target_optimizer])
            _assert_untouched(before, target, target_optimizer, name)
    assert not marker.exists()

    # The opt-in: a harmless foreign object (a Fraction) loads when trusted, and is refused otherwise.
    with pytest.raises(UntrustedCheckpointError, match=r"fractions.Fraction"):
        load_sharded(folder / "trusted_meta", fresh, [fresh_optimizer])
    assert load_sharded(folder / "trusted_meta", fresh, [fresh_optimizer], trust=True)["ratio"] == fractions.Fraction(
        1, 3
    )
    assert load_full_checkpoint(folder / "trusted.ckpt", fresh, [fresh_optimizer], trust=True)["global_step"] == 2
    # Our own checkpoints need no opt-in, and the refused loads above changed nothing on the way.
    for name, value in full_state_dict(fresh, rank0_only=False).items():
        assert torch.equal(value, full_state_dict(model, rank0_only=False)[name]), name


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the refusal run: our checkpoints and the foreign copies of them."""
    folder = tmp_path_factory.mktemp("refusals")
    run_distributed(_refusals, 2, str(folder))
    return folder


def test_refusals_run_no_code_and_change_nothing(refused: Path) -> None:
    assert not (refused / "PWNED").exists()


def _convert_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """``lightning-fsdp convert ARGS``: its exit status and what it printed to stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli_main(["convert", *args])
    return exited.value.code, capsys.readouterr().err


def test_convert_refuses_hostile_files_and_user_paths(
    refused: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    for name in ("ours", "ours.ckpt", "evil.ckpt", "evil_meta", "evil_metadata"):
        copy = shutil.copytree if (refused / name).is_dir() else shutil.copy
        copy(refused / name, tmp_path / name)
    marker = refused / "PWNED"
    hostile = {
        "full.ckpt -> full": (tmp_path / "evil.ckpt", "full"),
        "full.ckpt -> sharded": (tmp_path / "evil.ckpt", "sharded"),
        "full.ckpt -> safetensors": (tmp_path / "evil.ckpt", "safetensors"),
        "meta.pt -> full": (tmp_path / "evil_meta", "full"),
        ".metadata -> full": (tmp_path / "evil_metadata", "full"),
        ".metadata -> safetensors": (tmp_path / "evil_metadata", "safetensors"),
    }
    for label, (source, to) in hostile.items():
        with pytest.raises(UntrustedCheckpointError, match=r"refusing to load .*--trust-checkpoint"):
            convert(source, tmp_path / f"out-{to}-{source.name}", to, quiet=True)
        assert not marker.exists(), label
        assert not (tmp_path / f"out-{to}-{source.name}").exists(), label
    # The opt-in really runs the file's code: that is what it is for.
    convert(tmp_path / "evil.ckpt", tmp_path / "trusted-out.ckpt", "full", quiet=True, trust=True)
    assert marker.exists()
    marker.unlink()

    # Not a checkpoint: one sentence naming the file, from the command line too.
    for name, content in (("empty.ckpt", b""), ("notes.txt", b"my notes\n"), ("random.bin", os.urandom(1000))):
        (tmp_path / name).write_bytes(content)
        code, stderr = _convert_cli(capsys, str(tmp_path / name), str(tmp_path / f"{name}.out"))
        assert code == 2 and f"{tmp_path / name} is not a checkpoint" in stderr, stderr
        assert "_use_new_zipfile_serialization" not in stderr

    # A user's folder or file at the destination: refused, kept, and --overwrite does not change that.
    user = tmp_path / "user_folder"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    (tmp_path / "user_file.ckpt").write_text("not a checkpoint")
    for destination in (user, tmp_path / "user_file.ckpt"):
        for to in ("full", "sharded", "safetensors"):
            for extra in ([], ["--overwrite"]):
                code, stderr = _convert_cli(capsys, str(tmp_path / "ours"), str(destination), "--to", to, *extra)
                assert code == 2 and str(destination) in stderr, (destination, to, extra, stderr)
    assert (user / "thesis.tex").read_text() == "years of work"
    assert (tmp_path / "user_file.ckpt").read_text() == "not a checkpoint"
    assert sorted(p.name for p in user.iterdir()) == ["thesis.tex"]

    # Our own checkpoint of the same form is replaced only with --overwrite.
    convert(tmp_path / "ours", tmp_path / "converted.ckpt", "full", quiet=True)
    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        convert(tmp_path / "ours", tmp_path / "converted.ckpt", "full", quiet=True)
    convert(tmp_path / "ours.ckpt", tmp_path / "converted.ckpt", "full", quiet=True, overwrite=True)
    convert(tmp_path / "ours.ckpt", tmp_path / "resharded", "sharded", quiet=True)
    with pytest.raises(FileExistsError, match="is a folder; a full checkpoint is one file"):
        convert(tmp_path / "ours.ckpt", tmp_path / "resharded", "full", quiet=True, overwrite=True)
    convert(tmp_path / "ours.ckpt", tmp_path / "resharded", "sharded", quiet=True, overwrite=True)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".partial-")]


def _saves_onto_user_paths(rank: int, world_size: int, folder_name: str) -> None:
    folder = Path(folder_name)
    model, optimizer = _model()
    train_tokens(model, optimizer, 1, seed=rank)
    state = sharded_checkpoint_state(model, [optimizer])
    with pytest.raises(FileExistsError, match=r"user_folder is a folder holding files that are not part of a sharded"):
        save_sharded(folder / "user_folder", state, {"global_step": 1})
    with pytest.raises(FileExistsError, match=r"user_file.ckpt is a file; a sharded checkpoint is a folder"):
        save_sharded(folder / "user_file.ckpt", state, {"global_step": 1})
    save_sharded(folder / "ours", state, {"global_step": 1})
    save_sharded(folder / "ours", state, {"global_step": 2})  # our own folder is replaced
    (folder / "empty").mkdir(exist_ok=True)
    torch.distributed.barrier()
    save_sharded(folder / "empty", state, {"global_step": 1})  # nothing of the user's to lose
    if rank == 0:
        full = {"state_dict": {}}
        with pytest.raises(FileExistsError, match=r"user_folder is a folder; a full checkpoint is one file"):
            save_full_checkpoint(folder / "user_folder", full)
        with pytest.raises(FileExistsError, match=r"user_file.ckpt exists and is not a checkpoint"):
            save_full_checkpoint(folder / "user_file.ckpt", full)
        with pytest.raises(FileExistsError, match=r"ours is a folder"):
            save_full_checkpoint(folder / "ours", full)


def test_saves_never_replace_what_is_not_a_checkpoint_of_their_form(tmp_path: Path) -> None:
    user = tmp_path / "user_folder"
    user.mkdir()
    (user / "data.csv").write_text("1,2,3")
    (tmp_path / "user_file.ckpt").write_text("not a checkpoint")
    run_distributed(_saves_onto_user_paths, 2, str(tmp_path))
    assert sorted(p.name for p in user.iterdir()) == ["data.csv"] and (user / "data.csv").read_text() == "1,2,3"
    assert (tmp_path / "user_file.ckpt").read_text() == "not a checkpoint"
    assert torch.load(tmp_path / "ours" / "meta.pt", weights_only=True)["global_step"] == 2
    assert torch.load(tmp_path / "empty" / "meta.pt", weights_only=True)["global_step"] == 1
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".partial-")]


def _mixed_precision_round_trip(rank: int, world_size: int, folder_name: str) -> None:
    folder = Path(folder_name)
    for dtype in (torch.bfloat16, torch.float16):
        model, optimizer = _model(mixed_precision=MixedPrecision(dtype, dtype, dtype))
        train_tokens(model, optimizer, 2, seed=rank)
        shards = {n: p.detach().clone() for n, p in model.named_parameters()}
        full = full_state_dict(model, rank0_only=False)
        for name, param in model.named_parameters():
            layout = fsdp_param_of(param).layout
            rows = full[name].reshape(layout.rows, layout.row_numel)[layout.start : layout.start + layout.local_rows]
            assert full[name].dtype == torch.float32, name
            assert torch.equal(rows.reshape(param.shape), param.detach()), f"{dtype}: {name} is not the fp32 shard"
        _save_both(model, [optimizer], folder, f"mixed_{dtype}")
        again, again_optimizer = _model(mixed_precision=MixedPrecision(dtype, dtype, dtype))
        load_full_checkpoint(folder / f"mixed_{dtype}.ckpt", again, [again_optimizer])
        for name, param in again.named_parameters():
            assert torch.equal(param.detach(), shards[name]), f"{dtype}: {name} lost bits in a full round trip"
        train_tokens(model, optimizer, 2, seed=100 + rank)
        train_tokens(again, again_optimizer, 2, seed=100 + rank)
        for name, param in again.named_parameters():
            assert torch.equal(param.detach(), dict(model.named_parameters())[name].detach()), f"{dtype}: resume {name}"


def test_full_checkpoints_under_mixed_precision_hold_the_fp32_shards_exactly(tmp_path: Path) -> None:
    run_distributed(_mixed_precision_round_trip, 2, str(tmp_path))


def _sharded_save_on_a_full_disk(rank: int, world_size: int, disk: str) -> None:
    model, optimizer = _model()
    train_tokens(model, optimizer, 1, seed=rank)
    # The tensors (~180 KB for both ranks) fit, so the save starts; DCP's per-record framing does not.
    with pytest.raises(OSError, match=r"no space left on device: needed ~0.\d MB at .*small_disk.*nothing was left"):
        save_sharded(Path(disk) / "sharded", sharded_checkpoint_state(model, [optimizer]), {"global_step": 1})


def test_a_full_disk_is_named_and_leaves_nothing_behind(small_disk: Path) -> None:
    with pytest.raises(OSError, match=r"no space left on device: needed ~3.8 MB at .*small_disk, 0.2 MB free"):
        save_full_checkpoint(small_disk / "big.ckpt", {"state_dict": {"w": torch.zeros(1_000_000)}})
    assert not list(small_disk.iterdir())  # refused before a byte was written
    # 128 KB of tensor data passes the check up front; torch.save's per-tensor records then run the disk full.
    many = {"state_dict": {f"t{i}": torch.zeros(16) for i in range(2000)}}
    with pytest.raises(OSError, match=r"no space left on device: needed ~0.1 MB at .*small_disk, 0.\d MB free"):
        save_full_checkpoint(small_disk / "many.ckpt", many)
    assert not list(small_disk.iterdir())
    run_distributed(_sharded_save_on_a_full_disk, 2, str(small_disk))
    assert not list(small_disk.iterdir())


def test_the_demos_pretrained_weights_run_no_code(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    torch.save({"state_dict": {}, "payload": Hostile(str(marker))}, tmp_path / "evil.ckpt")
    with pytest.raises(UntrustedCheckpointError, match=r"evil.ckpt: it contains posix.system"):
        LitGPT(pretrained=str(tmp_path / "evil.ckpt")).configure_model()
    (tmp_path / "notes.ckpt").write_text("not weights")
    with pytest.raises(ValueError, match=r"notes.ckpt is not a checkpoint"):
        LitGPT(pretrained=str(tmp_path / "notes.ckpt")).configure_model()
    assert not marker.exists()
