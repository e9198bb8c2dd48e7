"""The command line as a user meets it: each command run in a subprocess, its exit code and its
message asserted. A mistake gets one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "otel_rl.cli"]


def otel_rl(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_ray_env(tmp_path: Path) -> dict[str, str]:
    """No RAY_ADDRESS, and Ray's temp dir (where it records the cluster started here) empty."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(tmp_path / "ray-tmp")
    return env


def one_clear_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


# ---- replay -------------------------------------------------------------------------------------


def test_replay_before_an_attempt_of_no_run_named_is_an_error(tmp_path):
    """``--before-attempt`` counts the launches of the run ``--run`` names: without it, it was
    passed over and the replay went on with every spool."""
    done = otel_rl("replay", str(tmp_path), "--before-attempt", "2")
    assert done.returncode == 2
    assert one_clear_line(done.stderr).startswith("otel-rl replay: --before-attempt needs --run")


def test_replay_of_a_missing_directory_is_an_error(tmp_path):
    missing = tmp_path / "no-such-run"
    done = otel_rl("replay", str(missing))
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == f"otel-rl replay: {missing} is not a directory"
    assert not missing.exists()  # nothing created in passing

    a_file = tmp_path / "metrics.jsonl"
    a_file.write_text("{}\n")
    done = otel_rl("replay", str(a_file))
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == f"otel-rl replay: {a_file} is not a directory"


# ---- demo arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-5"], "argument --steps: must be a positive integer, got -5"),
        (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["--steps", "ten"], "argument --steps: must be an integer, got 'ten'"),
        (["--prometheus-port", "70000"], "argument --prometheus-port: must be a port from 0"),
        (["--step-seconds", "-1"], "argument --step-seconds: must be a finite number of seconds"),
        (["--hold", "nan"], "argument --hold: must be a finite number of seconds"),
    ],
)
def test_demo_refuses_bad_numbers_before_running(tmp_path, args, message):
    done = otel_rl("demo", "--log-dir", str(tmp_path / "demo"), *args)
    assert done.returncode == 2
    assert f"otel-rl demo: error: {message}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "demo").exists()  # refused before anything was written


# ---- --version and help -------------------------------------------------------------------------


def test_version_is_the_installed_package_version():
    done = otel_rl("--version")
    assert done.returncode == 0, done.stderr
    expected = importlib.metadata.version("otel-rl")
    assert done.stdout == f"otel-rl {expected}\n"
    import otel_rl as package

    assert package.__version__ == expected


@pytest.mark.parametrize("command", [[], ["demo"], ["replay"], ["gpu-monitor"]])
def test_help_is_plain_text(command):
    """No reST markup (``x``) in what a terminal shows; every option is described."""
    done = otel_rl(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert "`" not in done.stdout, done.stdout
    assert done.stdout.startswith(f"usage: otel-rl {' '.join(command)}".rstrip())
    if command == ["demo"]:
        assert "exp_NNN" in done.stdout and "at least 1" in done.stdout
    if not command:
        assert "--version" in done.stdout
        assert {"demo", "replay", "gpu-monitor"} <= set(done.stdout.split())


def test_benchmarks_help_is_plain_text():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "`" not in done.stdout
    assert 'pip install -e ".[all,test]"' in done.stdout


# ---- gpu-monitor without a Ray cluster ----------------------------------------------------------


def _a_ray_cluster_runs_here() -> bool:
    """Ray's "auto" joins any GCS process on this machine, so the no-cluster case needs none."""
    import psutil

    for proc in psutil.process_iter(["name"]):
        with_name = proc.info.get("name") or ""
        if "gcs_server" in with_name:
            return True
    return False


@pytest.mark.slow
def test_gpu_monitor_with_no_ray_running_says_what_to_do(tmp_path):
    pytest.importorskip("ray")
    if _a_ray_cluster_runs_here():
        pytest.skip("a Ray cluster runs on this machine; --ray-address auto would join it")
    done = otel_rl("gpu-monitor", "--ray-address", "auto", env=without_ray_env(tmp_path))
    assert done.returncode == 2
    line = one_clear_line(done.stderr)
    assert line.startswith(
        "otel-rl gpu-monitor: no running Ray cluster found for --ray-address auto; "
    )
    assert "ray start --head" in line
    assert "--endpoint http://HOST:PORT/metrics" in line
    assert "--address" not in line  # Ray's own flag, which this command does not have


@pytest.mark.slow
def test_gpu_monitor_with_an_unreachable_address_answers_at_once(tmp_path):
    """Ray itself retries an unreachable address for minutes; the probe answers in seconds (the
    subprocess timeout is the bound, well below Ray's retries)."""
    pytest.importorskip("ray")
    port = closed_port()
    env = without_ray_env(tmp_path)
    done = otel_rl("gpu-monitor", "--ray-address", f"127.0.0.1:{port}", env=env, timeout=60)
    assert done.returncode == 2
    line = one_clear_line(done.stderr)
    assert line.startswith(
        f"otel-rl gpu-monitor: no Ray cluster answers at 127.0.0.1:{port}: Connection refused; "
    )
    assert "ray start --head" in line and "--endpoint" in line and "--address" not in line

    # "auto" follows RAY_ADDRESS, as Ray does, and says that is where the address came from
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    done = otel_rl("gpu-monitor", "--ray-address", "auto", env=env, timeout=60)
    assert done.returncode == 2
    assert f"at 127.0.0.1:{port} (from RAY_ADDRESS): Connection refused" in one_clear_line(
        done.stderr
    )

    done = otel_rl("gpu-monitor", "--ray-address", "head-node", env=env, timeout=60)
    assert done.returncode == 2
    assert "not an address of the form HOST:PORT" in one_clear_line(done.stderr)


def test_gpu_monitor_without_ray_installed_names_the_extra(tmp_path):
    """Ray is installed here, so its absence is simulated: ``sys.modules["ray"] = None`` makes
    ``import ray`` fail exactly as it does where the package is missing."""
    code = (
        "import sys; sys.modules['ray'] = None; from otel_rl.cli.main import main; "
        "sys.exit(main(['gpu-monitor', '--ray-address', 'auto']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env=without_ray_env(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == (
        "otel-rl gpu-monitor: --ray-address needs Ray: pip install 'otel-rl[ray]', or scrape "
        "nodes directly with --endpoint http://HOST:PORT/metrics"
    )


def test_demo_with_a_log_dir_that_cannot_be_written_says_so_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    done = otel_rl("demo", "--log-dir", str(tmp_path / "afile" / "demo"), cwd=tmp_path)
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == (
        f"otel-rl demo: --log-dir {tmp_path / 'afile' / 'demo'}: [Errno 20] Not a directory: "
        f"'{tmp_path / 'afile' / 'demo'}'"
    )
