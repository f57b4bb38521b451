"""Output files: refused before any long work when they cannot be written, and a failed write as one line."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from memplan.planner.core.errors import MemplanError


def writable(*paths: Path | None) -> None:
    """Refuse, before any long work, an output that cannot be written: a folder, or a file whose folder
    cannot be created or written (missing folders are created now)."""
    for path in paths:
        if path is None:
            continue
        if path.is_dir():
            raise MemplanError(f"cannot write {path}: it is a folder")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MemplanError(f"cannot write {path}: cannot create folder {path.parent}: {e.strerror}") from None
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise MemplanError(f"cannot write {path}: permission denied")


@contextlib.contextmanager
def writing(path: Path) -> Any:
    """Create ``path``'s folder, and turn a failed write (full disk, a folder removed meanwhile) into one
    line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as e:
        raise MemplanError(f"cannot write {path}: {e.strerror or e}") from None
