"""Swappable pieces of gradient-matching attacks: the model's gradient, matching losses, priors.

Every function is batched over a leading "candidate" axis where noted so restarts run together.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from flguard.risk.functional import functional_forward

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with mean reduction; ``labels`` may be class indices or soft labels."""
    return F.cross_entropy(logits, labels)


def l2_matching(candidate: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """DLG's objective: ½ Σ_layers ‖∇θL(x̂) − g‖²."""
    return 0.5 * sum(((c - t) ** 2).sum() for c, t in zip(candidate, target))


def cosine_matching(candidate: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """GS's objective: 1 − cos(∇θL(x̂), g) over all parameters concatenated."""
    dot = sum((c * t).sum() for c, t in zip(candidate, target))
    norm_c = sum((c * c).sum() for c in candidate).sqrt()
    norm_t = sum((t * t).sum() for t in target).sqrt()
    return 1.0 - dot / (norm_c * norm_t).clamp_min(1e-30)


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation: mean absolute difference of neighbouring pixels, per image.

    ``images`` [..., C, H, W] -> [...]: one value per image so candidates stay separable.
    """
    dx = (images[..., :, :, 1:] - images[..., :, :, :-1]).abs().mean(dim=(-3, -2, -1))
    dy = (images[..., :, 1:, :] - images[..., :, :-1, :]).abs().mean(dim=(-3, -2, -1))
    return dx + dy


# -- batched over candidates -------------------------------------------------------------------
# Restarts are independent problems: each candidate c has its own gradient ∇θL(x̂_c), and its own
# matching loss. The functions below take per-layer tensors with a leading candidate axis
# [R, *param.shape] and return one value per candidate, [R].


def _flat_candidates(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-layer [R, ...] tensors as one [R, dθ] matrix."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=1)


def l2_distances(candidate: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """½‖∇θL(x̂_c) − g‖² for every candidate c: per-layer [R, ...] against [...] -> [R]."""
    diff = _flat_candidates(candidate) - torch.cat([t.reshape(1, -1) for t in target], dim=1)
    return 0.5 * (diff * diff).sum(dim=1)


def cosine_distances(candidate: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """1 − cos(∇θL(x̂_c), g) for every candidate c: per-layer [R, ...] against [...] -> [R]."""
    flat_c = _flat_candidates(candidate)
    flat_t = torch.cat([t.reshape(-1) for t in target])
    dot = flat_c @ flat_t
    norms = flat_c.norm(dim=1) * flat_t.norm()
    return 1.0 - dot / norms.clamp_min(1e-30)


def project_out(tensors: Sequence[torch.Tensor], basis: torch.Tensor | None) -> list[torch.Tensor]:
    """Per-layer tensors with a leading candidate axis [R, ...] minus their component in span(basis).

    ``basis`` [dθ, r] has orthonormal columns over all parameters concatenated (model order); the
    result is t − Q(Qᵀt) split back per layer. An attacker that knows which parameter-space
    directions carry a defense's noise matches only the rest of the gradient (see
    ``flguard.attacks.adaptive``). ``None`` returns the tensors unchanged.
    """
    if basis is None:
        return list(tensors)
    flat = _flat_candidates(tensors)
    flat = flat - (flat @ basis) @ basis.T
    sizes = [t[0].numel() for t in tensors]
    return [chunk.reshape(t.shape) for chunk, t in zip(flat.split(sizes, dim=1), tensors)]


def subspace_basis(basis: torch.Tensor | None, target: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``basis`` checked against the target's size [dθ, r] and moved to its device and dtype."""
    if basis is None:
        return None
    total = sum(t.numel() for t in target)
    if basis.ndim != 2 or basis.shape[0] != total:
        raise ValueError(f"ignore_subspace has shape {tuple(basis.shape)}; expected [{total}, r] (orthonormal columns)")
    return basis.detach().to(device=target[0].device, dtype=target[0].dtype)


def project_target(target: Sequence[torch.Tensor], basis: torch.Tensor | None) -> list[torch.Tensor]:
    """``project_out`` for one un-batched per-layer gradient."""
    return [t[0] for t in project_out([t.unsqueeze(0) for t in target], basis)]


MATCHING_DISTANCES: dict[str, Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], torch.Tensor]] = {
    "l2": l2_distances,
    "cosine": cosine_distances,
}


# -- what the server observes for candidate inputs ---------------------------------------------


def attack_copy(model: nn.Module) -> nn.Module:
    """A private copy of ``model`` that attacks can run functionally without side effects.

    Train-mode BatchNorm still normalises with the batch's statistics (as the client did), but
    stops updating running statistics in place: that cannot happen under ``vmap`` and must not
    touch the caller's model.
    """
    copy_ = copy.deepcopy(model)
    for module in copy_.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            module.track_running_stats = False
            module.running_mean = None
            module.running_var = None
            module.num_batches_tracked = None
    return copy_


