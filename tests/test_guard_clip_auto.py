"""``clip_per_sample="auto"``: the retention level while the noise sent keeps the parameters' moves within
CLIP_MAX_MOVE, the median otherwise (``flguard.guard.clipping.AdaptiveClip``), on a 3-channel GroupNorm ResNet.

References: per-sample gradients by autograd one sample at a time, the levels by a brute-force search over them,
and the dense clipped upload at the level the report names (what is sent minus it must be the reported noise).
"""

from __future__ import annotations

import pytest
import torch

from flguard import Guard, GuardConfig
from flguard.guard import clipping
from flguard.guard.clipping import CLIP_MAX_MOVE, CLIP_MEDIAN_STEPS, CLIP_MOVE_STEPS, AdaptiveClip
from risk_reference import resnet8_gn_batch

TAU = 0.2
RETENTION = 0.9  # high enough that the retention level is above the median on this batch


@pytest.fixture(scope="module")
def problem():
    model, x, y, per = resnet8_gn_batch()
    norms, g = per.norm(dim=1), per.sum(dim=0)
    median = float(norms.sort().values[3])  # the lower median of 8
    retained = next(float(c) for c in norms.sort().values[3:]
                    if float((per * torch.clamp(c / norms, max=1.0)[:, None]).sum(0) @ g) >= RETENTION * float(g @ g))
    assert retained > median
    theta = float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).norm())
    return model, x, y, per, median, retained, theta


def _config(**extra) -> GuardConfig:
    return GuardConfig(**{"defense": "auto", "clip_per_sample": "auto", **extra}, min_rmse=TAU, seed=2,
                       clip_retention=RETENTION, max_rel_noise=1e6, max_excluded=0.0)


def _sent_noise(per: torch.Tensor, clip: float, sent: torch.Tensor) -> float:
    """‖what was sent − the dense clipped upload Σ_i min(1, C/‖g_i‖)·g_i / B at ``clip``‖."""
    upload = (per * torch.clamp(clip / per.norm(dim=1), max=1.0)[:, None]).sum(0) / per.shape[0]
    return float((sent - upload).norm())


def test_a_small_move_keeps_the_retention_level(problem):
    model, x, y, per, median, retained, _ = problem
    out = Guard(_config()).protect(model, x, y, per.sum(0) / 8, step_size=1e-12)
    assert out.report.met and out.gradient is not None
    assert out.report.details["clip_rule"] == "retention" and "clip_reasons" not in out.report.details
    assert out.report.details["clip"] == pytest.approx(retained, rel=1e-6)
    torch.testing.assert_close(out.report.noise_norm, _sent_noise(per, retained, out.gradient))


def test_a_move_over_the_limit_redoes_the_step_at_the_median_and_keeps_it_there(problem, monkeypatch):
    """The retention attempt's noise would move the parameters by far more than CLIP_MAX_MOVE: the step is sent at
    the lower median (what is sent minus the dense clipped upload at the median is the reported noise), the reply
    says why, and the next CLIP_MEDIAN_STEPS steps take the median without trying the retention level. (A step of
    size 1e6 would undo any training: the rules on its effect, which withhold such a step, are off here.)"""
    from flguard.guard import engine

    monkeypatch.setattr(engine, "step_effect", lambda op, step_size: None)  # the step's effect is not measured
    model, x, y, per, median, _, _ = problem
    guard = Guard(_config())
    g = per.sum(0) / 8
    first = guard.protect(model, x, y, g, step_size=1e6)
    assert first.report.met and first.report.details["clip_rule"] == "median"
    assert "retention" in first.report.details["clip_reasons"] and f"{CLIP_MAX_MOVE:.0%}" in first.report.details["clip_reasons"]
    assert first.report.details["clip"] == pytest.approx(median, rel=1e-6)
    torch.testing.assert_close(first.report.noise_norm, _sent_noise(per, median, first.gradient))
    later = [guard.protect(model, x, y, g, step_size=1e6) for _ in range(CLIP_MEDIAN_STEPS)]
    assert all(o.report.details["clip_rule"] == "median" and "clip_reasons" not in o.report.details for o in later)
    again = guard.protect(model, x, y, g, step_size=1e6)  # the median's steps are over: retention is tried again
    assert again.report.details["clip_rule"] == "median" and "clip_reasons" in again.report.details


