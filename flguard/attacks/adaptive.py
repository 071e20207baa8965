"""The adaptive attacker: it knows the guard's eigen defense and discards the subspace its noise lives in.

The ``eigen`` defense (``flguard.defenses.eigen``) hides each sample behind noise confined to a
few parameter-space directions J_iᵀu_j, u_j the eigenvectors of K_i = J_iJ_iᵀ whose regularised
gain √λ/(λ+ε) is largest. A server that knows this (Kerckhoffs: the defense is public, only
the random coefficients are secret) can estimate that subspace itself and stop matching it:

1. reconstruct once with a base attack (GS or DLG) → x̂;
2. at x̂ (with the known labels), run Lanczos on K(x̂) (``flguard.risk`` — ``JacobianOperator``,
   ``lanczos``) and keep, per sample, the ``subspace`` Ritz vectors the defense would pick
   (largest gain at the defense's relative ε, or simply the smallest eigenvalues);
3. map them to parameter space (J(x̂)ᵀu), orthonormalise → Q, and remove span(Q) from the received
   gradient *and* from every candidate's gradient;
4. attack again on what is left, warm-started at x̂ with its components along the estimated weak
   input directions reset to 0 (the dataset mean: those coordinates were the noisy ones), and
5. return whichever of the two reconstructions matches the projected gradient better — where both
   match it (to ``match_tol``), the second: the projected gradient cannot tell them apart (x̂ matched
   the noisy gradient, so it also matches its projection), and the second takes the ignored
   coordinates from the prior instead of from the noise.

If x̂ is close enough to the truth that J(x̂) ≈ J(x), span(Q) covers the eigen noise and the
second pass sees an (almost) clean gradient; what it loses are the ignored coordinates, which no
gradient-matching attacker can recover better than its prior (the mean, the box, TV). Against
isotropic Gaussian noise the projection removes a negligible share of the noise, so the attacker
is no weaker than its base attack.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from flguard.attacks.base import Reconstruction, methods, register
from flguard.attacks.gs import pick_best
from flguard.attacks.objectives import (MATCHING_DISTANCES, GradientObserver, LossFn, project_out,
                                        project_target)
from flguard.risk.closed_forms import regularised_gain
from flguard.risk.defaults import DEFAULT_EPS_RELATIVE
from flguard.risk.lanczos import orthogonalised
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK

BASES = ("gs", "dlg")
SELECTIONS = ("gain", "smallest")


def weak_subspace(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn | None = None, *,
                  size: int = 32, krylov_steps: int = 64, select: str = "gain", eps: float = DEFAULT_EPS_RELATIVE,
                  seed: int = 0, rank_tol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameter-space subspace an eigen defense would put its noise in, estimated at ``x``.

    Per sample i of ``x`` [B, *shape]: ``krylov_steps`` Lanczos steps on K_i, then the ``size``
    Ritz vectors u with the largest gain √θ/(θ + eps·θmax) (``select='gain'``, the defense's own
    rule) or the smallest θ (``'smallest'``). Returns (Q [dθ, r], U [B, k, dx]): Q orthonormal
    columns spanning {J_iᵀu} over all samples (numerically dependent columns dropped), U the
    chosen input-space directions per sample (orthonormal, from Lanczos).
    """
    if select not in SELECTIONS:
        raise ValueError(f"select={select!r} must be one of {', '.join(SELECTIONS)}")
    if size < 1 or krylov_steps < 1 or eps < 0:
        raise ValueError(f"size={size} and krylov_steps={krylov_steps} must be >= 1, eps={eps} >= 0")
    op = JacobianOperator(model, x, labels, loss_fn)
    steps = min(krylov_steps, op.dx)
    spectrum = RegularisedK(op).lanczos(ends="max", min_iter=steps, max_iter=steps, return_vectors=True, seed=seed)
    theta = spectrum.ritz_values.clamp_min(0)  # [B, m], ascending
    if select == "gain":
        score = regularised_gain(theta, eps * theta[:, -1:])
    else:
        score = -theta
    k = min(size, theta.shape[1])
    chosen = score.topk(k, dim=1).indices
    u = spectrum.ritz_vectors.gather(1, chosen.unsqueeze(2).expand(-1, -1, op.dx))  # [B, k, dx]
    columns = op.jt(u).reshape(-1, op.dtheta)  # one column J_iᵀu per (sample, direction)
    columns = columns / columns.norm(dim=1, keepdim=True).clamp_min(torch.finfo(columns.dtype).tiny)
    q, r = torch.linalg.qr(columns.T)
    diagonal = r.diagonal().abs()
    keep = diagonal > rank_tol * diagonal.max().clamp_min(torch.finfo(diagonal.dtype).tiny)
    return q[:, keep], u


