"""What the noise sent does to the SGD step that applies it (``flguard.guard.damage``), and ``clip_per_sample="auto"``
leaving its raised level where that noise undoes the steps' progress (``AdaptiveClip.harmful``), on a 3-channel
GroupNorm ResNet. References: SGD steps taken on copies of the model and the batch loss evaluated there; the dense
clipped upload from autograd per-sample gradients; the running averages written out."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flguard import Guard, GuardConfig
from flguard.guard import clipping
from flguard.guard.clipping import (CLIP_FACTOR_HOLD, CLIP_LOWEST_FACTOR, CLIP_MAX_DAMAGE, CLIP_MEDIAN_STEPS,
                                    CLIP_MOVE_STEPS, AdaptiveClip)
from flguard.guard.damage import step_effect
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator
from risk_reference import resnet8_gn_batch

RETENTION = 0.9  # high enough that the retention level is above the median on this batch
STEP = 0.02  # an SGD step whose noise moves the weights far less than CLIP_MAX_MOVE here


@pytest.fixture(scope="module")
def problem():
    return resnet8_gn_batch()


def _config() -> GuardConfig:
    return GuardConfig(defense="auto", clip_per_sample="auto", min_rmse=0.2, seed=2, clip_retention=RETENTION,
                       max_rel_noise=1e6, max_excluded=0.0)


def _loss_after(model, x, y, direction: torch.Tensor, step: float) -> float:
    """The batch loss after θ − step·direction, on a copy of the model."""
    moved, offset = copy.deepcopy(model), 0
    with torch.no_grad():
        for p in moved.parameters():
            p.sub_(step * direction[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return float(nn.functional.cross_entropy(moved(x), y))


def _reference_effect(model, x, y, update, noise, step) -> tuple[float, float]:
    stepped = _loss_after(model, x, y, update, step)
    return _loss_after(model, x, y, torch.zeros_like(update), step) - stepped, \
        _loss_after(model, x, y, update + noise, step) - stepped


def _upload(per: torch.Tensor, clip: float) -> torch.Tensor:
    """The dense clipped upload Σ_i min(1, C/‖g_i‖)·g_i / B at ``clip``."""
    return (per * torch.clamp(clip / per.norm(dim=1), max=1.0)[:, None]).sum(0) / per.shape[0]


def test_step_effect_is_the_progress_and_the_damage_of_the_sgd_step(problem):
    model, x, y, per = problem
    g = per.mean(0)
    noise = torch.randn(g.shape, dtype=g.dtype, generator=torch.Generator().manual_seed(1))
    op = JacobianOperator(model, x, y)
    for on in (op, ClippedJacobian(op, 0.5)):  # a clipped operator: its base's batch and parameters
        for step in (1e-3, 0.3):
            progress, damage, loss = step_effect(on, step)(g, noise)
            reference = _reference_effect(model, x, y, g, noise, step)
            assert progress == pytest.approx(reference[0], rel=1e-9, abs=1e-13)
            assert damage == pytest.approx(reference[1], rel=1e-9, abs=1e-13)
            assert loss == pytest.approx(_loss_after(model, x, y, torch.zeros_like(g), step), rel=1e-12)
    assert step_effect(op, 1e-3)(g, torch.zeros_like(g))[1] == 0.0
    # L_B(θ) comes from the operator's first pass; a restricted copy's batch is its own rows, measured afresh
    rows = torch.arange(2)
    before = step_effect(op.restricted(rows), 1e-3)(g, torch.zeros_like(g))[2]
    assert before == pytest.approx(float(nn.functional.cross_entropy(model(x[rows]), y[rows])), rel=1e-9)
    assert step_effect(op, 1e-3)(g, torch.full_like(g, float("nan")))[1] == float("inf")


def test_the_running_averages_written_out():
    rule = AdaptiveClip()
    assert rule.recent_effect is None
    assert not rule.harmful((0.10, 0.0999, 1.0)) and rule.harmful((0.10, 0.1001, 1.0))  # a first step: its own ratio
    assert rule.harmful((-0.01, 1e-9, 1.0)) and not rule.harmful((-0.01, 0.0, 1.0))  # no progress: any damage harms
    assert rule.harmful((0.1, float("inf"), 1.0)) and rule.ruinous((0.1, float("inf"), 1.0))
    # ruinous: D > P and D > WITHHOLD_LOSS_SHARE·L, both
    assert clipping.WITHHOLD_LOSS_SHARE == 0.25
    assert rule.ruinous((0.1, 0.26, 1.0)) and not rule.ruinous((0.1, 0.24, 1.0)) and not rule.ruinous((0.6, 0.59, 1.0))
    rule.record(0.01, (0.10, 0.02, 1.0))
    assert rule.recent_effect == (0.10, 0.02, 1.0) and rule.recent_move == pytest.approx(0.01)
    # P̄ = 0.1 + (p − 0.1)/8, D̄ = 0.02 + (d − 0.02)/8; harmful ⟺ D̄ > CLIP_MAX_DAMAGE·P̄;
    # at p = 0.1: d > 0.1·8 − 0.02·7
    assert CLIP_MAX_DAMAGE == 1.0 and CLIP_MOVE_STEPS == 8
    edge = 0.1 * 8 - 0.02 * 7
    assert not rule.harmful((0.10, 0.999 * edge, 1.0)) and rule.harmful((0.10, 1.001 * edge, 1.0))
    # ruinous alone: D̄ = 0.02 + (0.26 − 0.02)/8 = 0.05 < P̄, but the step adds 0.26 > 0.25 L and > P
    assert rule.ruinous((0.10, 0.26, 1.0)) and not rule.ruinous((0.10, 0.24, 1.0))
    # ruinous on the averages, the step alone harmless: D̄ = 0.4 + (0.05 − 0.4)/8 = 0.35625 ≥ 0.25 L̄ while
    # L̄ = 1 + (l − 1)/8 ≤ 1.425, i.e. l ≤ 4.4
    recent = AdaptiveClip()
    recent.record(0.01, (0.10, 0.40, 1.0))
    assert recent.ruinous((0.10, 0.05, 0.999 * 4.4)) and not recent.ruinous((0.10, 0.05, 1.001 * 4.4))
    assert rule.recent_effect == (0.10, 0.02, 1.0)  # neither records anything
    rule.record(0.01)  # a step whose effect was not measured keeps the average
    assert rule.recent_effect == (0.10, 0.02, 1.0)
    rule.record(0.01, (0.02, 0.10, 2.0))
    assert rule.recent_effect == pytest.approx((0.09, 0.03, 1.125))


def test_the_report_carries_the_step_effect_of_what_is_sent(problem):
    """The retention level kept (damage under the limit here): the progress and damage reported are those of the
    dense clipped upload at the reported C and of the noise sent on top of it."""
    model, x, y, per = problem
    out = Guard(_config()).protect(model, x, y, per.mean(0), step_size=STEP)
    details = out.report.details
    assert out.report.met and details["clip_rule"] == "retention" and "clip_reasons" not in details
    upload = _upload(per, details["clip"])
    reference = _reference_effect(model, x, y, upload, out.gradient - upload, STEP)
    assert details["step_progress"] == pytest.approx(reference[0], rel=1e-6)
    assert details["noise_damage"] == pytest.approx(reference[1], rel=1e-6)
    with torch.no_grad():
        assert details["batch_loss"] == pytest.approx(float(nn.functional.cross_entropy(model(x), y)), rel=1e-9)
    assert details["noise_damage"] < CLIP_MAX_DAMAGE * details["step_progress"]


def test_noise_that_undoes_the_steps_progress_redoes_the_step_at_the_median(problem, monkeypatch):
    """With the limit just under this draw's damage ÷ progress the retention level is left: the step is sent at the
    median (what is sent minus the dense clipped upload there is the noise), the reply says why with the measured
    numbers, and the next CLIP_MEDIAN_STEPS steps take the median; just over it, the retention level is kept."""
    model, x, y, per = problem
    g = per.mean(0)
    probe = Guard(_config()).protect(model, x, y, g, step_size=STEP).report.details
    ratio = probe["noise_damage"] / probe["step_progress"]
    assert ratio > 0  # this draw adds loss: the limit can sit on either side of it
    monkeypatch.setattr(clipping, "CLIP_MAX_DAMAGE", 1.001 * ratio)
    kept = Guard(_config()).protect(model, x, y, g, step_size=STEP)
    assert kept.report.details["clip_rule"] == "retention"
    monkeypatch.setattr(clipping, "CLIP_MAX_DAMAGE", 0.999 * ratio)
    guard = Guard(_config())
    out = guard.protect(model, x, y, g, step_size=STEP)
    details = out.report.details
    assert out.report.met and details["clip_rule"] == "median"
    assert f"its noise would add {probe['noise_damage']:.3g} to the batch loss against the " \
           f"{probe['step_progress']:.3g} the step removes" in details["clip_reasons"]
    median = float(per.norm(dim=1).sort().values[3])  # the lower median of 8
    assert details["clip"] == pytest.approx(median, rel=1e-6)
    upload = _upload(per, median)
    torch.testing.assert_close(out.report.noise_norm, float((out.gradient - upload).norm()))
    reference = _reference_effect(model, x, y, upload, out.gradient - upload, STEP)
    assert details["step_progress"] == pytest.approx(reference[0], rel=1e-6)  # the median's step, as sent
    assert details["noise_damage"] == pytest.approx(reference[1], rel=1e-6)
    monkeypatch.setattr(clipping, "CLIP_LOWER_DAMAGE", float("inf"))  # the median itself kept (tested below)
    later = [guard.protect(model, x, y, g, step_size=STEP).report.details for _ in range(CLIP_MEDIAN_STEPS)]
    assert all(d["clip_rule"] == "median" and "clip_reasons" not in d for d in later)


def test_an_explicit_clip_level_measures_nothing(problem):
    model, x, y, per = problem
    out = Guard(GuardConfig(defense="auto", clip_per_sample="retention", min_rmse=0.2, seed=2,
                            clip_retention=RETENTION, max_rel_noise=1e6, max_excluded=0.0)).protect(
        model, x, y, per.mean(0), step_size=STEP)
    assert out.report.met and "noise_damage" not in out.report.details


def test_noise_that_would_undo_training_withholds_the_step(problem, monkeypatch):
    """At a step size where this draw's noise adds more loss than the step removes (D > P) at the median (the move
    rule's level), the step is withheld whatever WITHHOLD_LOSS_SHARE — the reason names the three numbers and C,
    nothing of it is recorded, the next step's C is half the median — and where D < P no share withholds."""
    model, x, y, per = problem
    g = per.mean(0)
    monkeypatch.setattr(clipping, "WITHHOLD_LOSS_SHARE", float("inf"))
    guard = Guard(_config())
    out = guard.protect(model, x, y, g, step_size=0.3)
    details = out.report.details
    progress, damage, loss = details["step_progress"], details["noise_damage"], details["batch_loss"]
    assert damage > progress > 0 and details["clip_rule"] == "median"
    assert loss == pytest.approx(_loss_after(model, x, y, torch.zeros_like(g), 0.3), rel=1e-9)
    assert out.gradient is None and not out.report.met
    assert (f"the floor needs noise that would undo training: it would add {damage:.3g} to the batch loss of "
            f"{loss:.3g}, against the {progress:.3g} the step removes (at C = {details['clip']:.4g}: more than the "
            "steps' progress over the recent steps") in out.report.reason
    assert "for the next steps C lowered to 0.5× the median" in out.report.reason
    assert "(update dropped)" in out.report.reason
    assert guard._adaptive_clip.recent_effect is None and guard._adaptive_clip.recent_move is None
    assert guard._adaptive_clip.factor == 0.5
    monkeypatch.setattr(clipping, "WITHHOLD_LOSS_SHARE", 0.0)  # where the step gains more than its noise costs
    small = Guard(_config()).protect(model, x, y, g, step_size=STEP)
    assert small.report.details["noise_damage"] < small.report.details["step_progress"] and small.gradient is not None


