"""Checkpoints in an object store: a real S3 API (moto's server on 127.0.0.1) and s3fs as the client.

One 2-rank gloo run walks through every case that needs ranks (``_trainer_cases``) and asserts in the ranks: full and
sharded saves through ``ModelCheckpoint`` under ``default_root_dir="s3://..."``, top-k rotation removing our old
checkpoints, a resume with ``ckpt_path="last"`` that restores the saved state and ends where the uninterrupted run
did, a torn sharded checkpoint (its ``.metadata`` deleted) refused, a user's objects at the target refused and left
intact, ``load_pretrained`` from the bucket, and ``fabric.save``/``fabric.load`` in both forms. The test process then
converts from and to the bucket (``convert`` and the CLI) and removes checkpoints through the ``CheckpointIO``.

The ranks reach the server through ``AWS_ENDPOINT_URL`` (the variable Lightning's own ``ModelCheckpoint`` file system
needs, as any fsspec user's would) and Fabric's ``storage_options``; ``convert`` through ``storage_options`` only.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import s3fs
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from moto.server import ThreadedMotoServer
from safetensors.torch import save as save_safetensors

from lightning_fsdp import FSDPStrategy
from lightning_fsdp.checkpoint.convert import convert
from lightning_fsdp.checkpoint.pretrained import load_pretrained
from lightning_fsdp.cli import main as cli_main
from lightning_fsdp.demos.gpt import GPT
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.fabric import FabricFSDPStrategy
from lightning_fsdp.runtime.launch import free_port
from lightning_fsdp.trainer.checkpoint_io import AtomicCheckpointIO
from tests.distributed import run_distributed
from tests.engine_harness import ATOL, RTOL
from tests.scripts.strategy_common import TINY, LitGPT, token_loader

BUCKET = "ckpts"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
STEPS, HALF = 8, 4


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free port of 127.0.0.1 with the bucket ``ckpts``, for the whole session."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CREDENTIALS.items():
            patch.setenv(name, value)
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        endpoint = f"http://127.0.0.1:{port}"
        s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(BUCKET)
        yield endpoint
        server.stop()


def _store(endpoint: str) -> Any:
    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False)


def _trainer(root: str, world_size: int, form: str, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        strategy=FSDPStrategy(state_dict_type=form),
        accelerator="cpu",
        devices=world_size,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


class _RecordStart(L.Callback):
    """The weights a fit starts from, after any restore."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = full_state_dict(pl_module)


def _fit(root: str, world_size: int, form: str, max_steps: int, ckpt_path: str | None = None) -> L.Trainer:
    """``max_steps`` of the tiny GPT, a checkpoint every 2 steps (the newest kept) and ``last`` under ``root``."""
    L.seed_everything(0)
    every_2 = ModelCheckpoint(every_n_train_steps=2, save_top_k=1, save_last=True)
    trainer = _trainer(root, world_size, form, max_steps=max_steps, callbacks=[every_2, _RecordStart()])
    trainer.fit(LitGPT(), token_loader(16, 2), ckpt_path=ckpt_path)
    return trainer


def _weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    return full_state_dict(trainer.lightning_module)


