"""Training-thread cost of a large rollout dump: ``log_batched_dict_as_jsonl`` of 1,024 samples x
4,096 tokens (token ids int64, logprobs float32, ~4 KB of text per sample).

Compared, alternated in one run:
- ours: ``otel_rl.compat.nemo_rl.Logger.log_batched_dict_as_jsonl`` — the call's return time
  (a snapshot of the tensors) and, separately, how long the background write takes to be on
  disk (``flush()``), with orjson and with the json fallback; and how much pure-Python work
  the caller still gets done while the writer thread holds the GIL (vs. an idle writer);
- baseline: a synchronous writer on the training thread, as NeMo RL's logger does it — each
  sample sliced, ``.tolist()``, ``json.dumps``, written line by line.

    python -m benchmarks.artifact_dump [--batch 1024] [--tokens 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def make_batch(batch: int, tokens: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return {
        "token_ids": torch.randint(0, 151_000, (batch, tokens), generator=gen),
        "logprobs": -torch.rand((batch, tokens), generator=gen) * 10,
        "text": [f"sample {i}: " + "lorem ipsum " * 340 for i in range(batch)],
    }


def sync_json_writer(path: Path, data: dict[str, Any]) -> None:
    """The baseline: everything on the caller's thread."""
    size = len(next(iter(data.values())))
    with open(path, "w") as f:
        for i in range(size):
            sample = {}
            for key, value in data.items():
                part = value[i : i + 1]
                sample[key] = part.tolist() if hasattr(part, "tolist") else part
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")


def python_work(until: Any) -> tuple[int, float]:
    """Units of pure-Python work done until ``until()`` is true: (units, seconds)."""
    start = time.perf_counter()
    units = 0
    while not until():
        sum(range(2_000))
        units += 1
    return units, time.perf_counter() - start


def work_rate_during_dump(directory: Path, data: dict[str, Any]) -> float:
    """The caller's Python work rate while a dump is written, relative to an idle writer."""
    from otel_rl.compat.nemo_rl import Logger

    logger = Logger({"log_dir": str(directory), "jsonl_enabled": False})
    deadline = time.perf_counter() + 1.0
    idle_units, idle_s = python_work(lambda: time.perf_counter() >= deadline)
    logger.log_batched_dict_as_jsonl(data, "dump.jsonl")
    busy_units, busy_s = python_work(lambda: logger.artifacts.pending == 0)
    logger.finish()
    return (busy_units / busy_s) / (idle_units / idle_s)


def run_ours(directory: Path, data: dict[str, Any], engine: str) -> tuple[float, float]:
    from otel_rl.compat.nemo_rl import Logger
    from otel_rl.delivery import artifacts

    saved = artifacts._orjson
    if engine == "json":
        artifacts._orjson = None
    try:
        logger = Logger({"log_dir": str(directory), "jsonl_enabled": False})
        start = time.perf_counter()
        logger.log_batched_dict_as_jsonl(data, "dump.jsonl")
        returned = time.perf_counter() - start
        logger.flush(timeout=600)
        on_disk = time.perf_counter() - start
        logger.finish()
    finally:
        artifacts._orjson = saved
    return returned, on_disk


def measure(batch: int, tokens: int, rounds: int) -> dict[str, Any]:
    """Ours (orjson when installed, and the json fallback) and the sync writer, alternated."""
    from otel_rl.delivery.artifacts import JSON_ENGINE

    data = make_batch(batch, tokens)
    results: dict[str, list[float]] = {k: [] for k in (
        "ours_return_orjson", "ours_on_disk_orjson", "ours_return_json", "ours_on_disk_json",
        "sync_json")}  # fmt: skip
    rates: list[float] = []
    size_mb = 0.0
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            if JSON_ENGINE == "orjson":
                returned, on_disk = run_ours(root / "a", data, "orjson")
                results["ours_return_orjson"].append(returned)
                results["ours_on_disk_orjson"].append(on_disk)
            returned, on_disk = run_ours(root / "b", data, "json")
            results["ours_return_json"].append(returned)
            results["ours_on_disk_json"].append(on_disk)
            start = time.perf_counter()
            sync_json_writer(root / "sync.jsonl", data)
            results["sync_json"].append(time.perf_counter() - start)
            size_mb = (root / "sync.jsonl").stat().st_size / 1e6
            rates.append(work_rate_during_dump(root / "c", data))
    row: dict[str, Any] = {"batch": batch, "tokens": tokens, "json_mb": round(size_mb)}
    for name, values in results.items():
        if values:
            row[f"{name}_s"] = round(statistics.median(values), 3)
    sync = statistics.median(results["sync_json"])
    for engine in ("orjson", "json"):
        values = results[f"ours_return_{engine}"]
        if values:
            row[f"ratio_blocked_{engine}"] = round(sync / statistics.median(values))
    row[f"caller_work_rate_{JSON_ENGINE}"] = f"{statistics.median(rates):.0%}"
    return row


def run(quick: bool = False) -> dict[str, Any]:
    return measure(64, 512, 1) if quick else measure(1024, 4096, 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"batch {args.batch} x {args.tokens} tokens, median of {args.rounds} rounds (seconds)")
    for key, value in measure(args.batch, args.tokens, args.rounds).items():
        print(f"  {key:<24} {value}")


if __name__ == "__main__":
    main()
