"""Names that become paths (plots, artifacts) never write outside log_dir, and stay readable."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from otel_rl import Logger, MetricError
from otel_rl.core.paths import MAX_PART_BYTES, MAX_TOTAL_BYTES, path_inside, safe_relative


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("train/curve", "train/curve"),
        ("reward curve: mean", "reward curve: mean"),
        ("../../outside/x", "outside/x"),
        ("/etc/cron.d/x", "etc/cron.d/x"),
        ("..\\..\\windows\\x", "windows/x"),
        ("C:/Users/x", "Users/x"),
        ("a/./b//c/", "a/b/c"),
        ("a/../../b", "a/b"),
        ("nul\x00byte", "nul_byte"),
        ("line\nbreak\ttab", "line_break_tab"),
        ("ünïcode/名前", "ünïcode/名前"),
    ],
)
def test_safe_relative_keeps_names_readable_and_inside(name, expected):
    assert safe_relative(name) == expected


@pytest.mark.parametrize("name", ["", ".", "..", "/", "\\", "../..", "./.\\..", "C:/"])
def test_a_name_with_nothing_usable_is_refused(name):
    with pytest.raises(ValueError, match="no usable path part"):
        safe_relative(name)


def test_long_names_are_cut_and_stay_distinct():
    a, b = "x" * 1000 + "a", "x" * 1000 + "b"
    sa, sb = safe_relative(a), safe_relative(b)
    assert sa != sb
    assert len(sa.encode()) <= MAX_PART_BYTES and sa.startswith("x" * 150)
    assert sa.endswith("~" + hashlib.sha1(a.encode()).hexdigest()[:10])
    deep = safe_relative("level/" * 500 + "leaf")
    assert len(deep.encode()) <= MAX_TOTAL_BYTES and deep.startswith("level/level/")
    multibyte = safe_relative("é" * 300)  # cut on a character boundary
    assert len(multibyte.encode()) <= MAX_PART_BYTES and multibyte.startswith("é" * 90)


def test_path_inside_stays_under_root(tmp_path):
    assert path_inside(tmp_path, "../../x.jsonl") == tmp_path / "x.jsonl"
    assert path_inside(tmp_path, "..\\x.jsonl") == tmp_path / "x.jsonl"
    assert path_inside(tmp_path, "/tmp/x.jsonl") == tmp_path / "tmp" / "x.jsonl"


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    fig.add_subplot().plot([0, 1])
    return fig


def _files_under(root):
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files
    )


def test_plots_with_hostile_names_land_inside_log_dir(tmp_path, otel_rl_warnings):
    """The JSONL exporter writes ``plots/<name>/step_N.png``: traversal, absolute, Windows,
    NUL and very long names all end up under ``<log_dir>/plots`` with the expected names."""
    log_dir = tmp_path / "run" / "logs"
    long_name = "p" * 1000
    names = {
        "../../outside/x": "outside/x",
        "/abs/evil": "abs/evil",
        "..\\..\\win\\y": "win/y",
        "nul\x00name": "nul_name",
        long_name: safe_relative(long_name),
        "train/curve": "train/curve",
    }
    cfg = {"log_dir": str(log_dir), "export": {"spool": False, "on_full": "block"}}
    with Logger(cfg) as logger:
        for name in names:
            logger.log_plot(_figure(), 3, name)
    inside = os.path.join("run", "logs", "")
    assert [f for f in _files_under(tmp_path) if not f.startswith(inside)] == []  # nothing outside
    assert _files_under(log_dir / "plots") == sorted(
        os.path.join(*safe.split("/"), "step_3.png") for safe in names.values()
    )
    for safe in names.values():
        assert (log_dir / "plots" / safe / "step_3.png").read_bytes().startswith(b"\x89PNG")
    assert not [r for r in otel_rl_warnings.records if r.levelname == "WARNING"]


def test_unusable_plot_names_and_steps_are_refused_on_the_callers_thread(
    tmp_path, otel_rl_warnings
):
    log_dir = tmp_path / "logs"
    cfg = {"log_dir": str(log_dir), "export": {"spool": False, "on_full": "block"}}
    with Logger(cfg) as logger:
        logger.log_plot(_figure(), 1, "..")
        logger.log_plot(_figure(), 1.5, "ok")
        logger.log_table("", ["a"], [["1"]], step=1)
        logger.log_plot(_figure(), 2, "ok")
    messages = [r.getMessage() for r in otel_rl_warnings.records]
    assert messages == [
        "otel-rl: metric '..': plot skipped: name '..' has no usable path part (it is empty, '.', "
        "'..' or only separators); use a name such as 'train/reward'",
        "otel-rl: metric 'ok': plot skipped: step must be a whole number, got 1.5 (steps are "
        "never rounded: pass int(step) if that is what you mean)",
        "otel-rl: metric '': table skipped: name '' has no usable path part (it is empty, '.', "
        "'..' or only separators); use a name such as 'train/reward'",
    ]
    assert _files_under(log_dir / "plots") == [os.path.join("ok", "step_2.png")]

    strict = Logger(
        {
            "log_dir": str(tmp_path / "strict"),
            "strict": True,
            "export": {"spool": False, "on_full": "block"},
        }
    )
    with pytest.raises(MetricError, match="no usable path part"):
        strict.log_plot(_figure(), 1, "../")
    strict.finish()
    assert not (tmp_path / "strict" / "plots").exists()


def test_nemo_rl_jsonl_dumps_with_hostile_filenames_stay_inside_log_dir(tmp_path, otel_rl_warnings):
    """NeMo RL's ``log_batched_dict_as_jsonl`` / ``log_string_list_as_jsonl`` take a filename
    relative to the log dir: traversal and absolute names land inside it too, and a name with
    nothing usable is one warning."""
    import json

    from otel_rl.compat.nemo_rl import Logger as NemoLogger

    log_dir = tmp_path / "run" / "logs"
    logger = NemoLogger({"log_dir": str(log_dir), "wandb_enabled": False})
    logger.log_batched_dict_as_jsonl({"reward": [1.0, 2.0]}, "../../outside/train_data_step1.jsonl")
    logger.log_string_list_as_jsonl(["a", "b"], "/abs/samples.jsonl")
    logger.log_string_list_as_jsonl(["c"], "../..")
    logger.log_batched_dict_as_jsonl({"reward": [3.0]}, "train_data_step2.jsonl")
    logger.finish()
    base = Path(logger.base_log_dir)
    inside = os.path.relpath(base, tmp_path) + os.sep
    assert [f for f in _files_under(tmp_path) if not f.startswith(inside)] == []
    lines = (base / "outside" / "train_data_step1.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"reward": [1.0], "idx": 0},
        {"reward": [2.0], "idx": 1},
    ]
    assert (base / "abs" / "samples.jsonl").read_text().splitlines() == ["a", "b"]
    step2 = (base / "train_data_step2.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in step2] == [{"reward": [3.0], "idx": 0}]
    warnings = [r.getMessage() for r in otel_rl_warnings.records if "not written" in r.getMessage()]
    assert len(warnings) == 1 and "'../..'" in warnings[0]


def test_something_that_is_no_figure_costs_only_its_plot(tmp_path, otel_rl_warnings):
    log_dir = tmp_path / "logs"
    cfg = {"log_dir": str(log_dir), "export": {"spool": False, "on_full": "block"}}
    with Logger(cfg) as logger:
        logger.log_plot(b"\x89PNG not a figure", 1, "raw")
        logger.log_plot(_figure(), 2, "ok")
    messages = [r.getMessage() for r in otel_rl_warnings.records]
    assert messages == [
        "otel-rl: metric 'raw': plot skipped: bytes.savefig(...) failed (AttributeError: 'bytes' "
        "object has no attribute 'savefig'); give a matplotlib figure"
    ]
    assert _files_under(log_dir / "plots") == [os.path.join("ok", "step_2.png")]
    strict = Logger({"log_dir": str(tmp_path / "strict"), "strict": True,
                     "export": {"spool": False, "on_full": "block"}})  # fmt: skip
    with pytest.raises(MetricError, match=r"bytes.savefig\(...\) failed"):
        strict.log_plot(b"", 1, "raw")
    strict.finish()