def test_the_median_factor_written_out():
    """``AdaptiveClip.adjust`` on the averages as recorded: halved over CLIP_LOWER_DAMAGE × P̄ (at once when withheld),
    kept CLIP_FACTOR_HOLD steps after a change, averages started afresh; never raised again."""
    assert (clipping.CLIP_LOWER_DAMAGE, CLIP_LOWEST_FACTOR) == (0.5, 1 / 16)
    rule = AdaptiveClip()
    rule.record(0.01, (0.10, 0.0499, 1.0))
    assert rule.adjust((0.10, 0.0499, 1.0)) == "" and rule.factor == 1.0  # D̄ = 0.499 P̄: kept
    rule.record(0.01, (0.10, 0.0509, 1.0))  # D̄ = 0.0499 + (0.0509 − 0.0499)/8 = 0.050025 > 0.5 P̄
    why = rule.adjust((0.10, 0.0509, 1.0))
    assert rule.factor == 0.5 and why.startswith("C lowered to 0.5× the median: the noise adds 0.05 ")
    assert rule.recent_effect is None and rule.setting(1e-3) == "median"
    for _ in range(CLIP_FACTOR_HOLD):  # kept, however harmful the averages
        rule.record(0.01, (0.10, 1.0, 1.0))
        assert rule.adjust((0.10, 1.0, 1.0)) == "" and rule.factor == 0.5
    rule.record(0.01, (0.10, 1.0, 1.0))
    assert rule.adjust((0.10, 1.0, 1.0)) and rule.factor == 0.25
    for factor in (0.125, 1 / 16, 1 / 16):  # a withheld step lowers it at once, down to CLIP_LOWEST_FACTOR
        rule.adjust((0.10, 1.0, 1.0), withheld=True)
        assert rule.factor == factor and rule.recent_effect is None
    # at the median or under it undoing the progress withholds, whatever the share of the loss
    assert rule.ruinous((0.10, 0.1001, 1.0), at_median=True) and not rule.ruinous((0.10, 0.0999, 1.0), at_median=True)
    assert not rule.ruinous((0.10, 0.1001, 1.0))
    rule.record(0.01, (0.10, 0.2, 1.0))
    rule.adjust((0.10, 0.3, 1.0), withheld=True)  # withheld there: the next step is judged on its own
    assert rule.factor == 1 / 16 and rule.recent_effect is None
    rule._hold = 0
    rule.record(0.01, (0.10, -1.0, 1.0))  # noise that helps: the factor stays
    assert rule.adjust((0.10, -1.0, 1.0)) == "" and rule.factor == 1 / 16 and rule.setting(1e-3) == "median"


