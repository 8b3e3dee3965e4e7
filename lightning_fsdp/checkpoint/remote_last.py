"""``ckpt_path="last"`` under a ``ModelCheckpoint`` whose folder is in an object store.

Lightning resolves ``"last"`` by listing each ``ModelCheckpoint``'s folder with its fsspec file system and asking for
each candidate's modification time. In a store both steps fail: the listing returns keys without their protocol
(``bucket/ckpts/last.ckpt``), which Lightning then looks up on the local disk and does not find; a folder under a
remote ``default_root_dir`` is listed on the local disk in the first place; and a sharded checkpoint is a prefix,
which has no modification time. The run then starts from scratch with only a warning.

``resolve_remote_last`` widens the Trainer's resolution by exactly our strategy and remote folders (everything else
meets Lightning's own code unchanged): the newest *complete* ``last*.ckpt`` under each remote folder -- an object,
or a prefix whose completion mark ``.metadata`` is there, dated by that mark.
"""

from __future__ import annotations

import re
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.remote import completed_at

__all__ = ["resolve_remote_last"]


def resolve_remote_last(strategy_class: type) -> None:
    """Make the Trainer find ``ckpt_path="last"`` in remote ``ModelCheckpoint`` folders under ``strategy_class``."""
    lightning_parse = _CheckpointConnector._parse_ckpt_path
    if getattr(lightning_parse, "resolves_remote_last_for", None) is strategy_class:
        return

    def parse_ckpt_path(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        if ckpt_path == "last" and isinstance(self.trainer.strategy, strategy_class):
            folders = [
                str(callback._ModelCheckpoint__resolve_ckpt_dir(self.trainer))  # what Lightning's own lookup uses
                for callback in self.trainer.checkpoint_callbacks
                if isinstance(callback, ModelCheckpoint)
            ]
            remote = [folder for folder in folders if is_remote(folder)]
            newest = _newest_last(remote, ModelCheckpoint.CHECKPOINT_NAME_LAST, ModelCheckpoint.FILE_EXTENSION)
            if newest is not None:
                return newest
        return lightning_parse(self, state_fn, ckpt_path, *args, **kwargs)

    parse_ckpt_path.resolves_remote_last_for = strategy_class  # type: ignore[attr-defined]
    _CheckpointConnector._parse_ckpt_path = parse_ckpt_path  # type: ignore[method-assign]


def _newest_last(folders: list[str], name: str, extension: str) -> str | None:
    from fsspec.core import url_to_fs

    pattern = re.compile(rf"^{re.escape(name)}(-\d+)?{re.escape(extension)}$")
    found: dict[str, float] = {}
    for folder in folders:
        fs, path = url_to_fs(folder)
        fs.invalidate_cache()
        if not fs.exists(path):
            continue
        for entry in fs.ls(path, detail=False):
            if pattern.match(entry.rstrip("/").rsplit("/", 1)[-1]):
                url = f"{folder.rstrip('/')}/{entry.rstrip('/').rsplit('/', 1)[-1]}"
                when = completed_at(url)
                if when is not None:
                    found[url] = when
    return max(found, key=found.__getitem__) if found else None