class GradientObserver:
    """Maps candidate inputs to what the client would have uploaded for them.

    ``observer(x, y)`` takes candidates ``x`` [R, B, *input_shape] with labels ``y`` [R, B] (class
    indices) or [R, B, K] (soft labels) and returns per-layer tensors [R, *param.shape],
    differentiable with respect to ``x`` (and soft ``y``). Candidates are independent problems,
    so each one's gradient is its own: with R > 1 the per-candidate function is ``vmap``-ed
    (torch.func), with R = 1 plain autograd runs it (it has far less Python overhead per call).

    Here the upload is the FedSGD gradient ∇θ L(x̂, θ); ``flguard.attacks.unroll`` subclasses
    this for multi-step FedAvg updates by overriding ``observe``.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None = None, *, mode: str = "auto") -> None:
        if mode not in ("auto", "vmap", "autograd"):
            raise ValueError(f"mode={mode!r} must be 'auto', 'vmap' or 'autograd'")
        self.model = attack_copy(model)
        self.loss_fn = loss_fn or default_loss
        self.mode = mode
        named = dict(self.model.named_parameters())
        self.names = [n for n, p in named.items() if p.requires_grad]
        self.params = {n: named[n].detach() for n in self.names}
        frozen = {n: p.detach() for n, p in named.items() if not p.requires_grad}
        self.buffers = {**frozen, **dict(self.model.named_buffers())}
        self._leaves = {n: p.clone().requires_grad_(True) for n, p in self.params.items()}

    def forward(self, params: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        return functional_forward(self.model, ({**params, **self.buffers},), inputs)

    def gradient(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                 functional: bool) -> dict[str, torch.Tensor]:
        """∇θ L(x, θ=params) as a dict, kept in the graph so it can be differentiated again."""
        if functional:
            return grad(lambda p: self.loss_fn(self.forward(p, x), y))(params)
        loss = self.loss_fn(self.forward(params, x), y)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        return dict(zip(params, grads))

    def observe(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                functional: bool) -> tuple[torch.Tensor, ...]:
        """The upload for ONE candidate batch x [B, ...]: here the gradient."""
        grads = self.gradient(params, x, y, functional)
        return tuple(grads[n] for n in self.names)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        if self.mode == "autograd" or (self.mode == "auto" and x.shape[0] == 1):
            if x.shape[0] == 1:
                return [o.unsqueeze(0) for o in self.observe(self._leaves, x[0], y[0], False)]
            per = [self.observe(self._leaves, xc, yc, False) for xc, yc in zip(x, y)]
            return [torch.stack(layer) for layer in zip(*per)]
        fn = vmap(lambda xc, yc: self.observe(self.params, xc, yc, True), randomness="different")
        return list(fn(x, y))


# -- the input space: normalisation, box, initial candidates -----------------------------------


class InputSpace:
    """Where candidates live: model input space x = (pixel − mean) / std, per channel.

    Attacks optimise in the model's input space (what the gradient was computed on) but the
    image prior (box [0, 1], TV) is a statement about pixels; this maps between the two.
    """

    def __init__(self, input_shape: Sequence[int], mean: float | Sequence[float] = 0.0,
                 std: float | Sequence[float] = 1.0, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.shape = tuple(int(s) for s in input_shape)
        channels = self.shape[0] if len(self.shape) == 3 else 1
        view = (-1,) + (1,) * (len(self.shape) - 1)

        def stats(value: float | Sequence[float], name: str) -> torch.Tensor:
            t = torch.as_tensor(value, dtype=dtype, device=device).reshape(-1)
            if t.numel() not in (1, channels):
                raise ValueError(f"{name} has {t.numel()} entries; expected 1 or {channels} (one per channel)")
            return t.reshape(view) if t.numel() > 1 else t.reshape(())

        self.mean = stats(mean, "mean")
        self.std = stats(std, "std")
        if bool((self.std <= 0).any()):
            raise ValueError(f"std={std} must be positive")
        self.low = (0.0 - self.mean) / self.std
        self.high = (1.0 - self.mean) / self.std

    def to_pixels(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def from_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return (pixels - self.mean) / self.std

    @torch.no_grad()
    def clamp_(self, x: torch.Tensor) -> torch.Tensor:
        """Project onto the pixel box [0, 1] in place (x in model input space)."""
        return x.copy_(torch.maximum(torch.minimum(x, self.high), self.low))

    def initial(self, restarts: int, batch_size: int, init: str | torch.Tensor,
                generator: torch.Generator) -> torch.Tensor:
        """Candidates [R, B, *shape] in model input space: 'randn' (N(0, 1), Geiping's and DLG's
        choice), 'rand' (uniform pixels in [0, 1]), or a tensor [B, *shape] — a warm start (e.g. an
        earlier reconstruction) for restart 0, the other restarts drawn as 'randn'."""
        size = (restarts, batch_size, *self.shape)
        device = self.mean.device
        if isinstance(init, torch.Tensor):
            if tuple(init.shape) != (batch_size, *self.shape):
                raise ValueError(f"init tensor has shape {tuple(init.shape)}; expected {(batch_size, *self.shape)}")
            start = torch.randn(size, generator=generator, device=device, dtype=self.mean.dtype)
            start[0] = init.detach().to(device=device, dtype=self.mean.dtype)
            return start
        if init == "randn":
            return torch.randn(size, generator=generator, device=device, dtype=self.mean.dtype)
        if init == "rand":
            return self.from_pixels(torch.rand(size, generator=generator, device=device, dtype=self.mean.dtype))
        raise ValueError(f"init={init!r} must be 'randn' or 'rand'")