def test_the_median_lowered_where_its_noise_harms(problem):
    """At a step size where the median's noise undoes the step, each withheld step halves C for the next, until a
    level sends — D/P falls with C — its noise against the dense upload at that C, its progress and damage against SGD
    steps on copies of the model."""
    model, x, y, per = problem
    g = per.mean(0)
    median = float(per.norm(dim=1).sort().values[3])  # the lower median of 8
    guard, factor = Guard(_config()), 1.0
    for _ in range(5):
        step = guard.protect(model, x, y, g, step_size=0.3)
        assert step.report.details["clip"] == pytest.approx(factor * median, rel=1e-6)
        if step.gradient is not None:
            break
        factor = max(factor / 2, CLIP_LOWEST_FACTOR)
        assert guard._adaptive_clip.factor == factor
    details = step.report.details
    assert step.gradient is not None and factor < 1 and details["clip_factor"] == factor
    assert details["noise_damage"] <= details["step_progress"]
    upload = _upload(per, factor * median)
    torch.testing.assert_close(step.report.noise_norm, float((step.gradient - upload).norm()))
    reference = _reference_effect(model, x, y, upload, step.gradient - upload, 0.3)
    assert details["step_progress"] == pytest.approx(reference[0], rel=1e-6)
    assert details["noise_damage"] == pytest.approx(reference[1], rel=1e-6)
