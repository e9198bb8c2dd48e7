"""Redact secrets from hyperparameters, configs and log lines before they reach any tracker.

The rules (docs/security.md has the table and the reasons):

1. **Secret key names, by whole words.** A key is split into words on every non-alphanumeric
   character (``_ . - /`` and the like), on lower→upper case changes (``apiKey``) and between
   letters and digits. Words are compared lower-cased and trailing number words are ignored
   (``password2``). A key is secret when its *last* words are a secret word sequence
   (:data:`SECRET_WORDS`): ``hf_token``, ``wandb.api_key``, ``HF_TOKEN``, ``apiKey``,
   ``client_secret`` go; ``max_new_tokens``, ``token_level_loss``, ``author``,
   ``tokenizer_path`` stay, because ``tokens``/``author``/``tokenizer`` are other words and a
   secret word followed by another word (``token_level_loss``, ``password_file``) names
   something else.
2. **Everything below a secret-named key** is redacted (``secrets: {openai: x}``,
   ``credentials: [{key: x}]``); the structure stays, the leaves go. ``None``, ``""`` and booleans
   are kept: they show whether a secret is set without showing it.
3. **Headers.** Under a key whose last word is ``headers``, every header value is redacted except
   the few in :data:`SAFE_HEADERS`.
4. **In every string value** (and in :func:`redact_text` for log lines): the password of a URL's
   userinfo (``scheme://user:PASS@host`` → ``scheme://user:***REDACTED***@host``; a userinfo
   without password that looks like a token, 16 characters or more, goes whole), the value of an
   assignment to a secret-named key (``--hf_token=x``, ``password: x``, ``?api_key=x``), a
   ``Bearer`` token, and every known secret value: secret environment variables (by name, as in
   rule 1, plus :data:`KNOWN_SECRET_ENV`), the values of ``OTEL_EXPORTER_OTLP_*HEADERS``, and the
   secrets found by rules 1-3 in the same structure.
5. **Extra patterns** (``redaction.extra_patterns`` in the config, ``extra_patterns=`` here): a
   regex is matched like a built-in secret word sequence against a key's trailing words (joined
   with ``_``, lower case); ``value:<regex>`` is searched in every string value instead.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

REDACTED = "***REDACTED***"

#: Secret words and word sequences (words joined by ``_``), matched against a key's last words.
SECRET_WORDS = (
    "password", "passwords", "passwd", "pwd", "passphrase",
    "secret", "secrets", "secret_key",
    "token", "api_key", "apikey", "access_key", "private_key",
    "credential", "credentials", "auth", "authorization",
)  # fmt: skip
_LONGEST_SEQUENCE = max(w.count("_") + 1 for w in SECRET_WORDS)
_BUILTIN_KEY = re.compile("|".join(SECRET_WORDS))
#: Words that make ``<word>_token`` a tokenizer's special token, not a credential:
#: ``pad_token``, ``eos_token``, ``image_token``... (tokenizer and chat-template settings).
TOKEN_KINDS = frozenset({
    "pad", "eos", "bos", "unk", "sep", "cls", "mask", "start", "end", "stop", "special",
    "image", "video", "audio", "vision", "think", "answer", "reasoning", "placeholder", "chat",
    "system", "user", "assistant", "tool", "default", "last", "first", "next", "prev", "seq",
})  # fmt: skip

#: Environment variables whose value is a secret although their name does not say so by rule 1.
KNOWN_SECRET_ENV = (
    "WANDB_API_KEY", "SWANLAB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
    "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "NGC_API_KEY", "OPENAI_API_KEY",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GITHUB_TOKEN", "DATABRICKS_TOKEN",
    "COMET_API_KEY", "NEPTUNE_API_TOKEN", "AZURE_STORAGE_KEY", "TRACKIO_WRITE_TOKEN",
)  # fmt: skip
#: Header lists in OTel's ``k=v,k=v`` form: every value in them is a secret.
HEADER_ENV = (
    "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_LOGS_HEADERS",
)  # fmt: skip
#: Secret-looking names that are not secrets (``PWD`` is the working directory).
_NOT_SECRET_ENV = frozenset({"PWD", "OLDPWD"})
#: Header names whose values are kept (compared lower-case, ``_`` read as ``-``).
SAFE_HEADERS = frozenset({
    "accept", "accept-encoding", "accept-language", "cache-control", "connection",
    "content-encoding", "content-length", "content-type", "user-agent",
})  # fmt: skip

# Values shorter than this are not replaced inside other text: "true", "1234" or "test" would
# damage unrelated strings. They are still redacted where their key says they are secret.
_MIN_ENV_VALUE = 4
_MIN_FOUND_VALUE = 8
_MIN_NAMED_ENV_VALUE = 8
# A userinfo without a password this long is a token used as user name (https://<token>@host).
_MIN_TOKEN_USER = 16

_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+|[^\W\d_A-Za-z]+")
_PIECES = re.compile(r"[\W_]+")
_COMPONENT_SEP = re.compile(r"[./]")
_URL_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/?#@:'\"]*)"
    r"(?::(?P<password>[^\s/?#'\"]*))?@"
)
# ``key=value`` / ``key: value`` / ``"key": "value"`` inside text; only the key and separator are
# matched, so that a value never hides the next assignment (``cmd=--hf_token=x``).
_ASSIGNMENT = re.compile(r"(?P<key>[A-Za-z][\w.\-]*)[\"']?[ \t]*[=:](?!//)[ \t]*")
_ASSIGNED_VALUE = re.compile(
    r"\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|(?:(?:Bearer|Basic|Token)[ \t]+)?[^\s,;&\"'<>)\]}]+"
)
_BEARER = re.compile(r"\b(?P<scheme>Bearer[ \t]+)[A-Za-z0-9._~+/=\-]{8,}")


def key_words(key: str) -> list[str]:
    """The lower-case words of ``key``: ``"wandb.apiKey"`` → ``["wandb", "api", "key"]``."""
    words: list[str] = []
    for piece in _PIECES.split(str(key)):
        words.extend(w.lower() for w in _WORD.findall(piece))
    return words


@dataclass(frozen=True)
class Patterns:
    """Compiled extra patterns: for key words, and for string values."""

    keys: tuple[re.Pattern[str], ...] = ()
    values: tuple[re.Pattern[str], ...] = ()
    source: tuple[str, ...] = field(default=(), compare=False)


@functools.lru_cache(maxsize=32)
def compile_patterns(extra_patterns: tuple[str, ...] = ()) -> Patterns:
    """Compile ``extra_patterns`` (``"<regex>"`` for key words, ``"value:<regex>"`` for values).

    Raises ``ValueError`` naming the pattern if one is not a valid regex or matches the empty
    string (it would redact everything).
    """
    keys: list[re.Pattern[str]] = []
    values: list[re.Pattern[str]] = []
    for raw in extra_patterns:
        if not isinstance(raw, str):
            raise ValueError(f"redaction.extra_patterns: {raw!r} is not a string")
        kind, text = ("value", raw[6:]) if raw.startswith("value:") else ("key", raw)
        if kind == "key" and text.startswith("key:"):
            text = text[4:]
        try:
            pattern = re.compile(text, re.IGNORECASE)
        except re.error as exc:
            raise ValueError(
                f"redaction.extra_patterns: {raw!r} is not a valid regular expression: {exc}"
            ) from exc
        if pattern.fullmatch("") or (kind == "value" and pattern.search("") is not None):
            raise ValueError(
                f"redaction.extra_patterns: {raw!r} matches the empty string (it would redact "
                "everything)"
            )
        (values if kind == "value" else keys).append(pattern)
    return Patterns(tuple(keys), tuple(values), tuple(extra_patterns))


def _patterns(extra_patterns: Iterable[str] | Patterns) -> Patterns:
    if isinstance(extra_patterns, Patterns):
        return extra_patterns
    if isinstance(extra_patterns, str):
        extra_patterns = (extra_patterns,)
    return compile_patterns(tuple(extra_patterns))


def is_secret_key(key: str, extra_patterns: Iterable[str] | Patterns = ()) -> bool:
    """Whether the last words of ``key`` name a secret (rule 1): ``wandb.api_key`` and
    ``hf_token`` do, ``max_new_tokens`` and ``token_level_loss`` do not."""
    return _words_are_secret(key_words(key), _patterns(extra_patterns))


def _words_are_secret(words: list[str], patterns: Patterns) -> bool:
    while words and words[-1].isdigit():
        words = words[:-1]
    if not words:
        return False
    if words[-1] in ("token", "tokens") and len(words) > 1 and words[-2] in TOKEN_KINDS:
        return False
    for n in range(1, len(words) + 1):
        suffix = "_".join(words[-n:])
        if n <= _LONGEST_SEQUENCE and _BUILTIN_KEY.fullmatch(suffix):
            return True
        if any(p.fullmatch(suffix) for p in patterns.keys):
            return True
    return False


def _is_headers_key(component: str) -> bool:
    words = key_words(component)
    return bool(words) and words[-1] == "headers"


def _is_safe_header(name: str) -> bool:
    return str(name).strip().lower().replace("_", "-") in SAFE_HEADERS


# ---- secret values --------------------------------------------------------------------------


def secret_values(extra: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> set[str]:
    """Values that must never be shown: secret env vars (by name, rule 1, and
    :data:`KNOWN_SECRET_ENV`), every value of ``OTEL_EXPORTER_OTLP_*HEADERS``, and ``extra``."""
    env = os.environ if environ is None else environ
    values: set[str] = set()
    for name in KNOWN_SECRET_ENV:
        value = env.get(name, "").strip()
        if len(value) >= _MIN_ENV_VALUE:
            values.add(value)
    for name, value in env.items():
        value = value.strip()
        if (
            len(value) >= _MIN_NAMED_ENV_VALUE
            and name not in _NOT_SECRET_ENV
            and is_secret_key(name)
        ):
            values.add(value)
    for name in HEADER_ENV:
        for item in env.get(name, "").split(","):
            _, _, value = item.partition("=")
            values.update(_header_secret_forms(value))
    values.update(v for v in extra if isinstance(v, str) and len(v) >= _MIN_ENV_VALUE)
    return values


def _header_secret_forms(value: str) -> set[str]:
    """A header value as it may appear: raw, URL-decoded, and without its auth scheme."""
    forms = set()
    for form in (value.strip(), unquote(value).strip()):
        forms.add(form)
        scheme, _, credential = form.partition(" ")
        if credential.strip() and scheme.isalpha():
            forms.add(credential.strip())
    return {f for f in forms if len(f) >= _MIN_ENV_VALUE}


# ---- text -----------------------------------------------------------------------------------


def redact_text(
    text: str,
    secrets: Iterable[str] | None = None,
    *,
    extra_patterns: Iterable[str] | Patterns = (),
) -> str:
    """``text`` (a log line, an error message) with URL passwords, secret assignments, bearer
    tokens, known secret values and ``value:`` extra patterns replaced by :data:`REDACTED`."""
    known = secret_values() if secrets is None else set(secrets)
    return _scrub(str(text), _ordered(known), _patterns(extra_patterns))


def _ordered(secrets: Iterable[str]) -> tuple[str, ...]:
    # Longest first, so that a secret containing another is replaced whole.
    return tuple(sorted({s for s in secrets if s}, key=len, reverse=True))


def _scrub(text: str, secrets: Sequence[str], patterns: Patterns) -> str:
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    if "@" in text:
        text = _URL_USERINFO.sub(_url_replacement, text)
    if "=" in text or ":" in text:
        text = _scrub_assignments(text, patterns)
    if "Bearer" in text:
        text = _BEARER.sub(lambda m: m.group("scheme") + REDACTED, text)
    for pattern in patterns.values:
        text = pattern.sub(REDACTED, text)
    return text


def _url_replacement(match: re.Match[str]) -> str:
    user, password = match.group("user"), match.group("password")
    if password is not None:
        if password == REDACTED:
            return match.group(0)
        return f"{match.group('scheme')}{user}:{REDACTED}@"
    if len(user) >= _MIN_TOKEN_USER and user != REDACTED:
        return f"{match.group('scheme')}{REDACTED}@"
    return match.group(0)


def _scrub_assignments(text: str, patterns: Patterns) -> str:
    out: list[str] = []
    pos = 0
    for m in _ASSIGNMENT.finditer(text):
        if m.start() < pos or not is_secret_key(m.group("key"), patterns):
            continue
        value = _ASSIGNED_VALUE.match(text, m.end())
        if value is None or not value.group(0) or value.group(0) == REDACTED:
            continue
        quote = value.group(0)[0] if value.group(0)[0] in "\"'" else ""
        if quote and len(value.group(0)) == 2:
            continue  # an empty quoted value: nothing to hide
        out.append(text[pos : m.end()])
        out.append(f"{quote}{REDACTED}{quote}")
        pos = value.end()
    if not out:
        return text
    out.append(text[pos:])
    return "".join(out)


# ---- structures -----------------------------------------------------------------------------


def _components(key: Any) -> list[str]:
    return [c for c in _COMPONENT_SEP.split(str(key)) if c] or [str(key)]


class _Redactor:
    """Two passes over a structure: find the secrets (rules 1-3 and URL passwords), then copy it
    with them redacted and every string scrubbed of every secret found anywhere."""

    def __init__(self, secrets: set[str] | None, patterns: Patterns) -> None:
        self.patterns = patterns
        self.found: set[str] = set()
        self.env = secret_values() if secrets is None else set(secrets)
        self.ordered: tuple[str, ...] = ()

    def _state(self, path_secret: bool, in_headers: bool, key: Any) -> tuple[bool, bool]:
        """(secret, children_are_headers) for the value under ``key``: secret below a secret
        key (rule 2), as a secret key (rule 1), or as the value of an unsafe header (rule 3)."""
        if path_secret:
            return True, False
        for comp in _components(key):
            if in_headers and not _is_safe_header(comp):
                return True, False
            if _words_are_secret(key_words(comp), self.patterns):
                return True, False
            in_headers = _is_headers_key(comp)
        return False, in_headers

    def collect(self, value: Any, secret: bool, headers: bool) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                s, child_headers = self._state(secret, headers, key)
                self.collect(item, s, child_headers)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                self.collect(item, secret, headers)
        elif isinstance(value, str):
            if secret and len(value) >= _MIN_FOUND_VALUE:
                self.found.add(value)
            elif headers:
                for part in _header_string_secrets(value):
                    self.found.add(part)
            for m in _URL_USERINFO.finditer(value):
                password = m.group("password")
                if password and len(password) >= _MIN_ENV_VALUE:
                    self.found.update({password, unquote(password)})

    def finish_collect(self) -> None:
        self.ordered = _ordered(
            self.env | {s for s in self.found if len(s) >= _MIN_FOUND_VALUE}
        )

    def copy(self, value: Any, secret: bool, headers: bool) -> Any:
        if isinstance(value, Mapping):
            out = {}
            for key, item in value.items():
                s, child_headers = self._state(secret, headers, key)
                out[key] = self.copy(item, s, child_headers)
            return out
        if isinstance(value, (list, tuple, set, frozenset)):
            if headers and _is_header_pair(value):
                name, val = value
                if _is_safe_header(name) or val in (None, ""):
                    return value
                return type(value)((name, REDACTED)) if type(value) in (list, tuple) else value
            items = [self.copy(item, secret, headers) for item in value]
            if all(a is b for a, b in zip(items, value, strict=True)):
                return value  # unchanged: the same object, so its type and text stay exact
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                return type(value)(*items)
            return type(value)(items) if type(value) in (list, tuple, set, frozenset) else items
        if secret:
            if value is None or value == "" or isinstance(value, bool):
                return value
            return REDACTED
        if isinstance(value, str):
            if headers:
                return _redact_header_string(value)
            scrubbed = _scrub(value, self.ordered, self.patterns)
            return value if scrubbed == value else scrubbed
        return value


_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


def _is_header_pair(value: Any) -> bool:
    """``("x-api-key", "v")``: a header as a (name, value) pair."""
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and isinstance(value[0], str)
        and _HEADER_NAME.fullmatch(value[0]) is not None
    )


def _split_header(item: str) -> tuple[str, str, str]:
    """``"name=value"`` (OTel's env form) or ``"Name: value"`` (HTTP's) → (name, sep, value)."""
    equals, colon = item.find("="), item.find(":")
    if colon >= 0 and (equals < 0 or colon < equals):
        return item.partition(":")
    return item.partition("=")


def _header_string_secrets(value: str) -> list[str]:
    out: list[str] = []
    for item in value.split(","):
        name, sep, val = _split_header(item)
        if sep and not _is_safe_header(name):
            out.extend(_header_secret_forms(val))
    return out


def _redact_header_string(value: str) -> str:
    """A ``k=v,k=v`` (or ``K: v``) header list with unsafe values redacted; a string that is not
    such a list is redacted whole."""
    if not value:
        return value
    items = []
    for item in value.split(","):
        name, sep, val = _split_header(item)
        if not sep:
            return REDACTED
        if _is_safe_header(name) or not val.strip():
            items.append(item)
        else:
            items.append(f"{name}{sep}{' ' if val.startswith(' ') else ''}{REDACTED}")
    return ",".join(items)


def redact_nested(
    value: Any,
    secrets: set[str] | None = None,
    *,
    extra_patterns: Iterable[str] | Patterns = (),
) -> Any:
    """Copy of a nested config (mappings, lists) with every rule of this module applied.

    ``secrets``: the known secret values to replace inside strings (default:
    :func:`secret_values`, from the environment).
    """
    redactor = _Redactor(secrets, _patterns(extra_patterns))
    redactor.collect(value, False, False)
    redactor.finish_collect()
    return redactor.copy(value, False, False)


def redact(
    params: Mapping[str, Any],
    secrets: set[str] | None = None,
    *,
    extra_patterns: Iterable[str] | Patterns = (),
) -> dict[str, Any]:
    """Copy of flat ``params`` (keys joined with ``.``, as :func:`flatten_params` makes them)
    with every rule of this module applied; list values are walked too."""
    return dict(redact_nested(params, secrets, extra_patterns=extra_patterns))


def collect_secrets(
    value: Any, *, extra_patterns: Iterable[str] | Patterns = ()
) -> set[str]:
    """The secret strings found in a nested config (values of secret keys and headers, URL
    passwords), to pass as ``secrets`` when redacting something else of the same run."""
    redactor = _Redactor(set(), _patterns(extra_patterns))
    redactor.collect(value, False, False)
    return {s for s in redactor.found if len(s) >= _MIN_FOUND_VALUE}


def flatten_params(params: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists are kept as values."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    for k, v in params.items():
        walk(str(k), v)
    return out


#: ``init`` arguments of tracker SDKs (W&B, SwanLab, Trackio) that end up in the tracker's files.
_INIT_TEXT_KEYS = ("config", "notes", "description", "tags", "name", "group", "job_type")


def redact_init_kwargs(
    init_kwargs: Mapping[str, Any], *, extra_patterns: Iterable[str] | Patterns = ()
) -> dict[str, Any]:
    """``init_kwargs`` of a tracker SDK with its ``config`` mapping and free-text fields redacted
    like hyperparameters; every other argument (``settings``, ``dir``, ...) is left as it is,
    because the SDK needs it."""
    out = dict(init_kwargs)
    chosen = {k: out[k] for k in _INIT_TEXT_KEYS if k in out}
    if chosen:
        out.update(redact_nested(chosen, extra_patterns=extra_patterns))
    return out
