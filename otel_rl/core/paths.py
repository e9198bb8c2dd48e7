"""Turn user-given names (plot, table and artifact names) into paths that stay inside a folder.

A plot named ``"../../outside/x"`` or ``"/etc/x"`` must not write outside ``log_dir``. Every place
where a name becomes a file path goes through :func:`safe_relative` (or :func:`path_inside`):

- ``\\`` and ``/`` both separate folders (a name written on Windows nests the same way);
- empty parts, ``.`` and ``..`` are dropped, so are a leading ``/`` and a drive (``C:/``);
- control characters (NUL included) become ``_``;
- a part longer than :data:`MAX_PART_BYTES` bytes (UTF-8) is cut and ends with ``~`` and a short
  hash of the whole name, so two long names stay distinct; a whole path longer than
  :data:`MAX_TOTAL_BYTES` keeps its first parts and ends in such a hashed part;
- a name left with nothing usable (``""``, ``".."``, ``"/"``) is refused with ``ValueError``.

Readable names stay as they are: ``"train/reward curve"`` → ``train/reward curve``.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

#: Longest folder or file name written (most file systems allow 255 bytes).
MAX_PART_BYTES = 200
#: Longest relative path written (PATH_MAX is 4096 on Linux, 1024 on macOS, log_dir included).
MAX_TOTAL_BYTES = 600

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# "C:/x" is absolute everywhere it matters; "C:x" is drive-relative only on Windows, while on
# POSIX "a:b" is a plain (and common) name that must stay readable.
_DRIVE = re.compile(r"^[A-Za-z]:(?=/|$)" if os.name != "nt" else r"^[A-Za-z]:")


def safe_relative(name: object) -> str:
    """``name`` as a relative path with ``/`` separators that cannot leave its folder.

    Raises ``ValueError`` when nothing usable is left (see the module docstring).
    """
    text = name if isinstance(name, str) else str(name)
    text = _CONTROL.sub("_", text).replace("\\", "/")
    text = _DRIVE.sub("", text)  # a drive never reaches the path
    parts = [p for p in text.split("/") if p not in ("", ".", "..")]
    if not parts:
        raise ValueError(
            f"name {_show(text)} has no usable path part (it is empty, '.', '..' or only "
            "separators); use a name such as 'train/reward'"
        )
    digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    parts = [_cut(p, digest) for p in parts]
    kept: list[str] = []
    total = 0
    for part in parts:
        size = len(part.encode("utf-8", "surrogatepass")) + 1
        if total + size > MAX_TOTAL_BYTES - 12:
            # Too deep: keep what fits and end with a part that still tells names apart.
            kept.append(f"~{digest}")
            break
        kept.append(part)
        total += size
    return "/".join(kept)


def path_inside(root: str | os.PathLike[str], name: object) -> Path:
    """``root / safe_relative(name)``, checked to stay under ``root`` (ValueError otherwise)."""
    base = Path(root)
    path = base.joinpath(*safe_relative(name).split("/"))
    # safe_relative already removed every way up; this guards the rule itself.
    if os.path.commonpath([os.path.abspath(base), os.path.abspath(path)]) != os.path.abspath(base):
        raise ValueError(f"name {_show(str(name))} would leave {base}")
    return path


def _cut(part: str, digest: str) -> str:
    raw = part.encode("utf-8", "surrogatepass")
    if len(raw) <= MAX_PART_BYTES:
        return part
    head = raw[: MAX_PART_BYTES - 11].decode("utf-8", "ignore")
    return f"{head}~{digest}"


def _show(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}… ({len(text)} chars)"


def folder_name(text: str) -> str:
    """``text`` (a run id) as one folder name that names nothing else: no separator, no ``.`` or
    ``..``, no control character, at most :data:`MAX_PART_BYTES` bytes. Letters, digits, ``-``,
    ``_`` and inner dots stay; every other character is percent-encoded, so distinct ids give
    distinct folders (``exp/1`` → ``exp%2F1``, ``..`` → ``%2E.``)."""
    from urllib.parse import quote

    name = quote(text, safe="-_.~")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if not name:
        name = "%"  # quote() never makes a lone "%": the empty id keeps a folder of its own
    if len(name.encode("utf-8")) > MAX_PART_BYTES:
        digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        name = f"{name[: MAX_PART_BYTES - 11]}~{digest}"
    return name
