"""Redaction rules (otel_rl/core/redaction.py, docs/security.md): which keys stay and which go,
what is redacted below them, in URLs, headers, text and env values; property tests over
generated keys and configs; the MLflow exporter's errors and the OTLP endpoint without their
passwords."""

from __future__ import annotations

import base64
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_rl.core.redaction import (
    REDACTED,
    SECRET_WORDS,
    TOKEN_KINDS,
    collect_secrets,
    compile_patterns,
    flatten_params,
    is_secret_key,
    key_words,
    redact,
    redact_init_kwargs,
    redact_nested,
    redact_text,
    secret_values,
)

# Hyperparameters of real NeMo RL / verl configs that a substring rule wiped.
KEYS_THAT_STAY = [
    "max_new_tokens", "policy.generation.max_new_tokens", "train_mb_tokens",
    "policy.train_mb_tokens", "token_level_loss", "loss_fn.token_level_loss", "author",
    "data.author", "authority_score", "ppo_max_token_len_per_gpu", "max_num_batched_tokens",
    "tokenizer_path", "tokenizer", "input_tokenizer", "stop_token_ids", "pad_token",
    "token_budget", "num_tokens", "maxNewTokens", "authorName", "password_file",
    "api_key_env", "secret_santa_seed", "private_key_id", "credentials_path", "eos_token",
    "tokenizer.pad_token", "bos_token", "image_token", "vision_start_token",
    "keys", "key", "passage", "oauth_provider", "PWD_DIR",
]  # fmt: skip
KEYS_THAT_GO = [
    "hf_token", "access_token", "HF_TOKEN", "apiKey", "api-key", "x-api-key", "wandb.api_key",
    "WANDB_API_KEY", "password", "db_password", "Password", "passwd", "pwd", "secret",
    "client_secret", "secrets", "SECRET_KEY", "token", "private_key", "privateKey",
    "credential", "credentials", "auth", "basic_auth", "authorization", "Authorization",
    "access_key", "aws_secret_access_key", "passphrase", "OAuthToken", "HFToken", "password2",
    "token_1", "hub.token", "mlflow/password", "use_auth_", "github_token", "wandb.token",
]  # fmt: skip


@pytest.mark.parametrize("key", KEYS_THAT_STAY)
def test_hyperparameter_keys_stay(key):
    assert not is_secret_key(key)
    assert redact({key: 4096}) == {key: 4096}


@pytest.mark.parametrize("key", KEYS_THAT_GO)
def test_secret_keys_go(key):
    assert is_secret_key(key)
    assert redact({key: "s3cr3t-value"}) == {key: REDACTED}


def test_words_split_on_separators_case_and_digits():
    assert key_words("wandb.apiKey") == ["wandb", "api", "key"]
    assert key_words("HFToken_2") == ["hf", "token", "2"]
    assert key_words("x-honeycomb-team") == ["x", "honeycomb", "team"]
    assert key_words("policy/max_new_tokens") == ["policy", "max", "new", "tokens"]


def test_unset_secrets_are_shown_as_unset():
    # None, "" and booleans say whether a secret is set without showing it.
    assert redact({"hf_token": None, "api_key": "", "auth": True}) == {
        "hf_token": None, "api_key": "", "auth": True,
    }  # fmt: skip
    assert redact({"pin_password": 1234}) == {"pin_password": REDACTED}


