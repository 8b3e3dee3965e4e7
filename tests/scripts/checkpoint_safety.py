"""The Trainer's checkpoint entry points with files that are not ours and paths that belong to the user (2 processes).

Every check is asserted here, on every rank; the script exits 0 only if all held. Rank 0 writes OUT_DIR/done.json
with the messages it saw, for the test to show.

- Hostile pickles (OUT_DIR/hostile/: a full file, a sharded folder with a hostile ``meta.pt``, one with a hostile
  ``.metadata``; written by the test) through ``fit``, ``validate`` and ``test`` with ``ckpt_path``, with
  ``weights_only`` unset and True: refused by name, nothing run. ``trust_checkpoint=True`` with an explicit
  ``weights_only=True`` is still refused.
- The opt-in: a checkpoint holding a harmless foreign object (a ``Fraction`` among the hyperparameters) resumes with
  ``weights_only=False`` and with ``FSDPStrategy(trust_checkpoint=True)``.
- ``trainer.save_checkpoint`` onto the user's folder and file (OUT_DIR/user_folder, OUT_DIR/user_file.ckpt):
  refused on every rank, full and sharded, before anything is written.
- ``AsyncCheckpointIO``: a checkpoint every step, full and sharded; each is complete and resumable.
- ``bf16-mixed`` and ``16-mixed``: the full checkpoint holds the fp32 shards bit for bit, and a run resumed from it
  ends exactly where the uninterrupted one did.

Usage: python tests/scripts/checkpoint_safety.py OUT_DIR
"""

from __future__ import annotations

import fractions
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from strategy_common import LitGPT, make_trainer, out_dir, token_loader

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.checkpoint.safe_load import UntrustedCheckpointError
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.engine.runtime.registry import fsdp_param_of
from lightning_fsdp.runtime.process_exit import exit_after_distributed_run

MESSAGES: dict[str, str] = {}


def seeded(cls: type[L.LightningModule] = LitGPT) -> L.LightningModule:
    """A model with the same initial weights on every rank (the engine refuses ranks that differ)."""
    torch.manual_seed(0)
    return cls()


def strategy(**options: Any) -> FSDPStrategy:
    return FSDPStrategy(auto_wrap_policy={Block}, **options)


def expect_refusal(
    label: str, error: type[BaseException], pattern: str, call: Callable[..., Any], *args: Any, **kwargs: Any
) -> None:
    try:
        call(*args, **kwargs)
    except error as err:
        assert pattern in str(err), f"{label}: {err}"
        MESSAGES[label] = str(err)
        return
    raise AssertionError(f"{label}: no {error.__name__} was raised")


def shards(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.lightning_module.named_parameters()}


def hostile_entry_points(out: Path) -> None:
    marker = out / "PWNED"
    for name in ("evil.ckpt", "evil_meta", "evil_metadata"):
        path = out / "hostile" / name
        for call in ("fit", "validate", "test"):
            for weights_only in (None, True):
                trainer = make_trainer(strategy(), max_steps=1)
                loader = token_loader(4, 2)
                loaders = {"train_dataloaders": loader} if call == "fit" else {"dataloaders": loader}
                expect_refusal(
                    f"{call} {name} weights_only={weights_only}",
                    UntrustedCheckpointError,
                    "posix.system, which is not plain data",
                    getattr(trainer, call),
                    seeded(),
                    ckpt_path=path,
                    weights_only=weights_only,
                    **loaders,
                )
                assert not marker.exists(), f"{call} {name}: the file's code ran"
    trainer = make_trainer(strategy(trust_checkpoint=True), max_steps=1)
    expect_refusal(
        "trust_checkpoint=True but weights_only=True",
        UntrustedCheckpointError,
        "weights_only=False",
        trainer.validate,
        seeded(),
        token_loader(4, 2),
        ckpt_path=out / "hostile" / "evil.ckpt",
        weights_only=True,
    )
    assert not marker.exists()


class WithFraction(LitGPT):
    """A model whose hyperparameters hold a ``Fraction``: harmless, but not plain data."""

    def __init__(self, ratio: fractions.Fraction = fractions.Fraction(1, 3)) -> None:
        super().__init__()
        self.save_hyperparameters()


