"""The guard's reply metrics: METRIC_KEYS, listed once, and ``summarise`` over one or more steps."""

from __future__ import annotations

import pytest
import torch

from flguard.flower.guard_mod import round_metrics
from flguard.guard.report import METRIC_KEYS, GuardReport, summarise


def _report(after, lb, met, noise, matvecs, seconds):
    return GuardReport(rmse_after=torch.tensor(after), rmse_lb_after=torch.tensor(lb), eps=torch.zeros(len(after)),
                       noise_norm=noise, rel_noise=noise / 10, met=met, defense="gaussian", reason="",
                       matvecs=matvecs, seconds=seconds)


@pytest.mark.parametrize("nan_step", [False, True])
def test_summarise_is_the_worst_sample_over_steps(nan_step):
    first = _report([0.3, 0.1, 0.2], [0.01, 0.02, 0.03], True, 2.0, 10, 0.5)
    second = _report([float("nan")] * 2 if nan_step else [0.4, 0.05], [float("nan")] * 2 if nan_step else [0.04, 0.005],
                     not nan_step, 3.0, 7, 0.25)
    metrics = summarise([first, second])
    assert round_metrics([first, second]) == metrics  # the Flower layer's round summary is the same
    assert tuple(metrics) == METRIC_KEYS
    expected = ([0.0, 0.0, -1.0, 0.2, -1.0, 3.0, 0.3, 17.0, 0.75, 0.0, 5.0, 2.0, 0.0] if nan_step else
                [1.0, 0.0, 0.05, 0.2, 0.005, 3.0, 0.3, 17.0, 0.75, 0.0, 5.0, 2.0, 0.0])
    assert list(metrics.values()) == pytest.approx(expected)
    assert first.metrics(dropped=True) == pytest.approx(dict(zip(METRIC_KEYS, [1.0, 1.0, 0.1, 0.2, 0.01, 2.0, 0.2,
                                                                                10.0, 0.5, 0.0, 3.0, 1.0, 0.0])))


def test_left_out_samples_are_counted_and_do_not_count_as_the_worst():
    inf = float("inf")
    step = GuardReport(rmse_after=torch.tensor([0.3, inf, 0.2, inf]), rmse_lb_after=torch.tensor([0.1, inf, 0.05, inf]),
                       eps=torch.zeros(4), noise_norm=1.0, rel_noise=0.1, met=True, defense="eigen", reason="",
                       matvecs=4, seconds=0.1, details={"excluded": 2})
    other = _report([0.25, 0.4], [0.02, 0.03], True, 2.0, 3, 0.2)
    metrics = summarise([step, other])
    assert metrics["guard_excluded"] == 2.0 and metrics["guard_samples"] == 6.0
    assert metrics["guard_min_rmse_after"] == pytest.approx(0.2) and metrics["guard_min_rmse_lb_after"] == pytest.approx(0.02)
    assert metrics["guard_median_rmse_after"] == pytest.approx(0.25)


def test_aimed_steps_count_the_kind_each_met_step_sent():
    """``guard_aimed_steps``: a met eigen step and a met auto step that sent resolvent count; auto's Gaussian, a
    plain gaussian step and an unmet eigen step do not."""
    def step(defense, met, used=None):
        return GuardReport(rmse_after=torch.tensor([0.3]), rmse_lb_after=torch.tensor([0.1]), eps=torch.zeros(1),
                           noise_norm=1.0, rel_noise=0.1, met=met, defense=defense, reason="", matvecs=1, seconds=0.1,
                           details={} if used is None else {"defense_used": used})
    reports = [step("eigen", True), step("auto", True, "resolvent"), step("auto", True, "gaussian"),
               step("gaussian", True), step("eigen", False)]
    metrics = summarise(reports)
    assert metrics["guard_steps"] == 5.0 and metrics["guard_aimed_steps"] == 2.0
