"""Leaving out of a step the samples that the noise budget cannot protect.

On a trained model a few samples of a batch can need far more noise than the rest: with the pixel
box (``input_bounds``) an attacker clips its reconstruction, and a sample whose predicted shift
points mostly out of the box (MNIST's black background, a saturated digit stroke) keeps a clipped
error below τ at any noise the budget allows. Withholding the whole update for it throws away the
other samples' step, and over a local round of many steps one such sample withholds the round.

The rigorous alternative is to send the step without that sample: on the per-sample path the
upload is c Σ_i u_i(x_i) (u_i the sample's — possibly clipped — gradient) and sample i's block
J_i depends on x_i alone, so removing sample j's term leaves every other block, and so every
other sample's certified I²F for the realised noise, exactly as it was; the update no longer
depends on x_j at all, so nothing about x_j leaves in this step. The kept samples' floor is then
fitted and verified as usual. Only the per-sample path qualifies: with train-mode BatchNorm or a
loss that does not split per sample every block depends on the whole batch.
"""

from __future__ import annotations

import math

import torch

from flguard.guard.box_bound import BoxProfile
from flguard.risk.closed_forms import to_rmse
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator


def reachable_at(x: torch.Tensor, shift: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor] | BoxProfile | None,
                 scale: float, tau: float, rtol: float, slack: torch.Tensor | None = None) -> torch.Tensor:
    """[B] bool: which samples' certified RMSE reaches τ(1 + rtol) at noise ``scale`` × the unit direction.

    ``shift`` [B, dx] is I²F's Δx̃ for the unit direction, within ``slack`` η_i (default rtol‖Δx̃_i‖)
    of the exact one. Without bounds the certified RMSE is c(‖Δx̃‖ − η)/√dx; with a box (low, high),
    broadcastable to x, the clipped error's certified lower bound (``flguard.guard.box_bound``), as
    the guard verifies it. ``bounds`` may be these shifts' ``BoxProfile`` already (one sort for many scales).
    """
    dx = shift.shape[1]
    target = tau * (1 + rtol)
    slack = rtol * shift.norm(dim=1) if slack is None else slack
    if bounds is None:
        return to_rmse((shift.norm(dim=1) - slack) * scale, dx) >= target
    profile = bounds if isinstance(bounds, BoxProfile) else BoxProfile(x, shift, *bounds)
    return profile.certifies(scale, slack, target)


#: A sample whose term in the upload is at most this share of the clipping norm C (or, without
#: clipping, of the batch's largest per-sample gradient norm) is negligible: leaving it out moves the
#: update by at most NEGLIGIBLE_SHARE·C/B per such sample, so it does not count against
#: ``max_excluded``. Such samples are the well-fitted ones (p(true class) ≈ 1): their gradient is
#: 1e-4–1e-8 of C, their predicted recovery error huge, and float32 products carry too few digits for
#: a solve to certify it (docs/results.md, "Defaults that send").
NEGLIGIBLE_SHARE = 1e-2


def negligible_samples(op: JacobianOperator | ClippedJacobian) -> torch.Tensor:
    """[B] bool: samples whose (clipped) gradient is at most NEGLIGIBLE_SHARE of C (or of the batch's
    largest per-sample norm without clipping)."""
    if isinstance(op, ClippedJacobian):
        norms = op.sample_norms * op.factor
        reference = torch.as_tensor(op.clip, dtype=norms.dtype, device=norms.device)
    else:
        norms = op.sample_gradient_set().norms()
        reference = norms.max()
    return norms <= NEGLIGIBLE_SHARE * reference


def excludable(keep: torch.Tensor, max_share: float, free: torch.Tensor | None = None) -> bool:
    """Whether leaving out ``~keep`` stays within ``max_share`` of the batch and keeps someone; samples
    marked ``free`` (negligible) are left out without counting against the share."""
    left = ~keep if free is None else ~keep & ~free
    return bool(keep.any()) and int(left.sum()) <= math.floor(max_share * keep.numel() + 1e-9)


def kept_gradient(op: JacobianOperator | ClippedJacobian, flat: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The upload without the left-out samples: c Σ_{i kept} u_i, checked against ``flat``.

    ``flat`` is the whole batch's upload (the clipped sum with ``clip_per_sample``); the per-sample
    terms are recomputed here and must add up to it, so nothing else hidden in ``flat`` (a term the
    guard did not measure) could ride along with the kept samples.
    """
    base = op.op if isinstance(op, ClippedJacobian) else op
    if base.coupled:
        raise ValueError("samples can be left out only on the per-sample path (no train-mode BatchNorm, a loss "
                         "that splits per sample)")
    per = base.sample_gradient_set()  # the [B, dθ] matrix, or never formed (flguard.risk.sample_gradients)
    norms = per.norms()
    # each sample's weight in the upload (its clipping factor, or 1): weighted sums, never a scaled [B, dθ] copy (1.4 GB
    # on a ResNet-18 at B = 32)
    weight = op.factor.to(norms) if isinstance(op, ClippedJacobian) else torch.ones_like(norms)
    whole = base.scale * per.weighted(weight)
    summands = base.scale * float((norms * weight).sum())  # rounding is relative to the summands (see engine._clipped)
    if float((whole.to(flat) - flat).norm()) > 1e-3 * (float(flat.norm()) + summands) + 1e-12:
        raise ValueError("the gradient given is not the batch loss's gradient at (model, x, y): samples cannot "
                         "be left out of it")
    return (base.scale * per.weighted(weight * keep.to(weight))).to(flat)
