"""Large JSONL artifact dumps (NeMo RL's log_batched_dict_as_jsonl) leave the training thread:
the call returns after a snapshot, the file is complete and valid after flush()."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from otel_rl.compat.nemo_rl import Logger
from otel_rl.delivery import artifacts

torch = pytest.importorskip("torch")

BATCH, TOKENS = 1024, 4096


def quiet_config(log_dir, **extra):
    return {"log_dir": str(log_dir), "jsonl_enabled": False, **extra}


def rollout_batch(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "token_ids": torch.randint(0, 151_000, (BATCH, TOKENS), generator=gen),
        "logprobs": -torch.rand((BATCH, TOKENS), generator=gen) * 10,
        "text": [f"sample {i}: " + "lorem ipsum " * 340 for i in range(BATCH)],
        "rewards": torch.linspace(-1, 1, BATCH),
    }


@pytest.mark.slow
def test_a_1024_x_4096_batch_is_complete_after_flush_though_the_caller_reuses_its_buffers(log_dir):
    batch = rollout_batch()
    original = {
        "token_ids": batch["token_ids"].clone(),
        "logprobs": batch["logprobs"].clone(),
        "text": list(batch["text"]),
        "rewards": batch["rewards"].clone(),
    }
    logger = Logger(quiet_config(log_dir))
    logger.log_batched_dict_as_jsonl(batch, "train_data_step12.jsonl")  # its cost: a benchmark
    # The caller reuses its buffers at once; the file must hold what was logged.
    batch["token_ids"].zero_()
    batch["logprobs"].fill_(float("nan"))
    batch["text"][0] = "overwritten"
    assert logger.flush(timeout=120)
    logger.finish()

    path = log_dir / "train_data_step12.jsonl"
    assert not path.with_name(path.name + ".tmp").exists()
    lines = path.read_bytes().splitlines()
    assert len(lines) == BATCH
    for i in (0, 1, 517, BATCH - 1):
        row = json.loads(lines[i])
        assert list(row) == ["token_ids", "logprobs", "text", "rewards", "idx"]
        assert row["idx"] == i
        assert row["token_ids"] == [original["token_ids"][i].tolist()]
        assert row["text"] == [original["text"][i]]
        logprobs = np.asarray(row["logprobs"][0], dtype=np.float32)
        assert np.array_equal(logprobs, original["logprobs"][i].numpy())
        assert np.float32(row["rewards"][0]) == original["rewards"][i].item()
    assert all(line.endswith(b"}") for line in lines)  # every line whole


def test_non_finite_values_keep_their_json_tokens(log_dir):
    logprobs = np.array([[-0.5, -1.0], [-np.inf, np.nan]], dtype=np.float32)
    with Logger(quiet_config(log_dir)) as logger:
        logger.log_batched_dict_as_jsonl(
            {"logprobs": logprobs, "scores": [1.5, math.inf], "tag": ["a", "b"]}, "dump.jsonl"
        )
    text = (log_dir / "dump.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in text)
    assert first == {"logprobs": [[-0.5, -1.0]], "scores": [1.5], "tag": ["a"], "idx": 0}
    assert second["logprobs"][0][0] == -math.inf and math.isnan(second["logprobs"][0][1])
    assert second["scores"] == [math.inf] and "NaN" in text[1] and "null" not in text[1]


def test_the_json_fallback_writes_the_same_content(log_dir, monkeypatch):
    batch = {
        "ids": torch.arange(6).reshape(3, 2),
        "lp": torch.tensor([[0.25], [0.5], [1.0]]),
        "meta": [{"k": 1}, {"k": 2}, {"k": 3}],
    }
    with Logger(quiet_config(log_dir)) as logger:
        logger.log_batched_dict_as_jsonl(batch, "fast.jsonl")
        logger.flush()
        monkeypatch.setattr(artifacts, "_orjson", None)
        logger.log_batched_dict_as_jsonl(batch, "slow.jsonl")
    fast = [json.loads(x) for x in (log_dir / "fast.jsonl").read_text().splitlines()]
    slow = [json.loads(x) for x in (log_dir / "slow.jsonl").read_text().splitlines()]
    assert (
        fast
        == slow
        == [
            {"ids": [[0, 1]], "lp": [[0.25]], "meta": [{"k": 1}], "idx": 0},
            {"ids": [[2, 3]], "lp": [[0.5]], "meta": [{"k": 2}], "idx": 1},
            {"ids": [[4, 5]], "lp": [[1.0]], "meta": [{"k": 3}], "idx": 2},
        ]
    )


def test_a_batch_of_mismatched_lengths_is_refused(log_dir, otel_rl_warnings):
    bad = {"ids": torch.zeros(4, 2), "text": ["a", "b"]}
    with Logger(quiet_config(log_dir)) as logger:
        logger.log_batched_dict_as_jsonl(bad, "bad.jsonl")
    assert not (log_dir / "bad.jsonl").exists()
    assert "same length" in otel_rl_warnings.text
    with (
        Logger(quiet_config(log_dir, strict=True)) as logger,
        pytest.raises(ValueError, match="same length"),
    ):
        logger.log_batched_dict_as_jsonl(bad, "bad.jsonl")


def test_the_writer_bounds_memory_and_keeps_order(tmp_path):
    writer = artifacts.ArtifactWriter(max_pending=1)
    order: list[int] = []

    def job(k: int):
        def run() -> int:
            time.sleep(0.05)
            order.append(k)
            return 1

        return run

    for k in range(4):
        writer.submit(f"job {k}", job(k))
    assert writer.stats["waits"] >= 1  # the queue was full: submit waited instead of growing
    assert writer.close(timeout=10)
    assert order == [0, 1, 2, 3] and writer.stats["written"] == 4


def test_a_fork_child_exits_without_waiting_for_the_parents_dumps(tmp_path):
    """A forked child inherits the writer's queue but not its thread: its exit must not wait
    (300 s) for dumps only the parent can write, and the parent's dump still arrives."""
    script = tmp_path / "fork_child.py"
    out = tmp_path / "dump.txt"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys, threading
        from otel_rl.delivery.artifacts import ArtifactWriter

        gate = threading.Event()
        writer = ArtifactWriter()

        def job():
            gate.wait()
            with open({str(out)!r}, "w") as fh:
                fh.write("parent")
            return 6

        writer.submit("dump", job)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the child's interpreter exit runs the atexit functions
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        gate.set()
    """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "child exit 0" in done.stdout
    assert out.read_text() == "parent"  # the parent's own exit still drained its writer
