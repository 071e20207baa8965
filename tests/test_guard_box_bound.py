"""The box certificate (``flguard.guard.box_bound``): a lower bound on the clipped recovery error over
every exact shift within the solver's error radius — never above the true minimum, and tighter than
clip's 1-Lipschitz bound where pixels saturate."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from flguard.guard.box_bound import BoxProfile, clipped_error_bound, least_scales
from flguard.guard.floor import box_scale
from flguard.risk.closed_forms import to_rmse


def _clipped(x: torch.Tensor, shift: torch.Tensor, scale: float) -> torch.Tensor:
    return (torch.clamp(x + scale * shift, 0.0, 1.0) - x).norm(dim=1)


def test_without_saturation_the_bound_is_the_1_lipschitz_one_exactly():
    torch.manual_seed(0)
    shift = torch.randn(5, 40, dtype=torch.float64)
    radius = torch.tensor([0.0, 0.3, 1.0, 2.5, 100.0], dtype=torch.float64)
    x, wide = torch.zeros(5, 40, dtype=torch.float64), torch.tensor(1e6, dtype=torch.float64)  # nothing saturates
    bound = clipped_error_bound(x, shift, -wide, wide, 1.0, radius)
    expected = (shift.norm(dim=1) - radius).clamp_min(0.0)  # attained: d = −R·e/‖e‖ while R ≤ ‖e‖
    assert torch.allclose(bound, expected, atol=1e-12, rtol=0)


def test_the_bound_never_exceeds_the_true_minimum_on_a_dense_grid_of_perturbations():
    """Three pixels, partly saturated: the minimum of the clipped error over a dense grid of the
    ball ‖d‖ ≤ R (≥ the true minimum) is never below the bound, and the bound beats r̃ − R."""
    torch.manual_seed(1)
    steps = torch.linspace(-1.0, 1.0, 41, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(steps, steps, steps, indexing="ij"), dim=-1).reshape(-1, 3)
    grid = grid[grid.norm(dim=1) <= 1.0]
    gains = []
    for trial in range(12):
        x = torch.rand(1, 3, dtype=torch.float64)
        shift = torch.randn(1, 3, dtype=torch.float64) * 1.5
        radius = torch.rand(1, dtype=torch.float64) * 1.2
        bound = float(clipped_error_bound(x, shift, torch.zeros(1), torch.ones(1), 1.0, radius))
        reached = (torch.clamp(x + shift + radius * grid, 0.0, 1.0) - x).norm(dim=1).min()
        assert bound <= float(reached) + 1e-9, trial
        lipschitz = max(float(_clipped(x, shift, 1.0)) - float(radius), 0.0)
        assert bound >= lipschitz - 1e-12, trial
        gains.append(bound - lipschitz)
    assert max(gains) > 0.1  # saturation is used, not only the 1-Lipschitz bound


def test_a_deeply_saturated_pixel_keeps_most_of_its_error():
    """One pixel 2 beyond the box, error 1, radius 1: no perturbation within the radius reaches the
    box (true minimum 1); the 1-Lipschitz bound gives 0, the dual max_w min(1, 9w) − w/(1 − w) = 7/8."""
    x, shift = torch.zeros(1, 1, dtype=torch.float64), torch.tensor([[3.0]], dtype=torch.float64)  # box [0, 1]
    bound = clipped_error_bound(x, shift, torch.zeros(1), torch.ones(1), 1.0, torch.tensor([1.0], dtype=torch.float64))
    assert math.isclose(float(bound), math.sqrt(7 / 8), rel_tol=1e-12)


def test_box_scale_certifies_the_exact_shift_for_any_error_within_the_slack():
    """The fitted scale meets τ for the exact shift Δ while box_scale only saw Δ̃ = Δ + e with ‖e‖ = η,
    e chosen against it (pushing Δ̃ further out of the box, which inflates the clipped error)."""
    torch.manual_seed(2)
    for trial, (batch, dx) in enumerate(itertools.product((1, 4), (16, 64))):
        x = torch.rand(batch, dx, dtype=torch.float64)
        exact = torch.randn(batch, dx, dtype=torch.float64)
        away = torch.where(x + exact > 0.5, torch.ones_like(x), -torch.ones_like(x))  # further from the box's middle
        slack = 0.3 * exact.norm(dim=1)
        solved = exact + away / away.norm(dim=1, keepdim=True) * slack.unsqueeze(1)
        tau = 0.2
        scale, rmse, reachable = box_scale(x, solved, torch.zeros(1), torch.ones(1), tau, 1e-2, 1e-3, 1e3, slack)
        assert reachable, trial
        exact_rmse = _clipped(x, exact, scale) / math.sqrt(dx)
        assert bool((exact_rmse >= tau).all()), (trial, exact_rmse.min())
        assert bool((rmse >= exact_rmse - 1e-12).all())  # what is reported is the solved (inflated) value


def test_certifies_decides_as_the_bound_does_with_its_shortcuts():
    """``certifies`` skips the dual where r̃ − R or r̃ settles the question: the same answers as
    comparing ``clipped_error_bound``'s RMSE with the target, at targets below, between and above."""
    from flguard.guard.box_bound import certifies

    torch.manual_seed(3)
    x = torch.rand(6, 1, 5, 5, dtype=torch.float64)
    shift = torch.randn(6, 25, dtype=torch.float64) * torch.tensor([0.2, 1.0, 3.0, 10.0, 30.0, 100.0],
                                                                     dtype=torch.float64).unsqueeze(1)
    radius = 0.2 * shift.norm(dim=1)
    low, high = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    decided = 0
    for scale in (0.01, 0.1, 1.0):
        rmse = clipped_error_bound(x, shift, low, high, scale, radius) / 5.0
        for target in torch.linspace(0.0, 0.6, 25).tolist():
            expected = rmse >= target
            assert torch.equal(certifies(x, shift, low, high, scale, radius, target), expected), (scale, target)
            decided += int(expected.sum())
    assert 0 < decided < 3 * 25 * 6


