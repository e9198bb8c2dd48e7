"""Map row keys to names MLflow accepts, the same way for the whole run.

MLflow's rules for metric and param names: only letters, digits, ``_ - . /`` and spaces (a
colon too, except on Windows servers, so it is mapped here), at most 250 characters, and the name
must not change under ``posixpath.normpath`` (no leading or trailing ``/``, no ``//``, no ``.`` or
``..`` segments, no name that starts with ``..``). A key that breaks a rule is rewritten
deterministically (the same key always gives the same name); two keys that would end up with one
name are told apart by a short hash of the key. With the file store, where a name is a file path,
a key that is both a name and a folder (``timing/x`` next to ``timing/x/total``) cannot be stored
as both; there the later one gets the ``/`` at the clash replaced by ``.`` (``timing/x.total``).
Database stores keep both names as they are, and so does a tracking server with a database
backend (the default since MLflow 3).
"""

from __future__ import annotations

import hashlib
import re

from otel_rl.process.fork_safe_log import log as _log

MAX_NAME_LENGTH = 250
_INVALID = re.compile(r"[^\w.\- /]+")
_RULES = (
    "letters, digits, _ - . / and spaces; no empty, '.' or '..' segments, no leading '..'; "
    "<= 250 chars"
)


def sanitize(key: str) -> str:
    """The MLflow-valid form of ``key`` (``key`` itself when it is already valid)."""
    name = _INVALID.sub("_", key)
    segments = []
    for segment in name.split("/"):
        if not segment:
            continue  # "//", a leading or a trailing "/"
        segments.append({".": "_", "..": "__"}.get(segment, segment))
    name = "/".join(segments) or "_"
    if name.startswith(".."):
        name = "_" + name[1:]  # MLflow refuses any name that starts with "..", as "..0" does
    if len(name) > MAX_NAME_LENGTH:
        name = _with_suffix(name, key)
    return name


def _digest(key: str) -> str:
    return hashlib.sha1(key.encode("utf-8")).hexdigest()[:8]


def _with_suffix(name: str, key: str) -> str:
    suffix = "-" + _digest(key)
    return name[: MAX_NAME_LENGTH - len(suffix)].rstrip("/") + suffix


class NameMap:
    """Row key → MLflow name, stable for the run; each rewritten key is reported once.

    ``kind`` is used in the report ("metric", "param"). ``file_store`` turns on the
    name-versus-folder check that only MLflow's file store needs.
    """

    def __init__(self, kind: str, *, file_store: bool = False) -> None:
        self.kind = kind
        self.file_store = file_store
        #: Keys whose MLflow name differs from the key, with that name.
        self.renamed: dict[str, str] = {}
        self._names: dict[str, str] = {}
        self._owner: dict[str, str] = {}  # MLflow name -> the key that holds it
        self._folders: set[str] = set()

    def __call__(self, key: str) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._assign(key)
        return name

    def _assign(self, key: str) -> str:
        name = sanitize(key)
        if self._taken(name, key) and self.file_store:
            name = self._beside_the_clash(name)
        if self._taken(name, key):
            name = _with_suffix(name, key)
        self._names[key] = name
        self._owner[name] = key
        if self.file_store:
            parts = name.split("/")
            self._folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
        if name != key:
            self.renamed[key] = name
            _log.warning(
                "otel-rl: mlflow: %s %r is stored as %r (MLflow names: %s)",
                self.kind,
                key,
                name,
                _RULES,
            )
        return name

    def _beside_the_clash(self, name: str) -> str:
        """A file-store name that is neither an existing metric's folder nor inside a metric:
        ``timing/x/total`` next to ``timing/x`` becomes ``timing/x.total``; ``timing/x`` next to
        ``timing/x/total`` becomes ``timing.x``."""
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in self._owner:  # a metric where this name needs a folder
                return "/".join([*parts[: i - 1], ".".join(parts[i - 1 :])])
        if len(parts) > 1:  # the name is a folder of other metrics
            return "/".join([*parts[:-2], ".".join(parts[-2:])])
        return name

    def _taken(self, name: str, key: str) -> bool:
        owner = self._owner.get(name)
        if owner is not None and owner != key:
            return True
        if not self.file_store:
            return False
        if name in self._folders:
            return True
        parts = name.split("/")
        return any("/".join(parts[:i]) in self._owner for i in range(1, len(parts)))