def test_everything_below_a_secret_key_in_both_paths():
    cfg = {
        "secrets": {"openai": "sk-aaaaaaaaaaaa", "rotation": {"days": 30, "ids": [1, 2]}},
        "credentials": {"key": "k-1234567890"},
        "policy": {"lr": 1e-6, "max_new_tokens": 512},
        "sources": [{"name": "a", "password": "pw-1234567890"}, [{"token": "t-1234567890"}]],
    }
    nested = redact_nested(cfg)
    assert nested == {
        "secrets": {"openai": REDACTED, "rotation": {"days": REDACTED, "ids": [REDACTED] * 2}},
        "credentials": {"key": REDACTED},
        "policy": {"lr": 1e-6, "max_new_tokens": 512},
        "sources": [{"name": "a", "password": REDACTED}, [{"token": REDACTED}]],
    }
    flat = redact(flatten_params(cfg))
    assert flat == {
        "secrets.openai": REDACTED, "secrets.rotation.days": REDACTED,
        "secrets.rotation.ids": [REDACTED, REDACTED], "credentials.key": REDACTED,
        "policy.lr": 1e-6, "policy.max_new_tokens": 512,
        "sources": [{"name": "a", "password": REDACTED}, [{"token": REDACTED}]],
    }  # fmt: skip
    assert cfg["secrets"]["openai"] == "sk-aaaaaaaaaaaa"  # the input is not modified


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("postgresql://u:PASS@db/x", f"postgresql://u:{REDACTED}@db/x"),
        ("--db postgresql://u:PASS@db:5432/x --lr 3",
         f"--db postgresql://u:{REDACTED}@db:5432/x --lr 3"),
        ("http://alice:p@ss:w0rd@host:5000/", f"http://alice:{REDACTED}@host:5000/"),
        ("https://ghp_0123456789abcdefghij@github.com/o/r", f"https://{REDACTED}@github.com/o/r"),
        ("ssh://git@github.com/o/r", "ssh://git@github.com/o/r"),
        ("http://host:8080/path?email=a@b.c", "http://host:8080/path?email=a@b.c"),
        ("s3://bucket/key", "s3://bucket/key"),
    ],
)  # fmt: skip
def test_url_userinfo_in_every_string(value, expected):
    assert redact({"data.url": value}) == {"data.url": expected}
    assert redact_text(value, set()) == expected


def test_a_found_secret_is_replaced_wherever_else_it_appears():
    cfg = {
        "mlflow": {"tracking_uri": "http://u:PW-1234567890@h"},
        "wandb": {"api_key": "wandbkey-0123456789"},
        "notes": "same key wandbkey-0123456789, same password PW-1234567890",
    }
    out = redact_nested(cfg)
    assert out["notes"] == f"same key {REDACTED}, same password {REDACTED}"
    assert collect_secrets(cfg) >= {"PW-1234567890", "wandbkey-0123456789"}


def test_header_values_except_the_safe_ones():
    cfg = {
        "otlp": {"headers": {"x-honeycomb-team": "hc-1234567890", "api-key": "ak-1234567890",
                             "Content-Type": "application/json", "user_agent": "trainer/1"}},
        "client": {"extra_headers": "Authorization=Bearer%20tok-123456789,accept=*/*"},
        "raw_headers": ["X-Team: abcdefgh12", "Accept: text/plain"],
    }  # fmt: skip
    assert redact_nested(cfg) == {
        "otlp": {"headers": {"x-honeycomb-team": REDACTED, "api-key": REDACTED,
                             "Content-Type": "application/json", "user_agent": "trainer/1"}},
        "client": {"extra_headers": f"Authorization={REDACTED},accept=*/*"},
        "raw_headers": [f"X-Team: {REDACTED}", "Accept: text/plain"],
    }  # fmt: skip
    assert redact(flatten_params(cfg))["otlp.headers.x-honeycomb-team"] == REDACTED
    assert redact(flatten_params(cfg))["otlp.headers.Content-Type"] == "application/json"


def test_env_secrets_wherever_their_value_appears(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wk-0123456789abcdef")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "svc-0123456789")  # secret by its name
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_HEADERS",
        "x-honeycomb-team=hc-abcdef123,authorization=Bearer%20tk-987654321",
    )
    monkeypatch.setenv("PWD", "/work/somewhere/long")  # the working directory, not a secret
    monkeypatch.setenv("SOME_TOKEN_FLAG", "true")  # too short to be replaced inside text
    values = secret_values()
    assert {"wk-0123456789abcdef", "svc-0123456789", "hc-abcdef123", "tk-987654321"} <= values
    assert "/work/somewhere/long" not in values and "true" not in values
    params = {"cmd": "run wk-0123456789abcdef svc-0123456789 hc-abcdef123 tk-987654321",
              "ckpt": "/work/somewhere/long/ckpt", "flag": "true"}  # fmt: skip
    assert redact(params) == {"cmd": f"run {REDACTED} {REDACTED} {REDACTED} {REDACTED}",
                              "ckpt": "/work/somewhere/long/ckpt", "flag": "true"}  # fmt: skip


