"""Where a checkpoint path points: a local path, or an fsspec URL of a store (``s3://bucket/key``, ``gs://...``).

Every checkpoint entry point asks ``is_remote`` first and hands URLs to ``remote.py``; a local path goes the way it
always went. The test is fsspec's (through Lightning's helper): a protocol other than ``file``.
"""

from __future__ import annotations

import os

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

__all__ = ["is_remote"]


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an fsspec URL of a store (``s3://...``) rather than a local path (``file://`` is local).

    A ``pathlib.Path`` is always local: ``Path("s3://b/k")`` has already lost the URL (it reads ``s3:/b/k``).
    """
    return isinstance(path, str) and not _is_local_file_protocol(path)
