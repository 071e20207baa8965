"""The guard's promise, recomputed with dense float64 Jacobians; eigen vs Gaussian; fail-closed."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from flguard import Guard, GuardConfig
from flguard.config import ConfigError
from risk_reference import dense_jacobians, assert_reported_rmse
from guard_settings import unclipped

TAU = 0.05


def _problem(batch: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)).double()
    x = torch.randn(batch, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (batch,))
    jac, g = dense_jacobians(model, x, y)
    return model, x, y, jac, g


def _dense_rmse(jac: torch.Tensor, delta: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    kernel = jac @ jac.transpose(1, 2)
    eye = torch.eye(jac.shape[1], dtype=jac.dtype)
    solution = torch.linalg.solve(kernel + eps.view(-1, 1, 1) * eye, (jac @ delta).unsqueeze(-1)).squeeze(-1)
    return solution.norm(dim=1) / jac.shape[1] ** 0.5


@pytest.mark.parametrize("defense", ["gaussian", "rowspace", "resolvent", "eigen"])
@pytest.mark.parametrize("batch", [1, 3])
def test_promise_holds_under_dense_recomputation(defense, batch):
    model, x, y, jac, g = _problem(batch)
    out = Guard(unclipped(defense=defense, min_rmse=TAU, seed=3)).protect(model, x, y, g)
    assert out.report.met and out.gradient is not None
    delta = out.gradient - g
    lam_max = torch.linalg.eigvalsh(jac @ jac.transpose(1, 2))[:, -1]
    torch.testing.assert_close(out.report.eps, 1e-2 * lam_max, rtol=1e-3, atol=0)
    dense = _dense_rmse(jac, delta, out.report.eps)
    assert torch.all(dense >= TAU), dense
    assert_reported_rmse(out.report, dense, rtol=2e-3)
    torch.testing.assert_close(torch.tensor(out.report.noise_norm, dtype=torch.float64), delta.norm())
    # "just enough": the tightest sample sits on the floor (within the verification margin)
    assert float(dense.min()) <= TAU * 1.01


@pytest.mark.parametrize("batch", [1, 3])
def test_eigen_needs_less_noise_than_gaussian_and_nears_the_single_direction_limit(batch):
    model, x, y, jac, g = _problem(batch)
    ratios = []
    for seed in range(3):
        gauss = Guard(unclipped(defense="gaussian", min_rmse=TAU, seed=seed)).protect(model, x, y, g).report
        eigen = Guard(unclipped(defense="eigen", min_rmse=TAU, seed=seed)).protect(model, x, y, g).report
        ratios.append(eigen.noise_norm / gauss.noise_norm)
    ratio = sum(ratios) / len(ratios)
    lam = torch.linalg.eigvalsh(jac @ jac.transpose(1, 2))
    lam = lam.clamp_min(0)
    gain = lam.sqrt() / (lam + 1e-2 * lam[:, -1:])  # √λ/(λ+ε), written out (not the code under test)
    # Single best direction vs isotropic noise at equal I2F, for the hardest sample.
    limit = float((gain.pow(2).sum(1).sqrt() / (gain.max(1).values * jac.shape[2] ** 0.5)).max())
    assert ratio < 0.6, ratio
    assert ratio <= 3.0 * limit * batch**0.5, (ratio, limit)


def test_the_default_aimed_noise_of_auto_is_resolvent():
    assert unclipped(defense="auto").fallback == "resolvent"


@pytest.mark.parametrize("fallback", ["resolvent", "eigen"])
def test_auto_sends_the_gaussian_within_budget_and_aimed_noise_beyond_it(fallback):
    """``auto``: with a budget the calibrated Gaussian fits, the Gaussian's exact update; with one between
    the aimed noise's need and the Gaussian's, the aimed noise (``fallback``), meeting the floor under dense
    recomputation."""
    model, x, y, jac, g = _problem(3)
    gauss = Guard(unclipped(defense="gaussian", min_rmse=TAU, seed=3)).protect(model, x, y, g)
    wide = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3, fallback=fallback)).protect(model, x, y, g)
    assert wide.report.met and wide.report.details["defense_used"] == "gaussian"
    torch.testing.assert_close(wide.gradient, gauss.gradient)  # the same draw from the same seeded stream
    aimed = Guard(unclipped(defense=fallback, min_rmse=TAU, seed=3)).protect(model, x, y, g).report
    assert aimed.rel_noise < 0.6 * gauss.report.rel_noise
    budget = (aimed.rel_noise * gauss.report.rel_noise) ** 0.5  # between the two needs
    out = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3, max_rel_noise=budget, fallback=fallback)).protect(
        model, x, y, g)
    assert out.report.met and out.report.details["defense_used"] == fallback and out.report.defense == "auto"
    delta = out.gradient - g
    assert float(delta.norm()) <= budget * float(g.norm())
    assert torch.all(_dense_rmse(jac, delta, out.report.eps) >= TAU)
    tight = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3, max_rel_noise=0.3 * aimed.rel_noise,
                            fallback=fallback)).protect(model, x, y, g)
    assert tight.gradient is None and "gaussian: " in tight.report.reason and f"{fallback}: " in tight.report.reason


@pytest.mark.parametrize("fallback", ["resolvent", "eigen"])
def test_auto_goes_straight_to_aimed_noise_after_the_gaussian_needed_far_more_than_the_budget(monkeypatch, fallback):
    """The next AUTO_SKIP_STEPS steps skip the Gaussian (fewer products, the same floor verified), then
    it is tried again."""
    import flguard.guard.perturb as perturb_module

    monkeypatch.setattr(perturb_module, "AUTO_SKIP_FACTOR", 1.0)
    monkeypatch.setattr(perturb_module, "AUTO_SKIP_STEPS", 1)
    model, x, y, jac, g = _problem(3)
    gauss = Guard(unclipped(defense="gaussian", min_rmse=TAU, seed=3)).protect(model, x, y, g).report
    aimed = Guard(unclipped(defense=fallback, min_rmse=TAU, seed=3)).protect(model, x, y, g).report
    guard = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3, fallback=fallback,
                            max_rel_noise=(aimed.rel_noise * gauss.rel_noise) ** 0.5))
    first, second, third = (guard.protect(model, x, y, g) for _ in range(3))
    for out in (first, second, third):
        assert out.report.met and out.report.details["defense_used"] == fallback
        assert torch.all(_dense_rmse(jac, out.gradient - g, out.report.eps) >= TAU)
    # the second step skips the Gaussian's run, the third tries it again (the aimed solve's products vary with
    # resolvent's draw, so the third is compared by what it tried, not by an equal count)
    assert second.report.matvecs < first.report.matvecs and second.report.matvecs < third.report.matvecs
    assert "gaussian: tried last" in second.report.details["auto_reasons"]
    for out in (first, third):
        assert "tried last" not in out.report.details["auto_reasons"] and "gaussian: " in out.report.details["auto_reasons"]
    if fallback == "eigen":  # eigen's run is the same length every step
        assert third.report.matvecs == first.report.matvecs


def _theta_norm(model: nn.Module) -> float:
    return float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).norm())


def test_auto_sends_aimed_noise_where_the_gaussian_would_move_the_parameters_too_far():
    """With a step size, ``auto`` sends the Gaussian only while step_size·‖noise‖ ≤ AUTO_MAX_MOVE·‖θ‖ (on a
    guard's first step the root mean square is this step's move): at half
    the step size that reaches the limit with the same seeded draw, the Gaussian's exact update; at twice it,
    the aimed noise (the default fallback), meeting the floor under dense recomputation, and the report says why."""
    from flguard.guard.perturb import AUTO_MAX_MOVE

    model, x, y, jac, g = _problem(3)
    gauss = Guard(unclipped(defense="gaussian", min_rmse=TAU, seed=3)).protect(model, x, y, g)
    at_limit = AUTO_MAX_MOVE * _theta_norm(model) / gauss.report.noise_norm  # the step size at which it moves θ by the limit
    near = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3)).protect(model, x, y, g, step_size=0.5 * at_limit)
    assert near.report.met and near.report.details["defense_used"] == "gaussian"
    torch.testing.assert_close(near.gradient, gauss.gradient)
    far = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3)).protect(model, x, y, g, step_size=2.0 * at_limit)
    assert far.report.met and far.report.details["defense_used"] == "resolvent"
    assert "would move the parameters by 20.0% of their norm, 20.0% root mean square" in far.report.details["auto_reasons"]
    assert far.report.noise_norm < gauss.report.noise_norm
    assert torch.all(_dense_rmse(jac, far.gradient - g, far.report.eps) >= TAU)


def test_auto_averages_the_gaussians_moves_in_square_over_recent_steps():
    """One large move among small ones does not switch ``auto`` to its aimed noise; a run of them does. The exponential
    average m̄² ← m̄² + (m² − m̄²)/AUTO_MOVE_STEPS, written out for 2%, 2%, 24%, 24% at AUTO_MAX_MOVE 10%."""
    from flguard.guard.perturb import AUTO_MAX_MOVE, AUTO_MOVE_STEPS, Perturber

    assert (AUTO_MAX_MOVE, AUTO_MOVE_STEPS) == (0.10, 8)
    perturber = Perturber(unclipped(defense="auto"))
    assert perturber._moved_too_far(1.0, None) is False and perturber._move_square is None  # no step size
    decisions, square = [], None
    for move in (0.02, 0.02, 0.24, 0.24):
        decisions.append(perturber._moved_too_far(move / 0.5, 0.5))  # ‖noise‖ = move / (step size ÷ ‖θ‖)
        square = move**2 if square is None else square + (move**2 - square) / 8
        assert perturber._move_square == pytest.approx(square, rel=1e-12)
    assert decisions == [False, False, False, True]  # √m̄²: 2%, 2%, 8.7%, 11.7%


def test_auto_falls_back_on_the_gaussian_it_moved_too_far_when_the_aimed_noise_cannot_meet_the_floor(monkeypatch):
    """The move limit chooses between certified noises; it never withholds a step the Gaussian certified.
    The next steps try the aimed noise first (AUTO_SKIP_STEPS), then the Gaussian again."""
    import flguard.guard.perturb as perturb_module
    from flguard.defenses import DIRECTIONS

    def failing(ctx):
        raise RuntimeError("the aimed noise failed here")

    monkeypatch.setitem(DIRECTIONS, "resolvent", failing)
    model, x, y, jac, g = _problem(3)
    guard = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3))
    first, second = (guard.protect(model, x, y, g, step_size=1e6) for _ in range(2))
    for out in (first, second):
        assert out.report.met and out.report.details["defense_used"] == "gaussian"
        assert torch.all(_dense_rmse(jac, out.gradient - g, out.report.eps) >= TAU)
        assert "resolvent: RuntimeError: the aimed noise failed here" in out.report.details["auto_reasons"]
    assert "gaussian: its noise would move" in first.report.details["auto_reasons"]
    assert "gaussian: tried last" in second.report.details["auto_reasons"]
    assert guard._perturber._skip_first == perturb_module.AUTO_SKIP_STEPS  # the second step saw it again


def test_auto_does_not_compute_the_gaussian_where_no_move_could_bring_its_average_under_the_limit(monkeypatch):
    """Where even a zero move would leave the Gaussian's root mean square move over the limit, ``auto`` sends the aimed
    noise without computing the Gaussian — its average then decays as for a zero move, the next steps try the aimed
    noise first as after a far move — and where the aimed noise fails, computes the Gaussian after all and sends it,
    its own move averaged."""
    import flguard.guard.perturb as perturb_module
    from flguard.defenses import DIRECTIONS

    computed = []
    one_run = perturb_module.Perturber._in_one_run

    def counted(self, kind, *args):
        computed.append(kind)
        return one_run(self, kind, *args)

    monkeypatch.setattr(perturb_module.Perturber, "_in_one_run", counted)
    model, x, y, jac, g = _problem(3)
    guard = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3))
    guard._perturber._move_square = 0.2**2  # 18.7% after a zero move: over AUTO_MAX_MOVE (10%)
    out = guard.protect(model, x, y, g, step_size=1e-6)
    assert out.report.met and out.report.details["defense_used"] == "resolvent" and computed == []
    assert ("gaussian: tried last (its moves' root mean square over the recent steps stays over 10% whatever this "
            "step's move: 20.0% before it)") in out.report.details["auto_reasons"]
    assert guard._perturber._move_square == pytest.approx(0.04 * 7 / 8, rel=1e-12)
    assert guard._perturber._skip_first == perturb_module.AUTO_SKIP_STEPS
    assert torch.all(_dense_rmse(jac, out.gradient - g, out.report.eps) >= TAU)
    # at 10.6%, a zero move would bring the average to 9.9%: computed first, and sent (its move is a millionth)
    near = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3))
    near._perturber._move_square = 0.106**2
    assert near.protect(model, x, y, g, step_size=1e-6).report.details["defense_used"] == "gaussian"
    assert computed == ["gaussian"]

    def failing(ctx):
        raise RuntimeError("the aimed noise failed here")

    monkeypatch.setitem(DIRECTIONS, "resolvent", failing)
    guard = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3))
    guard._perturber._move_square = 0.2**2
    out = guard.protect(model, x, y, g, step_size=1e-6)
    assert out.report.met and out.report.details["defense_used"] == "gaussian" and computed == ["gaussian"] * 2
    assert "resolvent: RuntimeError: the aimed noise failed here" in out.report.details["auto_reasons"]
    assert "gaussian: its noise would move" in out.report.details["auto_reasons"]
    move = 1e-6 * out.report.noise_norm / _theta_norm(model)
    assert guard._perturber._move_square == pytest.approx(0.04 + (move**2 - 0.04) / 8, rel=1e-9)
    assert torch.all(_dense_rmse(jac, out.gradient - g, out.report.eps) >= TAU)


@pytest.mark.parametrize("budget", [0.0035, 0.005, 0.01])
def test_auto_abandons_part_way_a_gaussian_that_cannot_meet_the_budget(monkeypatch, budget):
    """Here the Gaussian needs noise 0.0085·‖g‖ and resolvent noise 0.0028·‖g‖. At a budget of 0.0035·‖g‖ or
    0.005·‖g‖ ``auto`` abandons the Gaussian's solve part-way (``ABANDON_HOPELESS``): the same noise is sent as when
    it is solved to the end, for fewer products, and meets the floor under dense recomputation; the next steps try
    the aimed noise first (a finished solve does so only over twice the budget). At 0.01 the Gaussian is sent."""
    import re
    import flguard.guard.perturb as perturb_module

    model, x, y, jac, g = _problem(3)
    runs = {}
    for abandon in (False, True):
        monkeypatch.setattr(perturb_module, "ABANDON_HOPELESS", abandon)
        guard = Guard(unclipped(defense="auto", min_rmse=TAU, seed=3, max_rel_noise=budget))
        runs[abandon] = guard.protect(model, x, y, g), guard._perturber._skip_first
    (whole, skip_whole), (cut, skip_cut) = runs[False], runs[True]
    torch.testing.assert_close(cut.gradient, whole.gradient)  # the same draws, the same noise sent
    assert cut.report.met and torch.all(_dense_rmse(jac, cut.gradient - g, cut.report.eps) >= TAU)
    if budget == 0.01:
        assert cut.report.details["defense_used"] == "gaussian" and cut.report.matvecs == whole.report.matvecs
        return
    needed = float(re.search(r"gaussian: the floor τ=\S+ needs noise \S+ = (\S+)× the gradient norm",
                             whole.report.details["auto_reasons"]).group(1))
    assert needed == pytest.approx(0.0085, rel=0.01)
    assert cut.report.details["defense_used"] == whole.report.details["defense_used"] == "resolvent"
    short = 3 if budget == 0.0035 else 2  # at 1.7× the budget the first to show it is short of it
    assert (f"gaussian: the floor τ=0.05 needs more noise than the budget max_rel_noise={budget}: there {short} of 3 "
            "samples stay below it whatever their solves' remaining error (its solve abandoned part-way)"
            ) in cut.report.details["auto_reasons"]
    assert skip_cut == perturb_module.AUTO_SKIP_STEPS
    assert skip_whole == (perturb_module.AUTO_SKIP_STEPS if needed > 2 * budget else 0)
    assert cut.report.matvecs < whole.report.matvecs - 20


@pytest.mark.parametrize("budget", [0.0035, 0.005, 0.01])
def test_auto_abandons_the_gaussian_as_it_would_end_in_the_pixel_box_and_with_samples_left_out(monkeypatch, budget):
    """The abandon's bound through the box (``input_bounds``: the certified error is clipped) and with one sample of
    three allowed out (``max_excluded``): with or without ``ABANDON_HOPELESS`` the same kind is sent, the same noise,
    meeting the floor under dense recomputation, and never more products with it."""
    import flguard.guard.perturb as perturb_module

    model, x, y, jac, g = _problem(3)
    runs = {}
    for abandon in (False, True):
        monkeypatch.setattr(perturb_module, "ABANDON_HOPELESS", abandon)
        config = unclipped(defense="auto", min_rmse=TAU, seed=3, max_rel_noise=budget, input_bounds="batch",
                           max_excluded=0.34)
        runs[abandon] = Guard(config).protect(model, x, y, g)
    whole, cut = runs[False], runs[True]
    assert cut.report.met == whole.report.met
    assert cut.report.details["defense_used"] == whole.report.details["defense_used"]
    torch.testing.assert_close(cut.gradient, whole.gradient)
    assert cut.report.matvecs <= whole.report.matvecs
    kept = torch.isfinite(cut.report.rmse_after)
    assert torch.all(_dense_rmse(jac, cut.gradient - g, cut.report.eps)[kept] >= TAU)
    abandoned = "abandoned part-way" in cut.report.details.get("auto_reasons", "")
    assert abandoned == (budget < 0.01) and (cut.report.matvecs < whole.report.matvecs) == abandoned


def test_seeds_reproduce_and_os_entropy_differs():
    model, x, y, _, g = _problem(2)
    first = Guard(unclipped(defense="eigen", seed=7)).protect(model, x, y, g).gradient
    again = Guard(unclipped(defense="eigen", seed=7)).protect(model, x, y, g).gradient
    torch.testing.assert_close(first, again)
    a = Guard(unclipped(defense="gaussian")).protect(model, x, y, g).gradient
    b = Guard(unclipped(defense="gaussian")).protect(model, x, y, g).gradient
    assert not torch.allclose(a, b)
    # one guard, two updates: a seeded guard still draws fresh noise for every update
    guard = Guard(unclipped(defense="gaussian", seed=7))
    first_step, second_step = (guard.protect(model, x, y, g).gradient - g for _ in range(2))
    assert not torch.allclose(first_step / first_step.norm(), second_step / second_step.norm())


def test_nan_gradient_is_dropped_under_every_policy():
    model, x, y, _, g = _problem(2)
    bad = g.clone()
    bad[0] = float("nan")
    for policy, extra in (("drop", {}), ("max-noise", {}), ("send", {"acknowledge_unguarded": True})):
        out = Guard(unclipped(defense="gaussian", on_unmet=policy, **extra)).protect(model, x, y, bad)
        assert out.gradient is None and not out.report.met and "NaN" in out.report.reason


def test_solver_failure_fails_closed(monkeypatch):
    from flguard.risk.regularised import RegularisedK

    real = RegularisedK.lanczos

    def not_converging(self, **kwargs):
        result = real(self, **kwargs)
        result.converged = torch.zeros_like(result.converged)
        return result

    monkeypatch.setattr(RegularisedK, "lanczos", not_converging)
    model, x, y, _, g = _problem(2)
    out = Guard(unclipped(defense="eigen")).protect(model, x, y, g)
    assert out.gradient is None and not out.report.met and "converge" in out.report.reason


def test_exception_while_measuring_fails_closed():
    model, x, y, _, g = _problem(2)

    def broken_loss(logits, labels):
        raise RuntimeError("loss exploded")

    out = Guard(unclipped(defense="gaussian")).protect(model, x, y, g, loss_fn=broken_loss)
    assert out.gradient is None and "loss exploded" in out.report.reason


def test_unreachable_floor_within_budget():
    model, x, y, _, g = _problem(2)
    cfg = dict(defense="gaussian", min_rmse=TAU, max_rel_noise=1e-4, seed=0)
    dropped = Guard(unclipped(**cfg)).protect(model, x, y, g)
    assert dropped.gradient is None and "budget" in dropped.report.reason
    maxed = Guard(unclipped(**cfg, on_unmet="max-noise")).protect(model, x, y, g)
    assert maxed.gradient is not None and not maxed.report.met
    torch.testing.assert_close((maxed.gradient - g).norm(), 1e-4 * g.norm())
    sent = Guard(unclipped(**cfg, on_unmet="send", acknowledge_unguarded=True)).protect(model, x, y, g)
    assert torch.equal(sent.gradient, g) and not sent.report.met


def test_send_without_acknowledgement_is_a_config_error():
    with pytest.raises(ConfigError, match="acknowledge_unguarded"):
        unclipped(on_unmet="send")
    with pytest.raises(ConfigError, match="GuardConfig.defense"):
        unclipped(defense="eigne")


def test_baselines_report_their_measured_protection():
    model, x, y, jac, g = _problem(2)
    own = {"fixed-gaussian": {"sigma": 1e-3}, "localdp": {"clipping_norm": 1.0, "sensitivity": 1.0, "epsilon": 1.0}}
    for defense in ("fixed-gaussian", "pruning", "localdp", "none"):
        out = Guard(unclipped(defense=defense, min_rmse=TAU, seed=0, **own.get(defense, {}))).protect(model, x, y, g)
        assert out.gradient is not None
        dense = _dense_rmse(jac, out.gradient - g, out.report.eps)
        torch.testing.assert_close(out.report.rmse_after, dense, rtol=2e-3, atol=1e-12)
        assert out.report.met == bool((dense >= TAU).all())
    pruned = Guard(unclipped(defense="pruning", keep_ratio=0.25)).protect(model, x, y, g).gradient
    assert int((pruned != 0).sum()) == -(-g.numel() // 4)


def test_every_step_hands_its_freed_memory_back_to_the_os(monkeypatch):
    """``Guard.protect`` releases the C heap's free pages after a step that sent and after one that failed
    (``flguard.risk.sizing.release_freed_memory``): between steps a ResNet-18-GN round then holds 0.14 GB less."""
    from flguard.guard import engine

    calls = []
    monkeypatch.setattr(engine, "release_freed_memory", lambda: calls.append(1))
    model, x, y, _, g = _problem(2)
    assert Guard(unclipped(defense="gaussian", min_rmse=TAU)).protect(model, x, y, g).report.met
    bad = g.clone()
    bad[0] = float("nan")
    assert Guard(unclipped(defense="gaussian")).protect(model, x, y, bad).gradient is None
    assert len(calls) == 2


def _resident() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _fragmented_heap() -> list[torch.Tensor]:
    """256 MB of 64 KB tensors (under glibc's mmap threshold: on the heap) freed but every 16th, which is returned to
    keep alive: the heap cannot shrink from its top, and 240 MB of freed pages stay resident until trimmed."""
    blocks = [torch.ones(16384) for _ in range(4096)]
    return blocks[::16]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_memory_returns_a_fragmented_heap_to_the_os():
    """The freed pages of a fragmented heap stay resident until ``release_freed_memory`` hands them back."""
    from flguard.risk import sizing

    kept = _fragmented_heap()
    before = _resident()
    sizing.release_freed_memory()
    assert before - _resident() > 128 * 2 ** 20
    del kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and mallinfo2")
def test_release_freed_memory_keeps_a_heap_with_little_free(monkeypatch):
    """A heap with less than RELEASE_FROM_BYTES free keeps its pages (the next step would fault them in again):
    the same fragmented 240 MB stays resident under a threshold above it, and goes back under one below it."""
    from flguard.risk import sizing

    sizing.release_freed_memory()  # glibc looked up
    if sizing._heap[1] is None:
        pytest.skip("glibc before 2.33: no mallinfo2, every heap is trimmed")
    kept = _fragmented_heap()
    free = sizing._heap[1]().fordblks
    assert free > 200 * 2 ** 20
    monkeypatch.setattr(sizing, "RELEASE_FROM_BYTES", free + 2 ** 30)
    before = _resident()
    sizing.release_freed_memory()
    assert abs(before - _resident()) < 32 * 2 ** 20
    monkeypatch.setattr(sizing, "RELEASE_FROM_BYTES", free // 2)
    sizing.release_freed_memory()
    assert before - _resident() > 128 * 2 ** 20
    del kept


def test_a_guarded_step_leaves_no_operator_to_the_cyclic_collector(monkeypatch):
    """Every operator a step builds is freed by reference counting when the step ends (Python's cyclic collector
    off): a reference cycle would keep its per-sample gradients until the collector runs."""
    import gc
    import weakref

    from flguard.guard import engine

    built = []

    class Recorded(engine.JacobianOperator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self))

    monkeypatch.setattr(engine, "JacobianOperator", Recorded)
    model, x, y, _, g = _problem(4)
    gc.collect()
    gc.disable()
    try:
        for defense in ("gaussian", "resolvent", "eigen"):
            Guard(GuardConfig(defense=defense, min_rmse=TAU, clip_per_sample="median")).protect(model, x, y, g)
        assert built and all(ref() is None for ref in built)
    finally:
        gc.enable()
