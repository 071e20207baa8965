"""Multi-step FedAvg uploads: the server sees θ_K − θ_0 after K local SGD steps, not a gradient.

Geiping et al. (2020, §5) attack such an update by simulating the client's K steps on the
candidate data and matching the simulated update to the observed one. The steps are unrolled
functionally (``torch.func.functional_call`` with the parameters as inputs) so that the update
stays differentiable with respect to the candidate images; the attacker is assumed to know the
local learning rate and how the client split its data into per-step mini-batches.

``UnrolledObserver`` plugs into every gradient-matching attack in place of the FedSGD gradient.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from flguard.attacks.objectives import GradientObserver, LossFn


def step_batches(batch_size: int, local_steps: int, local_batch_size: int | None = None) -> list[list[int]]:
    """Which samples each local step uses: consecutive mini-batches of ``local_batch_size``
    cycling through the client's ``batch_size`` samples (one epoch = ⌈B/b⌉ steps), as a client
    iterating over a fixed, unshuffled loader does. ``None`` means every step uses all B samples.
    """
    if local_steps < 1:
        raise ValueError(f"local_steps={local_steps} must be at least 1")
    b = batch_size if local_batch_size is None else int(local_batch_size)
    if not 1 <= b <= batch_size:
        raise ValueError(f"local_batch_size={local_batch_size} must lie in [1, batch_size={batch_size}]")
    per_epoch = -(-batch_size // b)
    return [list(range(k % per_epoch * b, min(batch_size, (k % per_epoch + 1) * b))) for k in range(local_steps)]


class UnrolledObserver(GradientObserver):
    """Candidate inputs -> the update θ_K − θ_0 of K SGD steps with learning rate ``local_lr``.

    ``batches[k]`` lists the sample indices of step k. The loss at each step is ``loss_fn`` on
    that step's mini-batch (mean reduction by default, as a client's training loop uses).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None, *, local_steps: int, local_lr: float,
                 batches: Sequence[Sequence[int]], mode: str = "auto") -> None:
        super().__init__(model, loss_fn, mode=mode)
        if not local_lr > 0:
            raise ValueError(f"local_lr={local_lr} must be positive for a multi-step update")
        if len(batches) != local_steps:
            raise ValueError(f"local_batches lists {len(batches)} steps; local_steps={local_steps}")
        self.local_steps = local_steps
        self.local_lr = float(local_lr)
        self.batches = [torch.as_tensor(list(b), dtype=torch.long) for b in batches]
        if any(len(b) == 0 for b in self.batches):
            raise ValueError("every local step needs at least one sample")

    def observe(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                functional: bool) -> tuple[torch.Tensor, ...]:
        current = dict(params)
        for index in self.batches:
            index = index.to(x.device)
            grads = self.gradient(current, x.index_select(0, index), y.index_select(0, index), functional)
            current = {n: current[n] - self.local_lr * grads[n] for n in self.names}
        return tuple(current[n] - params[n] for n in self.names)


def make_observer(model: nn.Module, loss_fn: LossFn | None, batch_size: int, *, local_steps: int = 1,
                  local_lr: float | None = None, local_batch_size: int | None = None,
                  local_batches: Sequence[Sequence[int]] | None = None, mode: str = "auto") -> GradientObserver:
    """The FedSGD gradient observer for ``local_steps == 1``, else the unrolled K-step update."""
    if local_steps == 1 and local_batches is None:
        return GradientObserver(model, loss_fn, mode=mode)
    if local_batches is not None and local_steps not in (1, len(local_batches)):
        raise ValueError(f"local_batches lists {len(local_batches)} steps but local_steps={local_steps}")
    if local_lr is None:
        raise ValueError("local_lr is required when local_steps > 1 (the attacker must know the client's lr)")
    batches = local_batches if local_batches is not None else step_batches(batch_size, local_steps, local_batch_size)
    if any(i < 0 or i >= batch_size for b in batches for i in b):
        raise ValueError(f"local_batches index samples outside [0, batch_size={batch_size})")
    return UnrolledObserver(model, loss_fn, local_steps=len(batches), local_lr=local_lr, batches=batches, mode=mode)


def simulate_update(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, local_steps: int,
                    local_lr: float, local_batch_size: int | None = None,
                    loss_fn: LossFn | None = None) -> torch.Tensor:
    """The flat update θ_K − θ_0 a client would upload after K SGD steps on (images, labels).

    For tests and benchmarks (the client side); the model itself is left unchanged.
    """
    batches = step_batches(images.shape[0], local_steps, local_batch_size)
    observer = UnrolledObserver(model, loss_fn, local_steps=local_steps, local_lr=local_lr, batches=batches,
                                mode="autograd")
    update = observer(images.unsqueeze(0), labels.unsqueeze(0))
    return torch.cat([u.detach().reshape(-1) for u in update])
