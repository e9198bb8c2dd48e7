"""How a tracker's error is classified, and what the message tells the user to do."""

from __future__ import annotations

import pytest

from otel_rl.core.failures import RowRejected, classify


@pytest.mark.parametrize(
    "tracker", ["wandb", "mlflow", "swanlab", "tensorboard", "trackio", "clearml"]
)
def test_a_missing_sdk_of_our_own_trackers_names_otel_rls_extra(tracker):
    failure = classify(ModuleNotFoundError(f"No module named '{tracker}'", name=tracker), "open",
                       tracker)  # fmt: skip
    assert failure.kind == "permanent"
    assert failure.hint == f'install the tracker\'s SDK: pip install "otel-rl[{tracker}]"'


def test_a_missing_sdk_of_a_third_party_tracker_names_the_module_not_an_extra():
    module = "mytracker_sdk.client"
    error = ModuleNotFoundError(f"No module named '{module}'", name=module)
    failure = classify(error, "open", "mytracker")
    assert failure.kind == "permanent"
    assert failure.hint == (
        "install the tracker's SDK (the 'mytracker_sdk' module): pip install mytracker_sdk"
    )
    assert "otel-rl[" not in failure.describe()


def test_a_refused_record_costs_only_itself():
    assert classify(RowRejected("no"), "write", "mytracker").kind == "record"
