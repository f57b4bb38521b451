"""Reading memplan's files (graph, plan, device spec): one place that turns an OS error into the
caller's domain error, naming the file and what it was meant to be."""

from __future__ import annotations

import json
from pathlib import Path

from memplan.planner.core.errors import MemplanError


def read_file_bytes(path: str | Path, *, what: str, error: type[MemplanError]) -> bytes:
    """The bytes of ``path``; raises ``error("cannot read {what} {path}: {reason}")`` when the OS
    refuses (missing, a directory, no permission)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None


def parse_json_object(text: str | bytes, *, source: str, error: type[MemplanError],
                      expected: str = "a JSON object") -> dict:
    """The JSON object in ``text``; raises ``error`` prefixed with ``source`` when it is not JSON
    ("not valid JSON (...)") or not an object ("expected {expected}")."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{source}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{source}: expected {expected}")
    return data
