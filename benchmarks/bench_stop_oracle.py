"""How much of each sample's solve the floor needs: the early stop against the rtol stop and an oracle.

On trained batches of ``bench_guard_models.py``'s model, with the guard's defaults and the data's
normalisation (``seed=0``), per batch:

- the K products the guard's solves take (the verification products included), summed over samples,
  with each sample stopped once it certifies (``flguard.guard.floor.STOP_WHEN_SUFFICIENT``) and with every
  sample solved to rtol — counted per row of every product the solver asks for;
- an oracle that knows the final noise scale c of the rtol-stopped guard: per sample, the fewest CG
  iterations (from 0, at the guard's ε) whose *verified* error bound — an explicit true residual — still
  certifies the sample at c (``flguard.guard.box_bound.certifies``), plus one verification product;
- the same oracle with the *exact* error ‖x_k − x*‖ in place of the residual's bound ‖r_k‖/ε (x* from a
  300-step solve, its own bound added): what the certificate would spend with a perfect a-posteriori error
  estimate, so the most that any tighter rigorous error bound can save;
- the same oracle with ``dual_bound``, a verified radius from one more explicit product K·r per iteration
  (counted): one realisable tighter bound;
- the same oracle with the residual's ball (``flguard.risk.krylov.residual_ball``: centre x_k + r_k/(2ε), radius
  ‖r_k‖/(2ε), no product) — the bound the guard's solvers use since 2026-11-27; the guard columns are the shipped
  solvers', so with ``BALL_CENTRE`` on they already stop on it.

The oracle is what any per-sample stop could spend with this certificate; the rtol stop is the practice
before the early stop. The oracles replay plain CG on the step's own operator whatever kind sent the noise (the guard
solves resolvent's and eigen's floor by PCG, so their guard columns are not the oracles' solver), with the kind the
step sent in the batch column.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_stop_oracle.py --model cnn --batches 6
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_stop_oracle.py --model resnet20_gn --batch 8 --batches 3
"""

from __future__ import annotations

import argparse

import torch

from bench_guard_models import trained_batches
from flguard import Guard, GuardConfig
from flguard.guard import floor
from flguard.guard.box_bound import certifies
from flguard.risk import regularised
from flguard.risk import krylov
from flguard.risk.krylov import residual_ball
from flguard.risk.assess import jacobian_product
from flguard.risk.clipped import base_operator
from flguard.risk.regularised import RegularisedK

MAX_ORACLE_ITERATIONS = 60
#: CG iterations of the exact-error oracle's reference solve x* (its own residual bound is added).
REFERENCE_ITERATIONS = 300


class RowCounter:
    """Counts the sample-rows of every K product the guard's solvers ask for (whole-batch and shrunk), summed over
    samples: a solver on an operator restricted to some samples (the negligible ones left out unsolved) counts its
    own rows, so there is no per-sample index to keep."""

    def __init__(self) -> None:
        self.rows = 0
        self._on_rows, self._shrinking = krylov._on_rows, regularised.ShrinkingProducts.__call__

    def __enter__(self) -> "RowCounter":
        counter = self

        def on_rows(matvec, rows_matvec, v, mask):
            if rows_matvec is None or bool(mask.all()):
                counter.rows += int(mask.sum())
            return counter._on_rows(matvec, rows_matvec, v, mask)

        def shrinking(products, u, rows):
            counter.rows += int(rows.numel())
            return counter._shrinking(products, u, rows)

        krylov._on_rows = on_rows
        import flguard.risk.lanczos_solve as lanczos_solve
        lanczos_solve._on_rows = on_rows
        regularised.ShrinkingProducts.__call__ = shrinking
        return self

    def __exit__(self, *exc) -> None:
        import flguard.risk.lanczos_solve as lanczos_solve
        krylov._on_rows = lanczos_solve._on_rows = self._on_rows
        regularised.ShrinkingProducts.__call__ = self._shrinking


def _guarded(model, x, y, g, data, stop: bool):
    floor.STOP_WHEN_SUFFICIENT = stop
    captured = {}
    meet = floor.FloorCalibrator.meet

    def capture(self, ctx, solved=None, kind="gaussian"):  # the last call is the kind sent
        outcome = meet(self, ctx, solved, kind)
        captured.update(ctx=ctx, outcome=outcome, kind=kind)
        return outcome

    floor.FloorCalibrator.meet = capture
    try:
        with RowCounter() as counter:
            report = Guard(GuardConfig(pixel_mean=data.mean, pixel_std=data.std, seed=0)).protect(model, x, y, g).report
    finally:
        floor.FloorCalibrator.meet = meet
    return report, counter.rows, captured