def test_text_assignments_and_bearer_tokens():
    line = (
        "python train.py --hf_token=hf_abc123 --max_new_tokens=512 cmd=--api-key=zzz "
        "'password': 'pw 1' Authorization: Bearer abcdefgh12345 https://h/x?token=q1&lr=3"
    )
    assert redact_text(line, set()) == (
        f"python train.py --hf_token={REDACTED} --max_new_tokens=512 cmd=--api-key={REDACTED} "
        f"'password': '{REDACTED}' Authorization: {REDACTED} https://h/x?token={REDACTED}&lr=3"
    )
    assert redact_text("see Bearer abcdefgh12345 here", set()) == f"see Bearer {REDACTED} here"
    # Prompts and formats that merely mention a word stay.
    prompt = "Put the final answer in \\boxed{}. Format: answer: <value>; tokens: 512"
    assert redact_text(prompt, set()) == prompt


def test_extra_patterns_for_keys_and_values():
    patterns = ["cookie", "session_.*", "value:sk-[A-Za-z0-9]{10,}"]
    params = {"http.cookie": "c=1", "session_id": "abc", "mySessionCookie": "x",
              "note": "key sk-ABCDEFGHIJKL used", "lr": 0.1, "cookie_jar_size": 3}  # fmt: skip
    assert redact(params, extra_patterns=patterns) == {
        "http.cookie": REDACTED, "session_id": REDACTED, "mySessionCookie": REDACTED,
        "note": f"key {REDACTED} used", "lr": 0.1, "cookie_jar_size": 3,
    }  # fmt: skip
    nested = redact_nested({"a": {"cookie": "v"}}, extra_patterns=patterns)
    assert nested == {"a": {"cookie": REDACTED}}
    assert redact_text("x sk-ABCDEFGHIJKL", set(), extra_patterns=patterns) == f"x {REDACTED}"


@pytest.mark.parametrize("bad", ["(", "value:.*", "", 3])
def test_bad_extra_patterns_are_refused_with_the_pattern_named(bad):
    with pytest.raises(ValueError, match=r"redaction\.extra_patterns"):
        compile_patterns((bad,))


def test_values_keep_their_type_when_nothing_changes():
    betas = (0.9, 0.999)
    out = redact({"betas": betas, "layers": [1, 2], "name": "qwen"})
    assert out["betas"] is betas and out["layers"] == [1, 2]


def test_tracker_init_config_is_redacted():
    kwargs = {"project": "p", "config": {"hf_token": "hf-0123456789", "lr": 1},
              "notes": "db postgresql://u:pw-1234567@h/x", "settings": object()}  # fmt: skip
    out = redact_init_kwargs(kwargs)
    assert out["config"] == {"hf_token": REDACTED, "lr": 1}
    assert out["notes"] == f"db postgresql://u:{REDACTED}@h/x"
    assert out["settings"] is kwargs["settings"] and out["project"] == "p"


# ---- properties -----------------------------------------------------------------------------

_SECRET_SINGLE = {w for w in SECRET_WORDS if "_" not in w} | {"key", "private", "access", "api"}
# A tokenizer's kinds (``unk``, ``pad``) before ``token`` name no secret (``unk_token``): a rule
# of its own, tested apart, so they are no plain word here.
_WORD = st.from_regex(r"[a-z]{2,9}", fullmatch=True).filter(
    lambda w: w not in _SECRET_SINGLE and w not in TOKEN_KINDS
)
_SEP = st.sampled_from(["_", ".", "-", "/"])


@st.composite
def plain_key(draw):
    words = draw(st.lists(_WORD, min_size=1, max_size=4))
    sep = draw(_SEP)
    return sep.join(words)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(plain_key(), st.sampled_from(SECRET_WORDS), _SEP, st.booleans())
def test_property_trailing_secret_words_and_only_them(key, secret, sep, camel):
    assert not is_secret_key(key)
    if camel:
        parts = secret.split("_")
        secret = parts[0] + "".join(p.capitalize() for p in parts[1:])
        trailing = key + secret[0].upper() + secret[1:]
    else:
        trailing = f"{key}{sep}{secret}"
    assert is_secret_key(trailing), trailing
    assert not is_secret_key(f"{secret}{sep}{key}")  # a secret word followed by another word


