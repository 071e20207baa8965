"""GS — "Inverting Gradients" (Geiping et al., NeurIPS 2020).

Objective per candidate x̂:   1 − cos(∇θL(x̂), g) + α·TV(x̂)
Optimiser: Adam (lr 0.1) fed the *sign* of the objective's gradient, projection onto the pixel
box [0, 1] after every step (through the dataset's normalisation), MultiStepLR ×0.1 at 3/8, 5/8
and 7/8 of the iterations; R random restarts, the best chosen by the matching loss (without TV).

Why these choices: the cosine makes the attack invariant to the gradient's scale (so it also
works on updates scaled by a learning rate or averaged over a batch); signed steps make progress
independent of the badly scaled raw gradient; the box and TV are the image prior.

Restarts are independent problems optimised together as one batch: the candidate axis is
``vmap``-ed through the model's gradient (see ``objectives.GradientObserver``) and the losses
are summed, which leaves each candidate's own gradient unchanged.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from flguard.attacks.base import Reconstruction, register
from flguard.attacks.objectives import (MATCHING_DISTANCES, InputSpace, LossFn, project_out, project_target,
                                       subspace_basis, total_variation)
from flguard.attacks.unroll import make_observer

# Published preset (Geiping et al.'s repository defaults for single-image ResNet/CIFAR attacks):
# 4,800 iterations, lr 0.1, signed Adam, boxed, TV 1e-1 (our TV is the mean absolute neighbour
# difference per image in pixel units, which is theirs up to the normalisation's 1/std).
DEFAULT_ITERATIONS = 4800
DEFAULT_TV = 1e-1
# The strongest-attack mode's TV sweep: 0.1 suits natural images, digits want (almost) none; the
# attacker cannot see the truth, so the candidate with the lowest matching loss wins.
STRONGEST_TVS = (0.0, 1e-4, 1e-2, 1e-1)


def milestones(iterations: int) -> list[int]:
    """Learning-rate drops at 3/8, 5/8 and 7/8 of the run."""
    return [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]


def pick_best(losses: torch.Tensor) -> int:
    """Index of the lowest finite matching loss (NaN/inf candidates never win)."""
    finite = torch.where(torch.isfinite(losses), losses, torch.full_like(losses, float("inf")))
    return int(finite.argmin())


@register("gs")
def gs(model: nn.Module, target: Sequence[torch.Tensor], input_shape: Sequence[int], *,
       labels: torch.Tensor, loss_fn: LossFn | None, batch_size: int, iterations: int | None,
       restarts: int, device: torch.device, generator: torch.Generator,
       lr: float = 0.1, tv: float = DEFAULT_TV, mean: float | Sequence[float] = 0.0,
       std: float | Sequence[float] = 1.0, boxed: bool = True, signed: bool = True, lr_decay: bool = True,
       distance: str = "cosine", init: str | torch.Tensor = "randn", local_steps: int = 1,
       local_lr: float | None = None, local_batch_size: int | None = None,
       local_batches: Sequence[Sequence[int]] | None = None, log_every: int = 100, observer_mode: str = "auto",
       ignore_subspace: torch.Tensor | None = None, strongest: bool = False,
       tv_sweep: Sequence[float] | None = None) -> Reconstruction:
    """Geiping et al.'s attack. ``labels`` [B] are known (``reconstruct`` recovers them if not).

    Hyperparameters: ``lr`` Adam step; ``tv`` weight of total variation (pixel units);
    ``mean``/``std`` the dataset normalisation (for the box and TV); ``boxed``, ``signed``,
    ``lr_decay`` switch the three tricks; ``distance`` 'cosine' (default) or 'l2';
    ``init`` 'randn' | 'rand' | a tensor [B, *input_shape] (warm start of restart 0);
    ``local_steps``/``local_lr``/``local_batch_size``/``local_batches`` attack a K-step FedAvg
    update by unrolling (see ``flguard.attacks.unroll``); ``log_every`` history period;
    ``observer_mode`` 'auto' | 'vmap' | 'autograd'; ``ignore_subspace`` [dθ, r] orthonormal
    parameter-space directions removed from both gradients before matching (the adaptive attack);
    ``tv_sweep`` TV weights to try instead of ``tv`` (every restart runs with each, all candidates
    optimised together as one batch, the lowest matching loss wins); ``strongest=True`` is the
    strongest-attack mode: the sweep ``STRONGEST_TVS`` unless ``tv_sweep`` is given.
    ``extra['tv']`` is the winning candidate's TV weight, ``extra['sweep_losses']`` the best
    matching loss reached with each weight of the sweep.
    """
    start = time.perf_counter()
    iterations = DEFAULT_ITERATIONS if iterations is None else iterations
    weights = tuple(float(w) for w in (tv_sweep if tv_sweep is not None else STRONGEST_TVS if strongest else (tv,)))
    if not weights or min(weights) < 0 or tv < 0 or lr <= 0:
        raise ValueError(f"tv={tv} and tv_sweep={tv_sweep} must be >= 0 (and the sweep non-empty), lr={lr} > 0")
    matching, basis, target, space, observer = matching_problem(
        model, loss_fn, target, distance, ignore_subspace, input_shape, mean, std, device, batch_size,
        dict(local_steps=local_steps, local_lr=local_lr, local_batch_size=local_batch_size,
             local_batches=local_batches, mode=observer_mode))
    candidates = restarts * len(weights)  # candidate c runs with TV weight weights[c // restarts]
    y = labels.to(device).unsqueeze(0).expand(candidates, *labels.shape)
    tv_of = torch.tensor(weights, device=device, dtype=target[0].dtype).repeat_interleave(restarts)

    x = space.initial(candidates, batch_size, init, generator)
    if isinstance(init, torch.Tensor):
        x[::restarts] = x[0].clone()  # the warm start begins every TV weight's first restart
    if boxed:
        space.clamp_(x)
    x.requires_grad_(True)
    optimizer = torch.optim.Adam([x], lr=lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones(iterations), gamma=0.1) if lr_decay else None

    def objective(candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        match = matching(project_out(observer(candidates, y), basis), target)
        prior = tv_of * total_variation(space.to_pixels(candidates)).mean(dim=1) if max(weights) > 0 else 0.0
        return match, match + prior

    history: list[float] = []
    for step in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        match, total = objective(x)
        (direction,) = torch.autograd.grad(total.sum(), x)
        x.grad = direction.sign() if signed else direction
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if boxed:
            space.clamp_(x)
        if log_every and step % log_every == 0:
            history.append(float(match.detach().min()))

    final, _ = objective(x)
    final = final.detach()
    best = pick_best(final)
    history.append(float(final[best]))
    return Reconstruction(images=x.detach()[best].clone(), labels=labels.detach().clone(), loss=float(final[best]),
                          history=history, seconds=time.perf_counter() - start, method="gs",
                          extra={"restart_losses": final.tolist(), "best_restart": best, "iterations": iterations,
                                 "tv": weights[best // restarts],
                                 "sweep_losses": {w: float(final[k * restarts:(k + 1) * restarts].min())
                                                  for k, w in enumerate(weights)}})


def matching_problem(model: nn.Module, loss_fn: LossFn | None, target: Sequence[torch.Tensor], distance: str,
                     ignore_subspace: torch.Tensor | None, input_shape, mean, std, device, batch_size: int,
                     unroll: dict) -> tuple:
    """What every gradient-matching attack (GS, DLG) sets up first: the matching distance (checked),
    the ignored parameter subspace and the target projected off it, the input space, and the
    observer that maps candidate inputs to the upload they would produce (``unroll``: the K-step
    FedAvg settings and observer mode of ``make_observer``)."""
    if distance not in MATCHING_DISTANCES:
        raise ValueError(f"distance={distance!r} must be one of {', '.join(MATCHING_DISTANCES)}")
    basis = subspace_basis(ignore_subspace, target)
    target = project_target(target, basis)
    space = InputSpace(input_shape, mean, std, device=device, dtype=target[0].dtype)
    return MATCHING_DISTANCES[distance], basis, target, space, make_observer(model, loss_fn, batch_size, **unroll)