def dual_bound(r: torch.Tensor, kr: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """A verified bound on ‖(K+εI)⁻¹r‖ from r and an explicit product Kr, never above ‖r‖/ε: for K = JJᵀ and any u,
    rᵀ(K+εI)⁻¹r ≤ ‖r − Ju‖²/ε + ‖u‖² (the ridge problem's value at u; equality at its minimiser), here with
    u = αJᵀr at the best α, and ‖e‖² ≤ eᵀ(K+εI)e/ε for e = (K+εI)⁻¹r."""
    rkr = (r * kr).sum(1).clamp_min(0)
    alpha = rkr / ((kr * kr).sum(1) + eps * rkr).clamp_min(torch.finfo(r.dtype).tiny)
    value = (r - alpha.unsqueeze(1) * kr).pow(2).sum(1) / eps + alpha.pow(2) * rkr
    return torch.minimum((value / eps).sqrt(), r.norm(dim=1) / eps)


def _cg_iterates(system: RegularisedK, b: torch.Tensor, iterations: int):
    """CG's iterates x_1 … x_iterations on (K_i+ε_iI)x_i = b_i from zero, every sample at once (the recurrence of
    ``flguard.risk.krylov.conjugate_gradient``, one product per iteration)."""
    x, r = torch.zeros_like(b), b.clone()
    p, rr = r.clone(), (r * r).sum(1)
    tiny = torch.finfo(b.dtype).tiny
    for _ in range(iterations):
        ap = system.matvec(p)
        step = rr / (p * ap).sum(1).clamp_min(tiny)
        x = x + step.unsqueeze(1) * p
        r = r - step.unsqueeze(1) * ap
        rr_new = (r * r).sum(1)
        p = r + (rr_new / rr.clamp_min(tiny)).unsqueeze(1) * p
        rr = rr_new
        yield x


def _oracle(captured, config, mode: str = "residual") -> torch.Tensor:
    """Per sample, the fewest CG iterations whose verified bound certifies it on the noise sent (+1), -1 if none.
    ``mode="exact"``: the bound is instead the true error ‖x_k − x*‖ (x* from a long solve, plus its own verified
    bound) — what a perfect a-posteriori error estimate would spend with this certificate; ``"dual"``: the verified
    ``dual_bound`` from one more explicit product K·r (+2); ``"ball"``: the residual's ball, centre x_k + r_k/(2ε)
    and radius ‖r_k‖/(2ε). The step's own operator, ε and noise (scale 1: the
    noise sent is the direction at its final scale), whatever kind sent it."""
    ctx, outcome = captured["ctx"], captured["outcome"]
    op = ctx.op
    base_operator(op).limit = None  # the oracle's solves are not the step's: no product or time limit
    b = jacobian_product(op, outcome.noise)
    system = RegularisedK(op, ctx.eps)
    low, high = floor.input_bounds(config.bounds, op.x)
    target = config.floor * (1 + config.rtol)
    kept = torch.isfinite(outcome.rmse_after).cpu()
    need = torch.full((op.batch_size,), -1, dtype=torch.long)
    if mode == "exact":
        reference = system.solve(b, rtol=1e-12, max_iter=REFERENCE_ITERATIONS).solution
        reference_bound = (b - system.matvec(reference)).norm(dim=1) / ctx.eps
    for k, x in enumerate(_cg_iterates(system, b, MAX_ORACLE_ITERATIONS), start=1):
        if mode == "exact":
            bound = (x - reference).norm(dim=1) + reference_bound
        else:
            r = b - system.matvec(x)
            bound = (dual_bound(r, system.matvec(r) - ctx.eps.unsqueeze(1) * r, ctx.eps) if mode == "dual"
                     else r.norm(dim=1) / ctx.eps)
            if mode == "ball":
                x, bound = residual_ball(x, r, ctx.eps)
        ok = certifies(op.x, x, low, high, 1.0, bound, target).cpu()
        need = torch.where((need < 0) & ok, torch.full_like(need, k + (2 if mode == "dual" else 1)), need)
        if bool(((need >= 0) | ~kept).all()):
            break
    return torch.where(kept, need, torch.zeros_like(need))


def main() -> None:
    _, model, data, batches = trained_batches(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    config = GuardConfig(pixel_mean=data.mean, pixel_std=data.std, seed=0)
    print("| batch | K products, early stop (sample-rows, summed) | rtol stop | oracle | oracle, exact error | oracle, dual "
          "bound | oracle, residual ball | most products of a sample: oracle / exact error / dual bound / ball | "
          "noise / C, early / rtol |\n|---|---|---|---|---|---|---|---|---|")
    for seed, x, y, g in batches:
        early, early_counts, _ = _guarded(model, x, y, g, data, True)
        tight, tight_counts, captured = _guarded(model, x, y, g, data, False)
        oracle = _oracle(captured, config)
        exact = _oracle(captured, config, "exact")
        dual = _oracle(captured, config, "dual")
        ball = _oracle(captured, config, "ball")
        clip = early.details.get("clip", float("nan"))
        print(f"| {seed} ({captured['kind']}) | {early_counts} | {tight_counts} | "
              f"{int(oracle.clamp_min(0).sum())} | "
              f"{int(exact.clamp_min(0).sum())} | {int(dual.clamp_min(0).sum())} | {int(ball.clamp_min(0).sum())} | "
              f"{int(oracle.max())} / {int(exact.max())} / {int(dual.max())} / {int(ball.max())} | "
              f"{early.noise_norm / clip:.4g} / {tight.noise_norm / tight.details.get('clip', float('nan')):.4g} |", flush=True)
    floor.STOP_WHEN_SUFFICIENT = True


if __name__ == "__main__":
    main()