_SECRET_VALUE = st.from_regex(r"PLANT[A-Z0-9]{8,16}", fullmatch=True)
_LEAF = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                  st.from_regex(r"[a-z ]{0,12}", fullmatch=True))  # fmt: skip
_TREE = st.recursive(
    _LEAF,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(plain_key(), children, max_size=3)
    ),
    max_leaves=12,
)


@st.composite
def config_with_secret(draw):
    """A random config with a secret planted under a secret key at a random depth, in a list or
    in a URL."""
    secret = draw(_SECRET_VALUE)
    tree = draw(st.dictionaries(plain_key(), _TREE, min_size=1, max_size=4))
    where = draw(st.sampled_from(["key", "below", "list", "url", "header"]))
    planted = {
        "key": {draw(plain_key()) + "_" + draw(st.sampled_from(SECRET_WORDS)): secret},
        "below": {draw(st.sampled_from(SECRET_WORDS)): {draw(plain_key()): [secret]}},
        "list": {draw(plain_key()): [{"name": "x"}, {"password": secret}]},
        "url": {draw(plain_key()): f"scheme://user:{secret}@host/path"},
        "header": {"headers": {draw(plain_key()): secret}},
    }[where]
    path = draw(st.lists(plain_key(), max_size=3))
    node = tree
    for part in path:
        node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else node
    node.update(planted)
    return tree, secret


@pytest.mark.slow  # 200 examples each; the full suite runs them
@settings(max_examples=200, deadline=None)
@given(config_with_secret())
def test_property_a_planted_secret_never_survives(case):
    tree, secret = case
    assert secret not in json.dumps(redact_nested(tree, set()), default=repr)
    assert secret not in json.dumps(redact(flatten_params(tree), set()), default=repr)
    assert secret not in redact_text(json.dumps(tree), {secret})


@pytest.mark.slow  # 200 examples each; the full suite runs them
@settings(max_examples=200, deadline=None)
@given(st.dictionaries(plain_key(), _TREE, max_size=5))
def test_property_configs_without_secrets_are_unchanged_and_redaction_is_idempotent(tree):
    assert redact_nested(tree, set()) == tree
    flat = flatten_params(tree)
    assert redact(flat, set()) == flat
    once = redact_nested(tree, set())
    assert redact_nested(once, set()) == once


# ---- log lines: MLflow errors and the OTLP endpoint ----------------------------------------


def test_mlflow_errors_do_not_show_the_tracking_uri_password(monkeypatch):
    """A real MLflow client against a closed port on 127.0.0.1: its error quotes the request URL;
    the exporter's error is scrubbed, still classified as transient (retried)."""
    pytest.importorskip("mlflow")
    from otel_rl.exporters.mlflow import MlflowExporter
    from testkit.otlp_receiver import closed_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = f"http://alice:Sup3rS3cretPW@127.0.0.1:{closed_port()}/"
    exporter = MlflowExporter(tracking_uri=uri)
    assert exporter.shown_tracking_uri == re.sub("Sup3rS3cretPW", REDACTED, uri)
    with pytest.raises(Exception) as info:
        exporter.open()
    text = f"{info.value} {getattr(info.value, 'message', '')}"
    assert "Sup3rS3cretPW" not in text
    assert f"alice:{REDACTED}@127.0.0.1" in text
    assert exporter.classify_error(info.value, "open").kind == "transient"


def test_otlp_endpoint_userinfo_becomes_a_basic_auth_header():
    from otel_rl.telemetry.otlp import resolve_otlp

    s = resolve_otlp({"endpoint": "http://bob:p%40ss@collector:4318"}, environ={})
    assert s.endpoint == "http://collector:4318/v1/metrics"
    assert s.headers["authorization"] == "Basic " + base64.b64encode(b"bob:p@ss").decode()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://u:pw@gw:4318"}
    s = resolve_otlp({"headers": {"Authorization": "Bearer explicit"}}, environ=env)
    assert s.endpoint == "https://gw:4318/v1/metrics"
    assert s.headers["authorization"] == "Bearer explicit"  # an explicit header wins


# ---- through the Logger: the config's extra patterns, the spool's file modes --------------------