def _trainer_cases(rank: int, world_size: int, endpoint: str, workdir: str) -> None:
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world_size)})
    os.chdir(workdir)  # a mangled URL would show up here as a local folder named "s3:"
    store = _store(endpoint)

    L.seed_everything(0)
    straight = _trainer(workdir, world_size, "full", max_steps=STEPS, enable_checkpointing=False)
    straight.fit(LitGPT(), token_loader(16, 2))
    reference = _weights(straight)

    for form in ("sharded", "full"):
        root = f"s3://{BUCKET}/{form}"
        first = _fit(root, world_size, form, HALF)
        folder = f"{BUCKET}/{form}/checkpoints"
        assert first.checkpoint_callback.last_model_path == f"{root}/checkpoints/last.ckpt"
        saved = sorted(name.rsplit("/", 1)[-1] for name in store.ls(folder))
        assert saved == ["epoch=0-step=4.ckpt", "last.ckpt"], (form, saved)  # step 2 removed by top-k
        if form == "sharded":
            shards = sorted(name.rsplit("/", 1)[-1] for name in store.ls(f"{folder}/last.ckpt"))
            assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], shards
        else:
            assert store.isfile(f"{folder}/last.ckpt")
        at_step_4 = _weights(first)
        resumed = _fit(root, world_size, form, STEPS, ckpt_path="last")
        start = next(callback for callback in resumed.callbacks if isinstance(callback, _RecordStart)).weights
        for name, value in at_step_4.items():
            torch.testing.assert_close(start[name], value, rtol=0, atol=0, msg=f"{form} restored {name}")
        assert resumed.global_step == STEPS
        saved = sorted(name.rsplit("/", 1)[-1] for name in store.ls(folder))
        assert saved == ["epoch=1-step=8.ckpt", "last.ckpt"], (form, saved)
        weights = _weights(resumed)
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, rtol=RTOL, atol=ATOL, msg=f"{form} {name}")
    assert not Path(workdir, "s3:").exists(), "a URL was taken for a local path"

    # A torn sharded checkpoint (the completion mark gone) is refused before the model changes.
    torn = f"s3://{BUCKET}/sharded/checkpoints/epoch=1-step=8.ckpt"
    if rank == 0:
        store.rm_file(f"{torn[5:]}/.metadata")
    dist.barrier()
    trainer = _trainer(workdir, world_size, "sharded", max_steps=STEPS, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"incomplete \(torn\): .metadata is missing"):
        trainer.fit(LitGPT(), token_loader(16, 2), ckpt_path=torn)

    # A user's objects at the target are refused and left as they were, in either form.
    if rank == 0:
        store.pipe(f"{BUCKET}/user/notes.ckpt", b"my notes")
        store.pipe(f"{BUCKET}/user/folder/readme.txt", b"keep me")
    dist.barrier()
    for form, target, key, content in (
        ("full", "user/notes.ckpt", "user/notes.ckpt", b"my notes"),
        ("sharded", "user/folder", "user/folder/readme.txt", b"keep me"),
        ("sharded", "user/notes.ckpt", "user/notes.ckpt", b"my notes"),
    ):
        trainer = _trainer(workdir, world_size, form, max_steps=1, enable_checkpointing=False)
        trainer.fit(LitGPT(), token_loader(4, 2))
        with pytest.raises(FileExistsError, match="not"):
            trainer.save_checkpoint(f"s3://{BUCKET}/{target}")
        assert store.cat_file(f"{BUCKET}/{key}") == content, (form, target)
    assert sorted(store.find(f"{BUCKET}/user")) == [f"{BUCKET}/user/folder/readme.txt", f"{BUCKET}/user/notes.ckpt"]
    # load_pretrained from the bucket (a folder URL): each rank fetches the byte ranges of its own rows.
    if rank == 0:
        store.pipe(
            f"{BUCKET}/pretrained/model.safetensors", save_safetensors({k: v.clone() for k, v in reference.items()})
        )
    dist.barrier()
    loaded = load_pretrained(trainer.lightning_module, f"s3://{BUCKET}/pretrained")
    assert not loaded.missing and not loaded.unexpected, loaded
    for name, value in full_state_dict(trainer.lightning_module).items():  # rank 0 holds them
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=f"pretrained {name}")
    _fabric_round_trips(world_size, endpoint, store)
    if rank == 0:
        torch.save(reference, Path(workdir, "reference.pt"))


def _fabric_round_trips(world_size: int, endpoint: str, store: Any) -> None:
    """``fabric.save`` to the bucket (the strategy's ``storage_options``), ``fabric.load`` into another model."""
    for form in ("sharded", "full"):
        strategy = FabricFSDPStrategy(state_dict_type=form, storage_options={"endpoint_url": endpoint})
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()  # the ranks exist already (LOCAL_RANK is set)
        saved_weights = None
        for seed in (0, 1):
            torch.manual_seed(seed)
            model = GPT(TINY)
            model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
            tokens = torch.randint(0, TINY.vocab_size, (2, TINY.block_size + 1), generator=torch.Generator())
            fabric.backward(model(tokens[:, :-1], tokens[:, 1:]))
            optimizer.step()
            state = {"model": model, "optimizer": optimizer, "step": seed}
            url = f"s3://{BUCKET}/fabric/{form}"
            if seed == 0:
                fabric.save(url, state)
                saved_weights = full_state_dict(model)
            else:
                fabric.load(url, state)
                assert state["step"] == 0
                for name, value in full_state_dict(model).items():
                    torch.testing.assert_close(value, saved_weights[name], rtol=0, atol=0, msg=f"fabric {form} {name}")
        assert store.isfile(f"{BUCKET}/fabric/{form}" + ("/.metadata" if form == "sharded" else ""))


