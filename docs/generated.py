"""A generated part of a doc page: what lies between two HTML comment markers.

The page generators (``gen_config_table.py``, ``gen_metrics_table.py``) rewrite their parts with
:func:`with_part`; their tests compare :func:`part_in` with what they would write.
"""

from __future__ import annotations

from pathlib import Path


def with_part(text: str, markers: tuple[str, str], part: str, doc: Path | str = "the page") -> str:
    """``text`` with what lies between the two markers replaced by ``part``."""
    start, end = markers
    head, found, rest = text.partition(start)
    _, found_end, tail = rest.partition(end)
    if not (found and found_end):
        raise ValueError(f"{doc}: the markers {start!r} … {end!r} are missing")
    return f"{head}{start}\n{part}\n{end}{tail}"


def part_in(text: str, markers: tuple[str, str]) -> str:
    """What lies between the two markers of ``text``."""
    start, end = markers
    return text.partition(start)[2].partition(end)[0].strip("\n")


def rewrite(doc: Path, parts: list[tuple[tuple[str, str], str]]) -> bool:
    """Write each part between its markers in ``doc``; returns whether the page changed."""
    text = doc.read_text(encoding="utf-8")
    updated = text
    for markers, part in parts:
        updated = with_part(updated, markers, part, doc)
    if updated != text:
        doc.write_text(updated, encoding="utf-8")
        print(f"updated {doc}")
    return updated != text