def test_the_limit_is_on_the_running_root_mean_square_of_the_moves(problem):
    """At a step size that puts the retention level's move m just under / over CLIP_MAX_MOVE on a first step (the
    average is then m² itself), the rule keeps / leaves the retention level; the same draw both times. (The
    Gaussian alone: ``auto`` would switch to its aimed noise at the same limit and move less.)"""
    model, x, y, per, _, retained, theta = problem
    g = per.sum(0) / 8
    probe = Guard(_config(defense="gaussian")).protect(model, x, y, g, step_size=1e-12)
    at_limit = CLIP_MAX_MOVE * theta / probe.report.noise_norm  # the step size whose move is exactly the limit
    near = Guard(_config(defense="gaussian")).protect(model, x, y, g, step_size=0.9 * at_limit)
    far = Guard(_config(defense="gaussian")).protect(model, x, y, g, step_size=1.1 * at_limit)
    assert near.report.details["clip_rule"] == "retention" and near.report.details["clip"] == pytest.approx(retained)
    assert far.report.details["clip_rule"] == "median"


def test_only_the_raised_level_of_auto_judges_the_gaussian_against_the_stricter_limit(problem):
    """At a step size where the Gaussian at the retention level moves the weights by 7.5% — over CLIP_MAX_MOVE, under
    AUTO_MAX_MOVE — an explicit ``clip_per_sample="retention"`` still sends the Gaussian (auto's own 10%), while
    ``"auto"`` does not send it at that level (its aimed noise, or the median)."""
    from flguard.guard.perturb import AUTO_MAX_MOVE

    model, x, y, per, _, retained, theta = problem
    g = per.sum(0) / 8
    probe = Guard(_config(defense="gaussian", clip_per_sample="retention")).protect(model, x, y, g, step_size=1e-12)
    step = 0.75 * AUTO_MAX_MOVE * theta / probe.report.noise_norm
    assert CLIP_MAX_MOVE < 0.75 * AUTO_MAX_MOVE
    explicit = Guard(_config(clip_per_sample="retention")).protect(model, x, y, g, step_size=step)
    assert explicit.report.details["defense_used"] == "gaussian"
    assert explicit.report.details["clip"] == pytest.approx(retained)
    adaptive = Guard(_config()).protect(model, x, y, g, step_size=step)
    assert not (adaptive.report.details["clip_rule"] == "retention"
                and adaptive.report.details["defense_used"] == "gaussian")


def test_without_a_step_size_the_level_is_the_median(problem):
    model, x, y, per, median, _, _ = problem
    out = Guard(_config()).protect(model, x, y, per.sum(0) / 8)
    assert out.report.details["clip_rule"] == "median" and out.report.details["clip"] == pytest.approx(median)


def test_the_running_average_written_out():
    rule = AdaptiveClip()
    assert rule.setting(None) == "median" and rule.setting(1.0) == "retention" and rule.recent_move is None
    rule.record(0.04)
    assert rule.recent_move == pytest.approx(0.04)
    # m² averaged over CLIP_MOVE_STEPS: 0.04² + (m² − 0.04²)/8 > CLIP_MAX_MOVE² ⟺ m > √(8·CLIP_MAX_MOVE² − 7·0.04²)
    edge = (CLIP_MOVE_STEPS * CLIP_MAX_MOVE ** 2 - (CLIP_MOVE_STEPS - 1) * 0.04 ** 2) ** 0.5
    assert not rule.too_far(0.999 * edge) and rule.too_far(1.001 * edge)
    assert rule.recent_move == pytest.approx(0.04)  # too_far records nothing
    rule.fall_back()
    assert [rule.setting(1.0) for _ in range(CLIP_MEDIAN_STEPS + 1)] == ["median"] * CLIP_MEDIAN_STEPS + ["retention"]


def test_clip_auto_is_a_valid_setting_and_a_bad_string_names_the_field():
    assert GuardConfig(clip_per_sample="auto").clip_per_sample == "auto"
    with pytest.raises(ValueError, match="clip_per_sample"):
        GuardConfig(clip_per_sample="automatic")
    assert clipping.CLIP_MAX_MOVE > 0
