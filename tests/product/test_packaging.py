"""The package as users install it: light import, and the exporters/ mapping inside a wheel."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("wandb", "mlflow", "swanlab", "ray", "torch", "tensorboard", "trackio", "numpy")


def test_import_is_light():
    code = (
        "import sys, otel_rl; otel_rl.Logger; "
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.slow
@pytest.mark.long
def test_wheel_installs_exporters_as_otel_rl_exporters(tmp_path):
    # Built from a copy of what the build reads: a build in the checkout rewrites its build/ and
    # otel_rl.egg-info/ (the entry points other test processes read) while they run.
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("otel_rl", "exporters"):
        shutil.copytree(ROOT / part, source / part, symlinks=True, ignore=ignore)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / part, source / part)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        check=True, timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("otel_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "otel_rl/exporters/tensorboard.py" in names
    assert "otel_rl/exporters/base.py" in names
    assert not any(n.startswith("exporters/") for n in names)
    assert "otel_rl/py.typed" in names  # type checkers read the package's hints
    # the timeline page inlines its charting library, with the library's licence beside it
    assert {"otel_rl/timeline/vendor/echarts.min.js",
            "otel_rl/timeline/vendor/LICENSE-echarts"} <= set(names)  # fmt: skip

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{wheel}[tensorboard]"],
        check=True, timeout=600,
    )
    code = (
        "import otel_rl.exporters.tensorboard as t, otel_rl, pathlib; "
        "p = pathlib.Path(t.__file__); assert 'site-packages' in p.parts, p; "
        "from otel_rl.exporters import TrackerExporter; "
        "print(t.TensorBoardExporter.name, issubclass(t.TensorBoardExporter, TrackerExporter), "
        "otel_rl.__version__)"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    version = wheel.name.split("-")[1]
    assert out.stdout.split() == ["tensorboard", "True", version]


def test_the_extension_api_is_one_public_module_and_the_version_is_the_installed_one():
    from importlib.metadata import version

    import otel_rl
    from otel_rl.core.failures import RowRejected as Rejected
    from otel_rl.core.records import HistogramValue as Histogram
    from otel_rl.core.records import StepBatch as Batch
    from otel_rl.exporters import HistogramValue, RowRejected, StepBatch, TrackerExporter
    from otel_rl.exporters.base import TrackerExporter as Base

    assert (TrackerExporter, RowRejected, StepBatch, HistogramValue) == (
        Base, Rejected, Batch, Histogram
    )
    assert otel_rl.__version__ == version("otel-rl")


def test_the_docs_install_from_the_checkout_never_from_a_package_index():
    """No project of ours is published under this name: a doc telling users to ``pip install
    otel-rl`` would install whatever another party put there. Every install line installs the
    checkout, as the README does."""
    root = Path(__file__).resolve().parents[2]
    lines = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"pip install [^&#|;]*\botel-rl\b", line)
    ]
    assert lines == []