def test_least_scales_is_each_samples_least_reaching_scale_on_a_dense_grid():
    """``least_scales`` (the guard's early-stop aim, solved exactly per segment) against a dense scan of scales: the
    clipped RMSE reaches the target a millionth above the returned scale and not a millionth below it, which lies
    between the scan's last scale short of it and its first one there; +inf where the limit cannot reach it or the
    box caps the error below the target; the linear scale where the box never binds."""
    torch.manual_seed(3)
    x = torch.rand(6, 50, dtype=torch.float64)
    shift = torch.randn(6, 50, dtype=torch.float64)
    shift[4] *= 1e-4  # needs more than the limit
    shift[2, :10] = 0.0  # still pixels: they never err
    low, high = torch.zeros(1, 50, dtype=torch.float64), torch.ones(1, 50, dtype=torch.float64)
    target, limit = 0.35, 50.0
    least = least_scales(x, shift, low, high, target, limit)
    rmse = lambda scale, i: float(_clipped(x[i:i + 1], shift[i:i + 1], scale)[0]) / math.sqrt(50)
    assert math.isinf(float(least[4]))
    grid = torch.logspace(-3, math.log10(limit), 4000, dtype=torch.float64).tolist()
    for i in (0, 1, 2, 3, 5):
        s = float(least[i])
        assert rmse(s * (1 + 1e-6), i) >= target > rmse(s / (1 + 1e-6), i), (i, s)
        first = next(k for k, c in enumerate(grid) if rmse(c, i) >= target)
        assert grid[first - 1] < s <= grid[first], (i, s)
    capped = least_scales(x, shift, low, high, 0.8, 1e9)  # no pixel can err by more than its room in the box
    most = torch.where(shift > 0, 1 - x, torch.where(shift < 0, x, 0.0)).norm(dim=1) / math.sqrt(50)
    assert torch.equal(torch.isinf(capped), most < 0.8) and bool((most < 0.8).any())
    wide = least_scales(x, shift, low - 1e6, high + 1e6, target, limit)
    linear = target * math.sqrt(50) / shift.norm(dim=1)
    torch.testing.assert_close(wide[[0, 1, 2, 3, 5]], linear[[0, 1, 2, 3, 5]], rtol=1e-14, atol=0)


def _dual_on_a_grid(x: torch.Tensor, shift: torch.Tensor, scale: float, radius: torch.Tensor) -> torch.Tensor:
    """max over a dense grid of w of F(w) = Σ_p min(e_p², w(|e_p| + s_p)²) − R²w/(1 − w) (the module's dual),
    written from its definition: per-pixel errors and overshoots of clip(x + scale·shift) in the box [0, 1]."""
    moved = x + scale * shift
    inside = moved.clamp(0.0, 1.0)
    e2, k = (inside - x).square(), ((inside - x).abs() + (moved - inside).abs()).square()
    w = torch.linspace(0.0, 1.0, 200_001, dtype=torch.float64)[:-1].unsqueeze(1)  # [W, 1]
    r2 = (scale * radius).square()
    return torch.stack([(torch.minimum(e2[i], w * k[i]).sum(dim=1) - r2[i] * w[:, 0] / (1 - w[:, 0])).max()
                        for i in range(x.shape[0])]).clamp_min(0.0).sqrt()