@pytest.fixture(scope="module")
def trained(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("remote")
    run_distributed(_trainer_cases, 2, s3_endpoint, str(workdir), timeout=300)
    return workdir


def test_trainer_saves_resumes_rotates_and_refuses_in_a_bucket(trained: Path) -> None:
    assert (trained / "reference.pt").is_file()  # the ranks asserted everything; this says they got to the end


def test_convert_reads_from_and_writes_to_a_bucket(
    trained: Path, s3_endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    options = {"endpoint_url": s3_endpoint}
    store = _store(s3_endpoint)
    reference = torch.load(trained / "reference.pt", weights_only=True)
    sharded_last = f"s3://{BUCKET}/sharded/checkpoints/last.ckpt"
    full_in_bucket = f"s3://{BUCKET}/converted/full.ckpt"
    convert(sharded_last, full_in_bucket, "full", quiet=True, storage_options=options)
    local = trained / "full.ckpt"
    store.get_file(full_in_bucket[5:], str(local))
    weights = torch.load(local, weights_only=True)["state_dict"]
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=RTOL, atol=ATOL)
    convert(str(local), f"s3://{BUCKET}/converted/sharded", "sharded", quiet=True, storage_options=options)
    assert store.isfile(f"{BUCKET}/converted/sharded/.metadata")
    cli_main(["convert", sharded_last, f"s3://{BUCKET}/cli/full.ckpt", "--storage-options", json.dumps(options)])
    assert capsys.readouterr().out.strip() == f"wrote s3://{BUCKET}/cli/full.ckpt"
    assert torch.load(io.BytesIO(store.cat_file(f"{BUCKET}/cli/full.ckpt")), weights_only=True)["global_step"] == STEPS
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        convert(
            str(local), f"s3://{BUCKET}/user/notes.ckpt", "full", quiet=True, overwrite=True, storage_options=options
        )
    assert store.cat_file(f"{BUCKET}/user/notes.ckpt") == b"my notes"


def test_removal_leaves_what_is_not_our_checkpoint(trained: Path, s3_endpoint: str) -> None:
    """``ModelCheckpoint``'s rotation goes through ``remove_checkpoint``: our objects go, anything else stays."""
    store = _store(s3_endpoint)
    io_plugin = AtomicCheckpointIO(TorchCheckpointIO())
    store.pipe(f"{BUCKET}/mixed/ckpt/meta.pt", b"ours by name")
    store.pipe(f"{BUCKET}/mixed/ckpt/notes.txt", b"a user's")
    ours = io.BytesIO()
    torch.save({"state_dict": {}}, ours)
    store.pipe(f"{BUCKET}/mixed/old.ckpt", ours.getvalue())
    os.environ["AWS_ENDPOINT_URL"] = s3_endpoint  # the plugin takes no storage options: fsspec's configuration
    try:
        with pytest.warns(UserWarning, match=r"not removing .*not part of a sharded checkpoint \(notes.txt\)"):
            io_plugin.remove_checkpoint(f"s3://{BUCKET}/mixed/ckpt")
        with pytest.warns(UserWarning, match="not a checkpoint"):
            io_plugin.remove_checkpoint(f"s3://{BUCKET}/user/notes.ckpt")
        io_plugin.remove_checkpoint(f"s3://{BUCKET}/mixed/old.ckpt")
    finally:
        del os.environ["AWS_ENDPOINT_URL"]
    assert sorted(store.find(f"{BUCKET}/mixed")) == [f"{BUCKET}/mixed/ckpt/meta.pt", f"{BUCKET}/mixed/ckpt/notes.txt"]
    assert store.cat_file(f"{BUCKET}/user/notes.ckpt") == b"my notes"
    assert not store.exists(f"{BUCKET}/mixed/old.ckpt")
