"""Writing a benchmark's figures into docs/benchmarks.md: one section between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` markers, replaced in place, or appended under ``heading`` when the markers are new."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def update_section(name: str, heading: str, text: str, doc_path: Path = DOC) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = doc_path.read_text() if doc_path.exists() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        doc = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    else:
        doc = (doc.rstrip("\n") + "\n\n" if doc else "") + f"## {heading}\n\n{block}\n"
    doc_path.write_text(doc)


def publish(text: str, update_doc: bool, name: str, heading: str) -> None:
    """Print a benchmark's section and, with ``update_doc``, write it into docs/benchmarks.md."""
    print(text)
    if update_doc:
        update_section(name, heading, text)