def test_the_profile_maximises_the_dual_at_every_scale_from_one_sort():
    """``BoxProfile`` (one sort of the saturation scales t_p per sample) gives, at scales below, across and above
    the pixels' saturation, the dual's maximum that a dense scan of w written from F's definition finds — never
    above it beyond rounding, and within the scan's resolution below it; its rows and replaced rows agree."""
    torch.manual_seed(4)
    x = torch.rand(5, 30, dtype=torch.float64)
    x[:, :3] = 0.0  # on the box's side: an outward pixel never errs, an inward one saturates late
    shift = torch.randn(5, 30, dtype=torch.float64) * torch.tensor([0.1, 0.5, 1.0, 3.0, 10.0],
                                                                  dtype=torch.float64).unsqueeze(1)
    shift[1, 5:9] = 0.0  # still pixels
    radius = 0.1 * shift.norm(dim=1) * torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5], dtype=torch.float64)
    profile = BoxProfile(x, shift, torch.zeros(1), torch.ones(1))
    for scale in (0.05, 0.3, 1.0, 4.0):
        bound = profile.certified_norms(scale, radius)
        scanned = _dual_on_a_grid(x, shift, scale, radius)
        assert bool((bound.square() >= scanned.square() - 1e-12).all()), scale
        assert torch.allclose(bound, scanned, rtol=2e-3, atol=1e-9), (scale, bound, scanned)
        torch.testing.assert_close(profile.rows(torch.tensor([3, 1])).certified_norms(scale, radius[[3, 1]]),
                                   bound[[3, 1]], rtol=0, atol=0)
    assert torch.equal(profile.certified_norms(0.0, radius), torch.zeros(5, dtype=torch.float64))  # no noise, no error
    # several scales in one pass (the solver's early stop asks two): each row the bound at that scale alone
    scales = (0.05, 0.0, 4.0, 1.0)
    torch.testing.assert_close(profile.certified_norms(scales, radius),
                               torch.stack([profile.certified_norms(c, radius) for c in scales]), rtol=1e-15, atol=0)
    target = float(to_rmse(profile.certified_norms(1.0, radius), 30).median())
    assert torch.equal(profile.certifies(scales, radius, target),
                       torch.stack([profile.certifies(c, radius, target) for c in scales]))
    other = BoxProfile(x[[2]], -shift[[2]], torch.zeros(1), torch.ones(1))
    profile.replace(torch.tensor([0]), other)
    replaced = radius.clone()
    replaced[0] = radius[2]
    torch.testing.assert_close(profile.certified_norms(0.7, replaced)[:1], other.certified_norms(0.7, radius[[2]]),
                               rtol=0, atol=0)


def test_tied_saturation_scales_give_the_same_profile_in_any_order(monkeypatch):
    """Pixels that saturate at the same scale (an image's flat background moved alike, as on MNIST) may come out of
    the sort in any order (NumPy's on a CPU, ``torch.sort`` elsewhere): the profile's bound and least scales are the
    same function — against the dual scanned from its definition, and against the profile sorted with the ties
    reversed."""
    from flguard.guard import box_bound

    torch.manual_seed(6)
    x = torch.rand(4, 40, dtype=torch.float64)
    x[:, :24] = 0.25  # one background value, moved alike in blocks: tied t_p = d_p/|Δ_p|
    shift = torch.randn(4, 40, dtype=torch.float64)
    shift[:, :12], shift[:, 12:24] = 0.5, -0.2
    radius = 0.05 * shift.norm(dim=1)
    profile = BoxProfile(x, shift, torch.zeros(1), torch.ones(1))
    assert int((profile.saturates[:, 1:] == profile.saturates[:, :-1]).sum()) >= 4 * 20  # the ties are there

    def reversed_ties(values):  # ascending, ties in descending index order
        index = torch.arange(values.shape[1], dtype=values.dtype).expand_as(values)
        order = torch.from_numpy(np.lexsort((-index.numpy(), values.numpy()), axis=1))
        return values.gather(1, order), order
    monkeypatch.setattr(box_bound, "_sorted_rows", reversed_ties)
    other = BoxProfile(x, shift, torch.zeros(1), torch.ones(1))
    for scale in (0.3, 0.75, 2.0):
        bound = profile.certified_norms(scale, radius)
        torch.testing.assert_close(other.certified_norms(scale, radius), bound, rtol=1e-13, atol=0)
        scanned = _dual_on_a_grid(x, shift, scale, radius)
        assert bool((bound.square() >= scanned.square() - 1e-12).all()), scale
        assert torch.allclose(bound, scanned, rtol=2e-3, atol=1e-9), (scale, bound, scanned)
    torch.testing.assert_close(other.least_scales(0.3, 50.0), profile.least_scales(0.3, 50.0), rtol=1e-13, atol=0)
