"""Training-thread cost of logging one large array or tensor (its statistics are made there).

    python -m benchmarks.array_summary [--quick]    # 10k, 100k, 1M elements

Measured per ``flatten_into`` call (what ``log_metrics`` does with the value on the caller's
thread), medians: numpy's summary of large arrays (otel-rl) against the exact path every list
takes, which large arrays took before (``tolist``, a sort and ``math.fsum`` in Python), given
the same array, alternately in the same run; for a float32 numpy array and a bfloat16 torch
tensor. And per ``log_histogram`` of a float32 numpy array (its binning, on the caller's thread
too): numpy's binning (otel-rl) against what every histogram took before, each element through
``float()`` and binned in Python.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

FULL = ((10_000, 30), (100_000, 10), (1_000_000, 5))
QUICK = ((10_000, 3), (100_000, 2))


def measure(size: int, repeat: int, kind: str) -> dict[str, Any]:
    import numpy as np

    from otel_rl.core import values

    rng = np.random.default_rng(size)
    data = rng.normal(0.0, 1.0, size).astype(np.float32)
    if kind == "torch-bfloat16":
        import torch

        value: Any = torch.from_numpy(data).bfloat16()
    else:
        value = data
    fast_threshold = values.NUMPY_SUMMARY_FROM
    fast, exact = [], []
    for _ in range(repeat):
        for threshold, samples in ((fast_threshold, fast), (1 << 62, exact)):
            values.NUMPY_SUMMARY_FROM = threshold
            try:
                began = time.perf_counter()
                values.flatten_into({}, {"v": value}, "", lambda key, reason: None)
                samples.append(time.perf_counter() - began)
            finally:
                values.NUMPY_SUMMARY_FROM = fast_threshold
    otel, baseline = statistics.median(fast), statistics.median(exact)
    return {"elements": size, "kind": kind, "otel_rl_ms": round(otel * 1e3, 2),
            "exact_path_ms": round(baseline * 1e3, 2), "ratio": round(baseline / otel, 1)}


def measure_histogram(size: int, repeat: int) -> dict[str, Any]:
    import numpy as np

    from otel_rl.core.records import histogram_of
    from otel_rl.core.values import histogram_of_values

    value = np.random.default_rng(size).normal(0.0, 1.0, size).astype(np.float32)
    fast, exact = [], []
    for _ in range(repeat):
        began = time.perf_counter()
        histogram_of_values(value, 30)
        fast.append(time.perf_counter() - began)
        began = time.perf_counter()
        histogram_of([float(v) for v in value], 30)  # Logger.log_histogram before numpy's path
        exact.append(time.perf_counter() - began)
    otel, baseline = statistics.median(fast), statistics.median(exact)
    return {"elements": size, "kind": "log_histogram numpy-float32",
            "otel_rl_ms": round(otel * 1e3, 2), "exact_path_ms": round(baseline * 1e3, 2),
            "ratio": round(baseline / otel, 1)}  # fmt: skip


def run(quick: bool = False) -> list[dict[str, Any]]:
    sizes = QUICK if quick else FULL
    rows = [measure(size, repeat, kind) for size, repeat in sizes
            for kind in ("numpy-float32", "torch-bfloat16")]  # fmt: skip
    return rows + [measure_histogram(size, repeat) for size, repeat in sizes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    for row in run(parser.parse_args().quick):
        print(row)


if __name__ == "__main__":
    main()
