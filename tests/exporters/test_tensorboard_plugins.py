"""TensorBoard's HPARAMS, IMAGES and TEXT tabs and histograms, read back with TensorBoard's own
code: the hparams plugin's backend (what the HPARAMS tab asks for) over the plugin event
multiplexer, and EventAccumulator for images, text and histograms."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from otel_rl import Logger
from testkit.figures import line_figure, rendered_png
from testkit.readers import tensorboard_accumulator

pytest.importorskip("tensorboard")


def f32(x: float) -> float:
    return float(np.float32(x))


def hparams_tab(logdir: Path) -> tuple[Any, Any]:
    """``(experiment, session_groups)`` as the HPARAMS tab gets them from ``tensorboard
    --logdir <logdir>``."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import (
        api_pb2,
        backend_context,
        get_experiment,
        list_session_groups,
    )

    multiplexer = pem.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    tb_context = base_plugin.TBContext(
        logdir=str(logdir), data_provider=provider, multiplexer=multiplexer
    )
    backend = backend_context.Context(tb_context)
    request_context = context.RequestContext()
    experiment = get_experiment.Handler(
        request_context, backend, "", api_pb2.GetExperimentRequest()
    ).run()
    every_status = [api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE,
                    api_pb2.STATUS_RUNNING]
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, allowed_statuses=every_status
    )
    groups = list_session_groups.Handler(request_context, backend, "", request).run()
    return experiment, groups.session_groups


def plain(value: Any) -> Any:
    kind = value.WhichOneof("kind")
    return getattr(value, kind)


def test_hparams_tab_shows_the_run_its_hyperparameters_and_last_metrics(log_dir):
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": False}
    with Logger(cfg) as logger:
        logger.log_hyperparams({"lr": 3e-4, "model": {"name": "qwen", "layers": [1, 2]},
                                "use_kl": True, "api_token": "abcd1234"})
        logger.log_hyperparams({"seed": 7})  # a second call before training: merged
        for step in range(3):
            logger.log_metrics({"train/loss": 1.0 / (step + 1), "reward": float(step)}, step=step)

    experiment, groups = hparams_tab(log_dir)  # the parent, as `tensorboard --logdir logs`
    types = {h.name: h.type for h in experiment.hparam_infos}
    from tensorboard.plugins.hparams import api_pb2

    assert types == {
        "lr": api_pb2.DATA_TYPE_FLOAT64, "seed": api_pb2.DATA_TYPE_FLOAT64,
        "model.name": api_pb2.DATA_TYPE_STRING, "model.layers": api_pb2.DATA_TYPE_STRING,
        "use_kl": api_pb2.DATA_TYPE_BOOL, "api_token": api_pb2.DATA_TYPE_STRING,
    }
    assert {m.name.tag for m in experiment.metric_infos} == {"train/loss", "reward"}
    (group,) = groups
    hparams = {k: plain(v) for k, v in group.hparams.items()}
    assert hparams == {"lr": 3e-4, "seed": 7.0, "model.name": "qwen", "model.layers": "[1, 2]",
                       "use_kl": True, "api_token": "***REDACTED***"}
    (session,) = group.sessions
    assert session.status == api_pb2.STATUS_SUCCESS
    assert session.end_time_secs >= session.start_time_secs > 0
    last = {m.name.tag: (m.training_step, m.value) for m in session.metric_values}
    assert last == {"train/loss": (2, f32(1 / 3)), "reward": (2, 2.0)}


def test_hparams_session_failed_after_an_exception(log_dir):
    from tensorboard.plugins.hparams import api_pb2

    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": False}
    with pytest.raises(ValueError, match="diverged"), Logger(cfg) as logger:
        logger.log_hyperparams({"lr": 1.0})
        logger.log_metrics({"loss": 1e9}, step=0)
        raise ValueError("diverged")

    _, (group,) = hparams_tab(log_dir)
    assert [s.status for s in group.sessions] == [api_pb2.STATUS_FAILURE]


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_hparams_after_the_first_step_go_to_the_text_tab(log_dir, otel_rl_warnings, delivery):
    """The warning reaches the training process's log in both delivery modes."""
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": False,
           "export": {"delivery": delivery}}
    with Logger(cfg) as logger:
        logger.log_hyperparams({"lr": 0.1})
        logger.log_metrics({"loss": 1.0}, step=0, step_finished=True)
        logger.log_hyperparams({"late": "yes"})
        logger.log_metrics({"loss": 0.5}, step=1)

    _, (group,) = hparams_tab(log_dir)
    assert {k: plain(v) for k, v in group.hparams.items()} == {"lr": 0.1}
    acc = tensorboard_accumulator(log_dir / "tensorboard")
    tables = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("hyperparams")]
    assert tables[-1] == "| key | value |\n|---|---|\n| late | yes |\n| lr | 0.1 |"
    assert any("HPARAMS tab keeps" in r.getMessage() for r in otel_rl_warnings.records)


