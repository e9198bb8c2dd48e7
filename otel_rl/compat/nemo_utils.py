"""Helpers of ``nemo_rl.utils.logger``: ``flatten_dict``, ``get_next_experiment_dir``,
``configure_rich_logging``, ``log_container_init_timing``.

``get_next_experiment_dir`` differs on purpose: it looks only at the direct children of the base
directory named exactly ``exp_<digits>`` (a base path that itself contains ``exp_7`` no longer
decides the number), and it claims the new directory with an atomic ``mkdir``, so concurrent jobs
sharing a base directory each get their own.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

_EXP_DIR = re.compile(r"exp_(\d+)")
_rich_configured = False


def flatten_dict(d: Mapping[str, Any], sep: str = ".", expand_lists: bool = True) -> dict[str, Any]:
    """Flatten nested mappings into ``{"a.b": value}``.

    With ``expand_lists`` (the default, as in NeMo RL) a list becomes one key per index
    (``{"a": [1, 2]}`` → ``{"a.0": 1, "a.1": 2}``; dicts inside lists are flattened too); without
    it a list stays one value. otel-rl's Logger never expands lists: it logs a list of numbers as
    ``/count, /mean, /std, /min, /max, /p50, /p90`` and keeps lists in hyperparameters as values.
    """
    flat: dict[str, Any] = {}

    def visit(value: Any, key: str) -> None:
        if isinstance(value, Mapping):
            for child_key, child in value.items():
                visit(child, f"{key}{sep}{child_key}" if key else str(child_key))
        elif expand_lists and isinstance(value, list):
            for index, item in enumerate(value):
                visit(item, f"{key}{sep}{index}")
        else:
            flat[key] = value

    for top_key, top_value in d.items():
        visit(top_value, str(top_key))
    return flat


def get_next_experiment_dir(base_log_dir: str) -> str:
    """Create and return ``<base_log_dir>/exp_<NNN>`` with the next free number (from 001).

    Safe against concurrent callers: the directory is claimed with ``os.mkdir``, which fails
    for all but one of them, and the losers move on to the next number.
    """
    os.makedirs(base_log_dir, exist_ok=True)
    try:
        names = os.listdir(base_log_dir)
    except OSError:
        names = []
    numbers = [
        int(match.group(1))
        for name in names
        if (match := _EXP_DIR.fullmatch(name)) and os.path.isdir(os.path.join(base_log_dir, name))
    ]
    candidate = max(numbers, default=0) + 1
    while True:
        path = os.path.join(base_log_dir, f"exp_{candidate:03d}")
        try:
            os.mkdir(path)
        except FileExistsError:
            candidate += 1
            continue
        return path


def configure_rich_logging(
    level: str = "INFO", show_time: bool = True, show_path: bool = True
) -> None:
    """Route the root logger through a ``rich`` handler (once per process)."""
    global _rich_configured
    if _rich_configured:
        return
    from rich.logging import RichHandler

    logging.basicConfig(
        level=level.upper(),
        format="%(message)s",
        datefmt="[%X]",
        handlers=[
            RichHandler(
                rich_tracebacks=True, show_time=show_time, show_path=show_path, markup=True
            )
        ],
    )
    _rich_configured = True


#: Launch-script timestamps (Unix seconds) read by ``log_container_init_timing``, NeMo RL's names.
SLURM_START_ENV = "SLURM_JOB_START_TIME"
JOB_START_ENV = "NRL_JOB_START_EPOCH"
RAY_READY_ENV = "NRL_RAY_READY_EPOCH"


def log_container_init_timing() -> None:
    """Print how long the job took to reach Python, from the launch script's timestamps.

    ``NRL_JOB_START_EPOCH`` (exported by NeMo RL's ``ray.sub``) is required: without it a
    warning on the root logger says so and nothing is printed. With it, a ``CONTAINER INIT
    TIMING`` block on stdout gives the total; ``SLURM_JOB_START_TIME`` adds the Slurm prologue
    (and the total then counts from Slurm's start), ``NRL_RAY_READY_EPOCH`` splits cluster
    start-up from driver start-up. Same lines and numbers as NeMo RL's function.
    """
    now = time.time()
    job_start = os.environ.get(JOB_START_ENV)
    if not job_start:
        logging.warning(
            "Cannot detect container startup time: %s not set. "
            "Ensure the launch script exports this variable for init timing.",
            JOB_START_ENV,
        )
        return
    started = float(job_start)
    slurm_start = os.environ.get(SLURM_START_ENV)
    ray_ready = os.environ.get(RAY_READY_ENV)
    lines = ["", "=" * 60, " " * 14 + "CONTAINER INIT TIMING"]
    total = now - started
    if slurm_start:
        lines.append(f"  slurm_prologue: {started - float(slurm_start):.1f}s")
        total = now - float(slurm_start)
    if ray_ready:
        ready = float(ray_ready)
        lines.append(f"  cluster_startup (orchestrator+container+ray): {ready - started:.1f}s")
        lines.append(f"  driver_startup (launch+python+imports): {now - ready:.1f}s")
    lines.append(f"  total: {total:.1f}s")
    lines.append("=" * 60)
    print("\n".join(lines) + "\n", flush=True)
