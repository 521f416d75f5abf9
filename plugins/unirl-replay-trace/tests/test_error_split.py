"""What a calibration's held-out error is made of (issue 73): the schedule's shape against the batch's
speed. Oracle: predictions that are the measurements times a per-batch factor have a perfect shape."""

from __future__ import annotations

import pytest

from unirl_replay_trace.error_split import error_split


def rows(batch, measured, factor):
    return [{"batch": batch, "measured": {"e2e": m}, "predicted": {"e2e": m * factor}} for m in measured]


def test_a_per_batch_speed_error_is_not_counted_as_shape_and_the_spread_is_measured():
    held = {"per_request": rows(1, [100, 200, 300], 2.0) + rows(3, [50, 60, 70], 0.25),
            "batch_readiness": [{"batch": 1, "measured_ms": 300.0, "predicted_ms": 600.0},
                                {"batch": 3, "measured_ms": 900.0, "predicted_ms": 120.0}]}
    fitting = {"per_request": [], "batch_readiness": [{"batch": 0, "measured_ms": 400.0, "predicted_ms": 1.0},
                                                      {"batch": 2, "measured_ms": 600.0, "predicted_ms": 1.0}]}
    split = error_split(held, fitting, {0: "train", 1: "train", 2: "train", 3: "train"})
    assert split["shape_only_request_e2e_median_ape"] == pytest.approx(0.0)  # the raw error is 75-100 %
    train = split["makespan_spread"]["train"]
    assert (train["measured_ms_min"], train["measured_ms_max"], train["batches"]) == (300.0, 900.0, 4)
    # the constant predictor is the fitting batches' median, 500 ms: |300-500|/300 and |900-500|/900
    assert train["constant_predictor_holdout_median_ape"] == pytest.approx((2 / 3 + 4 / 9) / 2)


def test_a_wrong_order_inside_a_batch_stays_in_the_shape_error():
    held = {"per_request": [{"batch": 1, "measured": {"e2e": 100}, "predicted": {"e2e": 300}},
                            {"batch": 1, "measured": {"e2e": 300}, "predicted": {"e2e": 100}}],
            "batch_readiness": [{"batch": 1, "measured_ms": 300.0, "predicted_ms": 300.0}]}
    split = error_split(held, {"per_request": [], "batch_readiness": []}, {1: "eval"})
    assert split["shape_only_request_e2e_median_ape"] > 0.5
    assert split["makespan_spread"]["eval"]["constant_predictor_holdout_median_ape"] is None  # nothing fitted