def test_plots_are_images_at_their_steps(log_dir):
    import matplotlib.pyplot as plt

    figures = {2: line_figure([1, 3, 2]), 5: line_figure([2, 2, 0])}
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": False}
    with Logger(cfg) as logger:
        for step, figure in figures.items():
            logger.log_plot(figure, step=step, name="rollouts/reward")

    images = tensorboard_accumulator(log_dir / "tensorboard").Images("rollouts/reward")
    assert [e.step for e in images] == [2, 5]
    for event, (_, figure) in zip(images, sorted(figures.items()), strict=True):
        png = rendered_png(figure)
        assert event.encoded_image_string == png
        width, height = figure.canvas.get_width_height()
        assert 0 < event.width <= width + 40 and 0 < event.height <= height + 40
    plt.close("all")


def test_tables_are_markdown_text_at_their_step(log_dir):
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": False}
    with Logger(cfg) as logger:
        logger.log_table("val/samples", ["prompt", "response", "reward"],
                         [["2+2?", "4", 1.0], ["a|b", "line1\nline2", -0.5]], step=9)

    acc = tensorboard_accumulator(log_dir / "tensorboard")
    (event,) = acc.Tensors("val/samples")
    assert event.step == 9
    assert event.tensor_proto.string_val[0].decode() == (
        "| prompt | response | reward |\n"
        "|---|---|---|\n"
        "| 2+2? | 4 | 1.0 |\n"
        "| a\\|b | line1<br>line2 | -0.5 |"
    )


def test_otel_histograms_and_text_rows(log_dir):
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": False}
    with Logger(cfg) as logger:
        meter = logger.meter_provider.get_meter("my_lib")
        latency = meter.create_histogram(
            "latency", unit="s", explicit_bucket_boundaries_advisory=[0.1, 1.0]
        )
        for value in (0.05, 0.5, 0.7, 3.0):
            latency.record(value)
        logger.log_metrics({"sample": "**bold** answer"}, step=1, prefix="val")
        latency.record(0.2)
        logger.log_metrics({"loss": 1.0}, step=2)

    acc = tensorboard_accumulator(log_dir / "tensorboard")
    first, second = acc.Histograms("latency")
    assert (first.step, second.step) == (1, 2)
    h = first.histogram_value
    assert (h.num, h.min, h.max) == (4, 0.05, 3.0)
    assert h.sum == pytest.approx(4.25)
    assert list(h.bucket) == [1.0, 2.0, 1.0] and list(h.bucket_limit) == [0.1, 1.0, 3.0]
    assert (second.histogram_value.num, second.histogram_value.sum) == (1, 0.2)
    assert [(e.step, e.value) for e in acc.Scalars("latency/count")] == [(1, 4.0), (2, 1.0)]
    (text,) = acc.Tensors("val/sample")
    assert (text.step, text.tensor_proto.string_val[0].decode()) == (1, "**bold** answer")


@pytest.mark.parametrize("delivery", ["thread", "process"])
def test_backwards_step_is_kept_as_a_second_point(log_dir, otel_rl_warnings, delivery):
    """The warning reaches the training process's log in both delivery modes."""
    cfg = {"log_dir": str(log_dir), "tensorboard_enabled": True, "jsonl_enabled": False,
           "export": {"delivery": delivery}}
    with Logger(cfg) as logger:
        for step, value in [(0, 0.0), (1, 1.0), (2, 2.0), (1, 1.5), (3, 3.0)]:
            logger.log_metrics({"loss": value}, step=step, step_finished=True)
        exporter = next(e for e in logger.exporters if e.name == "tensorboard")

    loss = tensorboard_accumulator(log_dir / "tensorboard").Scalars("loss")
    assert [(e.step, e.value) for e in loss] == [(0, 0.0), (1, 1.0), (2, 2.0), (1, 1.5), (3, 3.0)]
    assert exporter.stats["backwards_steps"] == 1
    assert any("TensorBoard keeps both" in r.getMessage() for r in otel_rl_warnings.records)