def projected_losses(model: nn.Module, candidates: Sequence[torch.Tensor], labels: torch.Tensor,
                     target: Sequence[torch.Tensor], basis: torch.Tensor, loss_fn: LossFn | None,
                     distance: str) -> torch.Tensor:
    """The matching distance of each candidate batch [B, *shape] against ``target``, both with
    span(basis) removed — the criterion the adaptive attacker picks its answer by."""
    observer = GradientObserver(model, loss_fn, mode="autograd")
    stacked = torch.stack([c.detach() for c in candidates])  # [R, B, *shape]
    y = labels.unsqueeze(0).expand(stacked.shape[0], *labels.shape)
    with torch.enable_grad():
        observed = project_out(observer(stacked, y), basis)
    return MATCHING_DISTANCES[distance]([o.detach() for o in observed], project_target(target, basis))


@register("adaptive")
def adaptive(model: nn.Module, target: Sequence[torch.Tensor], input_shape: Sequence[int], *,
             labels: torch.Tensor | None, loss_fn: LossFn | None, batch_size: int, iterations: int | None,
             restarts: int, device: torch.device, generator: torch.Generator,
             base: str = "gs", subspace: int = 64, krylov_steps: int = 128, select: str = "gain",
             eps: float = DEFAULT_EPS_RELATIVE, mean: float | Sequence[float] = 0.0,
             std: float | Sequence[float] = 1.0, warm_start: bool = True,
             base_hyperparameters: Mapping[str, Any] | None = None,
             first_images: torch.Tensor | None = None, match_tol: float = 1e-3) -> Reconstruction:
    """Two passes of ``base`` ('gs' or 'dlg'), the second blind to the estimated noise subspace.

    Hyperparameters: ``subspace`` directions per sample (the guard's default ``subspace_size`` is
    32; twice that covers it with margin), ``krylov_steps`` Lanczos steps at x̂, ``select`` 'gain' (the
    defense's rule, with its relative ``eps``) or 'smallest'; ``mean``/``std`` the dataset
    normalisation (box/TV of the base attack); ``warm_start`` start the second pass at x̂ (weak
    input directions reset) rather than at random; ``base_hyperparameters`` go to both passes;
    ``first_images`` [B, *input_shape] an existing reconstruction that replaces the first pass
    (a server that already ran the base attack reuses it); ``match_tol`` the projected matching
    loss, relative to that of a zero gradient, below which a pass counts as matching.
    ``iterations``/``restarts`` apply to each pass. ``extra``: 'first_images', 'losses' (both
    passes on the projected criterion), 'chosen' ('first' | 'second'), 'subspace_rank'.
    """
    start = time.perf_counter()
    if base not in BASES:
        raise ValueError(f"base={base!r} must be one of {', '.join(BASES)}")
    if labels is None:
        raise ValueError("the adaptive attack needs labels (known, or recovered by reconstruct)")
    base_fn = methods()[base]
    hp = {"mean": mean, "std": std, **dict(base_hyperparameters or {})}
    for reserved in ("init", "ignore_subspace"):
        if reserved in hp:
            raise ValueError(f"base_hyperparameters may not set {reserved!r}: the adaptive attack sets it")
    common = dict(labels=labels, loss_fn=loss_fn, batch_size=batch_size, iterations=iterations,
                  restarts=restarts, device=device, generator=generator)
    if first_images is None:
        first = base_fn(model, target, input_shape, **common, **hp)
    else:
        if tuple(first_images.shape) != (batch_size, *input_shape):
            raise ValueError(f"first_images has shape {tuple(first_images.shape)}; "
                             f"expected {(batch_size, *input_shape)}")
        first = Reconstruction(images=first_images.detach().to(device=device, dtype=target[0].dtype),
                               labels=labels.detach().clone(), loss=float("nan"), method=base)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))
    basis, weak_inputs = weak_subspace(model, first.images, labels.to(device), loss_fn, size=subspace,
                                       krylov_steps=krylov_steps, select=select, eps=eps, seed=seed)
    if warm_start:
        flat = first.images.reshape(batch_size, -1)
        flat = orthogonalised(weak_inputs, flat)
        init: str | torch.Tensor = flat.reshape(first.images.shape)
    else:
        init = "randn"
    second = base_fn(model, target, input_shape, **common, init=init, ignore_subspace=basis, **hp)
    distance = hp.get("distance", "cosine" if base == "gs" else "l2")
    losses = projected_losses(model, [first.images, second.images], labels.to(device), target, basis, loss_fn,
                              distance)
    projected = project_target(target, basis)
    scale = 0.5 * sum(float((t * t).sum()) for t in projected) if distance == "l2" else 1.0  # a zero gradient's loss
    best = 1 if float(losses[1]) <= match_tol * scale else pick_best(losses)
    chosen = (first, second)[best]
    return Reconstruction(images=chosen.images, labels=chosen.labels, loss=float(losses[best]),
                          history=first.history + second.history, seconds=time.perf_counter() - start,
                          method="adaptive",
                          extra={"base": base, "first_images": first.images, "losses": losses.tolist(),
                                 "chosen": ("first", "second")[best], "subspace_rank": int(basis.shape[1])})