def trusted_resume(out: Path) -> None:
    trainer = make_trainer(strategy(), max_steps=2)
    trainer.fit(seeded(WithFraction), token_loader(8, 2))
    trainer.save_checkpoint(out / "fraction.ckpt")
    expect_refusal(
        "foreign object without opt-in",
        UntrustedCheckpointError,
        "fractions.Fraction",
        make_trainer(strategy(), max_steps=3).fit,
        seeded(WithFraction),
        token_loader(8, 2),
        ckpt_path=out / "fraction.ckpt",
    )
    for options, weights_only in (({}, False), ({"trust_checkpoint": True}, None)):
        trainer = make_trainer(strategy(**options), max_steps=3)
        trainer.fit(
            seeded(WithFraction), token_loader(8, 2), ckpt_path=out / "fraction.ckpt", weights_only=weights_only
        )
        assert trainer.global_step == 3


def user_paths(out: Path) -> None:
    for state_dict_type in ("full", "sharded"):
        trainer = make_trainer(strategy(state_dict_type=state_dict_type), max_steps=1)
        trainer.fit(seeded(), token_loader(4, 2))
        expect_refusal(
            f"{state_dict_type} save onto the user's folder",
            FileExistsError,
            "user_folder is a folder",
            trainer.save_checkpoint,
            out / "user_folder",
        )
        expect_refusal(
            f"{state_dict_type} save onto the user's file",
            FileExistsError,
            "user_file.ckpt",
            trainer.save_checkpoint,
            out / "user_file.ckpt",
        )


def async_saves(out: Path) -> None:
    for state_dict_type in ("full", "sharded"):
        folder = out / f"async_{state_dict_type}"
        every_step = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last=True)
        trainer = make_trainer(
            strategy(state_dict_type=state_dict_type),
            max_steps=3,
            plugins=[AsyncCheckpointIO()],
            callbacks=[every_step],
            enable_checkpointing=True,
        )
        trainer.fit(seeded(), token_loader(12, 2))
        torch.distributed.barrier()  # rank 0's teardown waited for its background writes
        names = sorted(p.name for p in folder.iterdir())
        assert names == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"], names
        resumed = make_trainer(strategy(state_dict_type=state_dict_type), max_steps=4)
        resumed.fit(seeded(), token_loader(16, 2), ckpt_path=folder / "last.ckpt")
        assert resumed.global_step == 4


def mixed_precision_round_trip(out: Path) -> None:
    for precision in ("bf16-mixed", "16-mixed"):
        L.seed_everything(0)
        straight = make_trainer(strategy(), max_steps=4, precision=precision)
        straight.fit(seeded(), token_loader(8, 2))  # 2 steps an epoch, the same order every epoch
        expected = shards(straight)
        L.seed_everything(0)
        # Saved by ModelCheckpoint at the end of the first epoch: a point Lightning resumes from exactly.
        at_step_2 = ModelCheckpoint(dirpath=out / precision, every_n_train_steps=2)
        first = make_trainer(
            strategy(), max_steps=2, precision=precision, callbacks=[at_step_2], enable_checkpointing=True
        )
        first.fit(seeded(), token_loader(8, 2))
        path = out / precision / "epoch=0-step=2.ckpt"
        saved = torch.load(path, weights_only=True, mmap=True)["state_dict"]
        for name, param in first.lightning_module.named_parameters():
            layout = fsdp_param_of(param).layout
            rows = saved[name].reshape(layout.rows, layout.row_numel)[layout.start : layout.start + layout.local_rows]
            assert saved[name].dtype == torch.float32, f"{precision}: {name} saved as {saved[name].dtype}"
            assert torch.equal(rows.reshape(param.shape), param.detach()), f"{precision}: {name} is not the shard"
        L.seed_everything(0)
        resumed = make_trainer(strategy(), max_steps=4, precision=precision)
        resumed.fit(seeded(), token_loader(8, 2), ckpt_path=path)
        for name, value in shards(resumed).items():
            assert torch.equal(value, expected[name]), f"{precision}: resumed {name} differs from the straight run"


def main() -> None:
    out = out_dir()
    hostile_entry_points(out)
    trusted_resume(out)
    user_paths(out)
    async_saves(out)
    mixed_precision_round_trip(out)
    if torch.distributed.get_rank() == 0:
        (out / "done.json").write_text(json.dumps(MESSAGES, indent=1))


if __name__ == "__main__":
    main()
    exit_after_distributed_run()
