"""The docs' code, as a reader copies it: every ```python block of README.md and
docs/quickstart.md runs as written, alone, in a fresh interpreter and an empty working directory,
and exits 0; the blocks that log metrics leave the files they promise, with the values they log.

A block that needs a server this machine cannot run (W&B online, a Ray cluster) is preceded by
``<!-- not-run: <reason> -->``; the reason is required and such blocks stay few.

Also here: what the README says about the benchmarks holds after its first command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.readers import jsonl_rows, tensorboard_scalars

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/quickstart.md")
MAX_NOT_RUN = 3

_FENCE = re.compile(
    r"(?:<!--\s*not-run:(?P<reason>[^>]*?)-->\s*\n)?^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$",
    re.S | re.M,
)


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    code: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def python_blocks(doc: str, text: str | None = None) -> list[Block]:
    if text is None:
        text = (ROOT / doc).read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start("code"))  # 1-based line of the ``` fence
        reason = match.group("reason")
        blocks.append(Block(doc, line, match.group("code"), None if reason is None else reason))
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in python_blocks(doc)]


def test_the_docs_have_python_blocks_and_few_are_not_run():
    assert {b.doc for b in ALL_BLOCKS} == set(DOCS)
    skipped = [b for b in ALL_BLOCKS if b.not_run is not None]
    assert len(skipped) <= MAX_NOT_RUN, [b.id for b in skipped]
    for block in skipped:
        assert block.not_run.strip(), f"{block.id}: a not-run block must say why"


def test_blocks_and_the_not_run_marker_are_read():
    text = (
        "intro\n\n```python\nprint(1)\n```\n\n```bash\nls\n```\n\n"
        "<!-- not-run: needs a Ray cluster -->\n```python\nimport ray\n```\n"
        "<!-- not-run: -->\n\n```python\nx = 1\n```\n"
    )
    blocks = python_blocks("doc.md", text)
    assert [(b.line, b.code, b.not_run) for b in blocks] == [
        (3, "print(1)\n", None),
        (12, "import ray\n", " needs a Ray cluster "),
        (17, "x = 1\n", " "),  # a blank reason is read, and refused by the test above
    ]


# ---- what the blocks that log metrics must leave behind -----------------------------------------


def _usage_block(cwd: Path) -> None:
    """README "Usage": 100 steps with TensorBoard and JSONL into logs/exp_001."""
    run = cwd / "logs" / "exp_001"
    rows = jsonl_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(100))
    for row in rows:
        m = row["metrics"]
        assert m["train/kl"] == 0.01
        assert m["train/reward/count"] == 16.0
        assert m["train/reward/min"] <= m["train/reward/mean"] <= m["train/reward/max"]
        assert 0.1 <= m["train/loss"] <= 1.0
        assert m["timing/generation"] >= 0 and m["timing/train"] >= 0
    hyper = json.loads((run / "hyperparams.json").read_text())
    assert hyper["policy.lr"] == 1e-6 and hyper["grpo.num_generations"] == 16
    scalars = tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == list(range(100))
    assert [v for _, v in scalars["train/kl"]] == pytest.approx([0.01] * 100)


def _quickstart_loop(cwd: Path) -> None:
    """docs/quickstart.md "Into a training loop": 20 steps, the stand-in's stats."""
    run = cwd / "logs" / "exp_001"
    rows = jsonl_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(20))
    for row in rows:
        m = row["metrics"]
        assert m["train/reward/count"] == 16.0
        assert 0.1 <= m["train/loss"] <= 1.0
        assert {"timing/generation", "timing/train", "train/reward/p90"} <= set(m)
    hyper = json.loads((run / "hyperparams.json").read_text())
    assert hyper == {"policy.lr": 1e-6, "policy.model": "my-model", "grpo.num_generations": 16}
    scalars = tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in scalars["train/reward/mean"]] == list(range(20))


#: (document, a line that identifies the block) -> the check of what it wrote.
EXPECTED: dict[tuple[str, str], Callable[[Path], None]] = {
    ("README.md", "def generate_and_score() -> list[float]:"): _usage_block,
    ("docs/quickstart.md", "def rollout() -> list[float]:"): _quickstart_loop,
}


def _check_for(block: Block) -> Callable[[Path], None] | None:
    found = [check for (doc, marker), check in EXPECTED.items()
             if doc == block.doc and marker in block.code]  # fmt: skip
    assert len(found) <= 1
    return found[0] if found else None


def test_every_expected_block_is_still_in_the_docs():
    """A check whose block was rewritten away would pass by never running."""
    for doc, marker in EXPECTED:
        assert any(b.doc == doc and marker in b.code for b in ALL_BLOCKS), (doc, marker)


@pytest.mark.slow
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.not_run is not None:
        pytest.skip(f"not run: {block.not_run.strip()}")
    cwd = tmp_path / "reader"
    cwd.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", block.code], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{block.id} failed as written:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr
    check = _check_for(block)
    if check is not None:
        check(cwd)


# ---- the benchmarks after the README's first command --------------------------------------------

#: What ``pip install -e ".[all]"`` leaves out that some benchmarks need (the test extra has them).
#: They are installed here, so their absence is simulated: a ``None`` in ``sys.modules`` makes
#: ``import torch`` raise ModuleNotFoundError exactly as on a machine without the package.
NOT_IN_ALL = ("torch", "pytest")

_WITHOUT = (
    "import runpy, sys\n"
    "for name in {names!r}:\n"
    "    sys.modules[name] = None\n"
    "sys.argv = ['benchmarks', *sys.argv[1:]]\n"
    "runpy.run_module('benchmarks', run_name='__main__', alter_sys=True)\n"
)


@pytest.mark.slow
def test_quick_benchmarks_without_the_test_extra_skip_and_name_what_is_missing(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT.format(names=NOT_IN_ALL), "--quick",
         "--only", "artifact_dump,training_thread,spool_drain", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    install = 'pip install -e ".[all,test]"'
    assert f"   skipped: needs torch ({install})" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == (
        "skipped 2 benchmark(s): artifact_dump (needs torch), training_thread (needs torch); "
        f"{install} installs everything they need"
    )
    results = json.loads(out.read_text())
    assert results["artifact_dump"] == {"skipped": "needs torch"}
    assert results["training_thread"] == {"skipped": "needs torch"}
    assert "skipped" not in results["spool_drain"] and "error" not in results["spool_drain"]


def test_the_readme_says_what_the_benchmarks_need():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(row for row in readme.splitlines() if row.startswith("| `python -m benchmarks"))
    assert 'pip install -e ".[all,test]"' in line and "torch" in line and "skipped" in line
    # the two commands of "Two commands" are what they claim
    assert 'pip install -e ".[all]" && otel-rl demo' in readme
    assert 'pip install -e ".[all,test]" && python -m pytest -q' in readme
