"""The full checkpoint file through any Lightning ``CheckpointIO`` plugin, still atomic.

Lightning hands a strategy's ``save_checkpoint`` to ``self.checkpoint_io``. Ours must stay atomic whatever plugin
the user chose: ``AtomicCheckpointIO`` wraps any plugin so that it writes into a temporary sibling that is renamed
into place when complete (``checkpoint/atomic.py``). With Lightning's ``AsyncCheckpointIO`` (or ``async_save=True``)
the strategy runs the plugin it wraps, made atomic, in its own background writer (``checkpoint/async_save.py``): one
save in flight, its failure raised on every rank, removals after the write. Lightning's plain ``TorchCheckpointIO``
is replaced by our streaming ``torch.save`` (it would first serialise the whole checkpoint into memory). At an
fsspec URL the file is one upload instead, visible only when complete (``checkpoint/remote.py``).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_fsdp.checkpoint.atomic import remove, tensor_bytes, write_file_atomically
from lightning_fsdp.checkpoint.full import save_full_checkpoint
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.remote import remove_remote, save_full_remote

__all__ = ["AtomicCheckpointIO", "atomic_checkpoint_io"]


class AtomicCheckpointIO(CheckpointIO):
    """``inner``'s saves, written into a temporary sibling and renamed into place only when complete."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if is_remote(path) and type(self.inner) is TorchCheckpointIO:
            save_full_remote(path, checkpoint, storage_options)  # one upload: visible only when complete
            return
        if is_remote(path):  # the user's plugin writes to the store its own way
            self.inner.save_checkpoint(checkpoint, path, storage_options)
            return
        if type(self.inner) is TorchCheckpointIO and storage_options is None:
            save_full_checkpoint(path, checkpoint)
            return
        write_file_atomically(
            path,
            lambda tmp: self.inner.save_checkpoint(checkpoint, tmp, storage_options),
            expected_bytes=tensor_bytes(checkpoint),
        )

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        if not is_remote(path):
            remove(path)
            return
        left = remove_remote(path)
        if left is not None:
            rank_zero_warn(f"not removing {path}: {left}")

    @override
    def teardown(self) -> None:
        self.inner.teardown()


def atomic_checkpoint_io(io: CheckpointIO) -> AtomicCheckpointIO:
    """``io`` with every save atomic and synchronous: wrapped; for ``AsyncCheckpointIO``, the plugin it wraps (the
    strategy runs the save in its own background writer, see ``checkpoint/async_save.py``)."""
    if isinstance(io, AsyncCheckpointIO):
        io = io.checkpoint_io if io.checkpoint_io is not None else TorchCheckpointIO()
    return io if isinstance(io, AtomicCheckpointIO) else AtomicCheckpointIO(io)
