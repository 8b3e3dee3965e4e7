"""Fixtures shared by several test modules."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def small_disk(tmp_path: Path) -> Path:
    """A 256 KiB tmpfs: a real file system that runs full (the kernel's ENOSPC, nothing simulated)."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)