def test_the_configs_extra_patterns_reach_hyperparams_and_the_spool(tmp_path):
    from otel_rl import Logger

    log_dir = tmp_path / "logs"
    cfg = {
        "log_dir": str(log_dir),
        "jsonl_enabled": True,
        "redaction": {"extra_patterns": ["cookie", r"value:sk-[A-Za-z0-9]{8,}"]},
        "trackers": {},
        "mlflow": {"tags": {"session_cookie": "PLANTED-cookie-1", "note": "key sk-PLANTED99x"}},
    }
    with Logger(cfg) as logger:
        logger.log_hyperparams(
            {"http": {"session_cookie": "PLANTED-cookie-2", "timeout": 30},
             "notes": "uses sk-PLANTED42abc", "lr": 1e-6}
        )  # fmt: skip
        logger.log_metrics({"x": 1.0}, step=0)
    stored = json.loads((log_dir / "hyperparams.json").read_text())
    assert stored == {
        "http.session_cookie": REDACTED,
        "http.timeout": 30,
        "notes": f"uses {REDACTED}",
        "lr": 1e-6,
    }
    (meta,) = list(log_dir.rglob("meta.json"))
    tags = json.loads(meta.read_text())["config"]["mlflow"]["tags"]
    assert tags == {"session_cookie": REDACTED, "note": f"key {REDACTED}"}
    leaked = [p for p in log_dir.rglob("*") if p.is_file() and b"PLANTED" in p.read_bytes()]
    assert leaked == []


def test_spool_files_are_private_whatever_the_umask(tmp_path):
    """The spool holds the run's rows and its (redacted) config: 0700 folders, 0600 files, even
    under a umask that would make them world-readable."""
    import os
    import stat

    from otel_rl import Logger

    old = os.umask(0)
    try:
        log_dir = tmp_path / "logs"
        with Logger({"log_dir": str(log_dir), "jsonl_enabled": True}) as logger:
            logger.log_metrics({"x": 1.0}, step=0)
            assert logger.flush(timeout=30)
            spool = log_dir / ".otel-rl" / "spool"
            entries = [spool, *spool.rglob("*")]
            modes = {p.relative_to(log_dir): stat.S_IMODE(p.stat().st_mode) for p in entries}
    finally:
        os.umask(old)
    folders = {p: m for p, m in modes.items() if (log_dir / p).is_dir()}
    files = {p: m for p, m in modes.items() if p not in folders}
    assert any(p.name == "meta.json" for p in files) and len(files) >= 2, modes
    assert set(folders.values()) == {0o700}, folders
    assert set(files.values()) == {0o600}, files


@pytest.mark.slow
def test_the_configs_extra_patterns_reach_a_trackers_own_init_config(tmp_path):
    """``wandb: {config: ...}`` goes to ``wandb.init`` as it is, so the run's extra patterns apply
    to it as they do to hyperparameters: read back from W&B's offline files with its reader."""
    pytest.importorskip("wandb")
    from otel_rl import Logger
    from otel_rl.exporters.wandb import WandbExporter
    from testkit.tracker_readers import read_wandb, wandb_run_dirs

    log_dir = tmp_path / "logs"
    given = WandbExporter({"mode": "offline", "dir": str(log_dir), "project": "p",
                           "config": {"extra_given": {"auth_cookie": "PLANTED-cookie-4"}}})
    cfg = {
        "log_dir": str(log_dir),
        "jsonl_enabled": False,
        "wandb_enabled": True,
        "redaction": {"extra_patterns": ["cookie"]},
        "wandb": {"mode": "offline", "project": "p",
                  "config": {"http": {"session_cookie": "PLANTED-cookie-3", "timeout": 30}}},
    }  # fmt: skip
    with Logger(cfg, exporters=[given]) as logger:
        logger.log_metrics({"x": 1.0}, step=0)
    configs = [read_wandb(run_dir).config for run_dir in wandb_run_dirs(log_dir)]
    assert len(configs) == 2
    built = next(c for c in configs if "http" in c)
    assert built["http"] == {"session_cookie": REDACTED, "timeout": 30}
    instance = next(c for c in configs if "extra_given" in c)
    assert instance["extra_given"] == {"auth_cookie": REDACTED}
    leaked = [p for p in log_dir.rglob("*") if p.is_file() and b"PLANTED" in p.read_bytes()]
    assert leaked == []
