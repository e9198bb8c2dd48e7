"""Where NeMo RL's backend classes and GPU monitor find their SDKs (docs/migrating.md): on
``otel_rl.compat.nemo_rl``, so that patching an SDK there reaches them, while the modules that
hold those classes never import the drop-in (each imports only downward)."""

from __future__ import annotations

import subprocess
import sys

from otel_rl.compat import nemo_rl
from otel_rl.compat.nemo_rl import RayGpuMonitorLogger, TensorboardLogger


class RecordingWriter:
    """Put in place of ``SummaryWriter`` as a test patching the drop-in would: the patch is what
    is checked, so this stand-in only keeps what it was built with."""

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir


class StoppedClock:
    """Put in place of the drop-in's ``time`` module, as a test freezing its clock would."""

    @staticmethod
    def time() -> float:
        return 1234.5


def test_an_sdk_patched_on_the_drop_in_reaches_the_backend_classes(monkeypatch, tmp_path):
    monkeypatch.setattr(nemo_rl, "SummaryWriter", RecordingWriter)
    monkeypatch.setattr(nemo_rl, "time", StoppedClock)
    backend = TensorboardLogger({}, log_dir=str(tmp_path / "tb"))
    assert isinstance(backend.writer, RecordingWriter)
    assert backend.writer.log_dir == str(tmp_path / "tb")
    monitor = RayGpuMonitorLogger(1, 1, "ray", "ray/ray_step")
    assert monitor.last_flush_time == 1234.5


def test_the_classes_on_their_own_neither_import_the_drop_in_nor_an_sdk_before_use():
    code = (
        "import sys, time\n"
        "from otel_rl.compat.nemo_backends import LoggerInterface, WandbLogger\n"
        "from otel_rl.compat.nemo_gpu_monitor import RayGpuMonitorLogger\n"
        "before = time.time()\n"
        "monitor = RayGpuMonitorLogger(1, 1, 'ray', 'ray/ray_step')\n"
        "print(before <= monitor.last_flush_time <= time.time())\n"
        "print('otel_rl.compat.nemo_rl' in sys.modules, 'wandb' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()  # fmt: skip
    assert out == ["True", "False", "False"]
