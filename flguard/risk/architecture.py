"""Chen & Campbell's architecture index c(M): how solvable R-GAP's per-layer linear systems are.

For a sequential net of convolutions (each followed by an invertible activation) and a final
fully-connected layer, every convolution i gives a linear system u⁽ⁱ⁾x = v⁽ⁱ⁾ in its input x
(seed 002 eq. (6)-(7)):

- forward rows, one per output element (o, p): Σ_{c,a,b} W[o,c,a,b]·x[c, p·s + (a,b)·dil − pad] = z_o[p] − b_o;
- weight-gradient rows, one per weight (o, c, a, b): Σ_p δ_o[p]·x[c, p·s + (a,b)·dil − pad] = ∂L/∂W[o,c,a,b],
  with δ = ∂L/∂z.

Both blocks are built here as sparse matrices by index arithmetic (never a dense identity or
unfolding of the whole image). The rank deficiency of layer i is rank(u⁽ⁱ⁾) − nᵢ and
c(M) = Σᵢ (d − (i − 1))/d · (rank(u⁽ⁱ⁾) − nᵢ) (Def. 3.3). The rank is measured on the actual
matrix (float64, real weights and ∂L/∂z of a seeded random input); the generic count
min(nᵢ visible, outputs + weights − O²) is reported beside it. The O² comes from exact
dependencies: for every pair (o, o'), Σ_{c,a,b} W[o',c,a,b]·gradrow(o,c,a,b) = Σ_p δ_o[p]·fwdrow(o',p).

The module is also the parser and matrix builder that ``flguard.attacks.rgap``/``hybrid`` use
(attacks depend on risk, never the reverse).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

INVERTIBLE_ACTIVATIONS = (nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Identity)

# Why a module cannot be part of R-GAP's layer-by-layer linear systems.
_UNSUPPORTED: tuple[tuple[tuple[type, ...], str], ...] = (
    ((nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.GELU, nn.SiLU, nn.Softplus, nn.ELU),
     "its activation is not invertible on the whole real line (or not one the linear-system attack "
     "supports), so z = α⁻¹(x) of the next layer's input cannot be recovered; use tanh, sigmoid, "
     "LeakyReLU (negative slope ≠ 0) or identity"),
    ((nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.MaxPool1d, nn.AvgPool1d),
     "pooling has no weights, hence no weight-gradient constraints (and max-pooling is not "
     "invertible); write average pooling as a strided convolution instead"),
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm, nn.InstanceNorm2d),
     "normalisation layers make each layer's output depend on batch/feature statistics, which the "
     "per-layer linear system (6)-(7) of seed 002 does not model"),
    ((nn.Dropout, nn.Dropout2d), "dropout makes the forward pass random, so z = α⁻¹(x) is not defined"),
)


@dataclass(frozen=True)
class Stage:
    """One weighted layer of a sequential net and the invertible activation after it."""

    module: nn.Module  # nn.Conv2d or nn.Linear
    activation: nn.Module | None  # None: identity
    in_shape: tuple[int, ...]  # (C, H, W) for a convolution, (D,) for a linear layer
    out_shape: tuple[int, ...]

    @property
    def is_conv(self) -> bool:
        return isinstance(self.module, nn.Conv2d)

    @property
    def n_inputs(self) -> int:
        return math.prod(self.in_shape)


def _flatten_modules(model: nn.Module) -> list[nn.Module]:
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"the linear-system analysis (R-GAP, hybrid, c(M)) needs a plain nn.Sequential of conv/linear "
            f"layers and invertible activations; got {type(model).__name__}, whose forward pass (residual "
            "connections, pooling, branches) cannot be read as consecutive layers")
    out: list[nn.Module] = []
    for child in model:
        out.extend(_flatten_modules(child) if isinstance(child, nn.Sequential) else [child])
    return out


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _check_conv(conv: nn.Conv2d) -> None:
    if conv.groups != 1:
        raise ValueError(f"{conv}: grouped convolutions (groups={conv.groups}) are not supported")
    if conv.padding_mode != "zeros":
        raise ValueError(f"{conv}: padding_mode={conv.padding_mode!r} is not supported (only zero padding)")
    if isinstance(conv.padding, str) and conv.padding != "valid":
        raise ValueError(f"{conv}: padding={conv.padding!r} is not supported; give explicit integers")


def _conv_out(conv: nn.Conv2d, in_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(in_shape) != 3 or in_shape[0] != conv.in_channels:
        raise ValueError(f"{conv} gets an input of shape {in_shape}; expected ({conv.in_channels}, H, W)")
    pad = (0, 0) if isinstance(conv.padding, str) else _pair(conv.padding)
    size = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in
            zip(in_shape[1:], pad, _pair(conv.dilation), _pair(conv.kernel_size), _pair(conv.stride))]
    if min(size) < 1:
        raise ValueError(f"{conv}: input {in_shape} is too small")
    return (conv.out_channels, size[0], size[1])


def layer_stages(model: nn.Module, input_shape: Sequence[int]) -> list[Stage]:
    """Read ``model`` as weighted layers with invertible activations; ``ValueError`` says why not."""
    shape = tuple(int(s) for s in input_shape)
    stages: list[Stage] = []
    pending: tuple[nn.Module, tuple[int, ...], tuple[int, ...]] | None = None
    for module in _flatten_modules(model):
        for kinds, why in _UNSUPPORTED:
            if isinstance(module, kinds):
                raise ValueError(f"unsupported layer {module}: {why}")
        if isinstance(module, nn.LeakyReLU) and module.negative_slope == 0:
            raise ValueError(f"unsupported layer {module}: a zero negative slope is ReLU, not invertible")
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            if pending is not None:
                stages.append(Stage(pending[0], None, pending[1], pending[2]))
            if isinstance(module, nn.Conv2d):
                _check_conv(module)
                out = _conv_out(module, shape)
            else:
                if math.prod(shape) != module.in_features:
                    raise ValueError(f"{module} gets {math.prod(shape)} inputs ({shape})")
                shape, out = (module.in_features,), (module.out_features,)
            pending, shape = (module, shape, out), out
        elif isinstance(module, INVERTIBLE_ACTIVATIONS):
            if isinstance(module, nn.Identity):
                continue
            if pending is None:
                raise ValueError(f"activation {module} must follow a conv or linear layer")
            stages.append(Stage(pending[0], module, pending[1], pending[2]))
            pending = None
        elif isinstance(module, nn.Flatten):
            shape = (math.prod(shape),)
        else:
            raise ValueError(f"unsupported layer {module}: only Conv2d, Linear, Flatten and invertible "
                             "activations (Tanh, Sigmoid, LeakyReLU, Identity) form R-GAP's linear systems")
    if pending is not None:
        stages.append(Stage(pending[0], None, pending[1], pending[2]))
    if not stages or not isinstance(stages[-1].module, nn.Linear):
        raise ValueError("the model must end with a fully-connected layer (seed 002 Def. 3.3, Lemma 3.1)")
    return stages


def patch_index(conv: nn.Conv2d, in_shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """Flat input index of x[c, p·s + (a,b)·dil − pad], shape [Ho·Wo, C, kh, kw]; −1 where it is padding."""
    channels, height, width = in_shape
    _, h_out, w_out = _conv_out(conv, in_shape)
    (kh, kw), (sh, sw), (dh, dw) = _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.dilation)
    ph, pw = (0, 0) if isinstance(conv.padding, str) else _pair(conv.padding)
    rows = torch.arange(h_out, device=device)[:, None] * sh + torch.arange(kh, device=device)[None] * dh - ph
    cols = torch.arange(w_out, device=device)[:, None] * sw + torch.arange(kw, device=device)[None] * dw - pw
    r = rows[:, None, None, :, None]  # [Ho, 1, 1, kh, 1]
    c = cols[None, :, None, None, :]  # [1, Wo, 1, 1, kw]
    ch = torch.arange(channels, device=device)[None, None, :, None, None]
    flat = ch * (height * width) + r * width + c  # [Ho, Wo, C, kh, kw]
    valid = (r >= 0) & (r < height) & (c >= 0) & (c < width)
    flat = torch.where(valid, flat, torch.full_like(flat, -1))
    return flat.reshape(h_out * w_out, channels, kh, kw)


def conv_system(conv: nn.Conv2d, in_shape: tuple[int, ...], weight: torch.Tensor,
                delta: torch.Tensor) -> torch.Tensor:
    """Sparse COO u = [forward rows; weight-gradient rows], [O·Ho·Wo + |W|, C·H·W].

    ``weight`` [O, C, kh, kw]; ``delta`` = ∂L/∂z [O, Ho, Wo]. Row order: forward rows by (o, p),
    then gradient rows in ``weight.flatten()`` order, matching v = [z − b; ∂L/∂W].
    """
    index = patch_index(conv, in_shape, weight.device)  # [P, C, kh, kw]
    out_ch, positions = weight.shape[0], index.shape[0]
    k = index[0].numel()
    cols = index.reshape(1, positions, k).expand(out_ch, positions, k)
    fwd_rows = torch.arange(out_ch * positions, device=weight.device).reshape(out_ch, positions, 1).expand_as(cols)
    fwd_vals = weight.reshape(out_ch, 1, k).expand_as(cols)
    grad_rows = out_ch * positions + torch.arange(out_ch * k, device=weight.device)
    grad_rows = grad_rows.reshape(out_ch, 1, k).expand_as(cols)
    grad_vals = delta.reshape(out_ch, positions, 1).expand_as(cols)
    keep = (cols >= 0).reshape(-1)
    rows = torch.cat([fwd_rows.reshape(-1)[keep], grad_rows.reshape(-1)[keep]])
    columns = torch.cat([cols.reshape(-1)[keep], cols.reshape(-1)[keep]])
    values = torch.cat([fwd_vals.reshape(-1)[keep], grad_vals.reshape(-1)[keep]])
    shape = (out_ch * positions + weight.numel(), math.prod(in_shape))
    return torch.sparse_coo_tensor(torch.stack([rows, columns]), values, shape, check_invariants=False).coalesce()


def visible_inputs(conv: nn.Conv2d, in_shape: tuple[int, ...]) -> int:
    """How many input entries some window touches (strides can skip the last rows/columns)."""
    index = patch_index(conv, in_shape)
    return int(torch.unique(index[index >= 0]).numel())


def gram(u: torch.Tensor) -> np.ndarray:
    """Dense float64 Gram matrix of the smaller side of sparse ``u``, rows scaled to unit norm.

    Row scaling does not change the rank but puts forward rows (≈|W|) and gradient rows (≈|δ|,
    often orders of magnitude smaller) on one footing for a numerical rank decision. Built with
    SciPy's sparse product on the CPU: this is analysis, not the attack's hot path.
    """
    import scipy.sparse as sp

    u = u.coalesce().cpu().double()
    index = u.indices().numpy()
    matrix = sp.csr_matrix((u.values().numpy(), (index[0], index[1])), shape=tuple(u.shape))
    norms = np.sqrt(np.asarray(matrix.multiply(matrix).sum(axis=1)).ravel())
    matrix = sp.diags(1.0 / np.maximum(norms, 1e-300)) @ matrix
    product = matrix.T @ matrix if u.shape[0] >= u.shape[1] else matrix @ matrix.T
    return product.toarray()


def _extreme_ratio(g: np.ndarray, factor: tuple, steps: int = 10) -> float:
    """λ_min/λ_max of SPD ``g`` (``scipy.linalg.cho_factor`` output): power and inverse iteration."""
    from scipy.linalg import cho_solve

    rng = np.random.default_rng(0)
    v = rng.standard_normal((g.shape[0], 4))
    w = v.copy()
    for _ in range(steps):
        v, _ = np.linalg.qr(g @ v)
        w, _ = np.linalg.qr(cho_solve(factor, w, check_finite=False))
    lam_max = float(np.linalg.eigvalsh(v.T @ g @ v).max())
    lam_min = float(np.linalg.eigvalsh(w.T @ g @ w).min())
    return lam_min / lam_max


def numerical_rank(u: torch.Tensor, rtol: float | None = None) -> tuple[int, float]:
    """rank(u) from the row-normalised Gram matrix, and how clear the decision was.

    The Gram matrix squares singular values, so a direction counts when λ/λ_max > rtol
    (default 100·size·ε, i.e. σ/σ_max ≳ 10⁻⁵ for sizes in the thousands). Fast path: a plain
    Cholesky factorisation plus power/inverse iteration certifies full rank; otherwise pivoted
    Cholesky (LAPACK dpstrf) reveals the rank. ``gap`` is (smallest kept)/(largest dropped)
    eigenvalue-like pivot, or λ_min/(λ_max·rtol) at full rank — large means unambiguous.
    """
    from scipy.linalg import cho_factor
    from scipy.linalg.lapack import dpstrf

    g = gram(u)
    size = g.shape[0]
    rtol = rtol if rtol is not None else 100 * size * float(np.finfo(np.float64).eps)
    try:
        factor = cho_factor(g, lower=True, check_finite=False)
    except np.linalg.LinAlgError:
        factor = None
    if factor is not None:
        ratio = _extreme_ratio(g, factor)
        if ratio > rtol:
            return size, ratio / rtol
    tol = rtol * float(np.max(np.diag(g)))
    factor, piv, rank, info = dpstrf(g, tol=tol, lower=1)
    if info < 0:
        raise RuntimeError(f"dpstrf failed (info={info})")
    pivots = np.diag(factor)[:rank] ** 2
    if rank >= size:
        return int(rank), math.inf
    # The next pivot would be the largest diagonal entry of the trailing Schur complement.
    order = piv - 1
    schur = np.diag(g)[order[rank:]] - (np.tril(factor)[rank:, :rank] ** 2).sum(axis=1)
    dropped = max(float(schur.max()), 1e-300)
    return int(rank), float(pivots[-1] / dropped) if rank > 0 else 0.0


@dataclass
class LayerIndex:
    """The linear system of one convolution: sizes, measured rank and the generic count."""

    in_shape: tuple[int, ...]
    n: int  # unknowns nᵢ = C·H·W
    forward_rows: int
    gradient_rows: int
    rank: int
    generic_rank: int
    visible: int  # inputs some window touches
    dependencies: int  # O², the exact forward/gradient relations
    gap: float

    @property
    def rows(self) -> int:
        return self.forward_rows + self.gradient_rows

    @property
    def rank_deficiency(self) -> int:
        return self.rank - self.n

    @property
    def generic_deficiency(self) -> int:
        return self.generic_rank - self.n


@dataclass
class ArchitectureIndex:
    """Seed 002 Table 1 for one model: per-conv-layer rank deficiency and c(M) (Def. 3.3)."""

    layers: list[LayerIndex]
    fc_inputs: list[int] = field(default_factory=list)

    @property
    def rank_deficiency(self) -> list[int]:
        return [layer.rank_deficiency for layer in self.layers]

    @property
    def generic_rank_deficiency(self) -> list[int]:
        return [layer.generic_deficiency for layer in self.layers]

    @property
    def n(self) -> list[int]:
        return [layer.n for layer in self.layers]

    @property
    def rank(self) -> list[int]:
        return [layer.rank for layer in self.layers]

    @property
    def rows(self) -> list[int]:
        return [layer.rows for layer in self.layers]

    @property
    def c(self) -> float:
        return weighted_index(self.rank_deficiency)

    @property
    def generic_c(self) -> float:
        return weighted_index(self.generic_rank_deficiency)

    def table(self) -> str:
        lines = ["layer  n      rows    rank   rd      generic_rd  gap"]
        for i, layer in enumerate(self.layers, start=1):
            lines.append(f"{i:<6} {layer.n:<6} {layer.rows:<7} {layer.rank:<6} {layer.rank_deficiency:<7} "
                         f"{layer.generic_deficiency:<11} {layer.gap:.3g}")
        lines.append(f"c(M) = {self.c:.2f} (generic {self.generic_c:.2f})")
        return "\n".join(lines)


def weighted_index(deficiencies: Sequence[int]) -> float:
    """c(M) = Σᵢ (d − (i − 1))/d · rdᵢ over the d convolutions."""
    d = len(deficiencies)
    return float(sum((d - i) / d * rd for i, rd in enumerate(deficiencies))) if d else 0.0


def forward_trace(model: nn.Module, stages: list[Stage], x: torch.Tensor, labels: torch.Tensor,
                  loss_fn=None) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Inputs, pre-activations z and ∂L/∂z of every stage for a batch ``x`` (batch loss)."""
    inputs, zs = [], []
    h = x
    for stage in stages:
        h = h.reshape(h.shape[0], *stage.in_shape)
        inputs.append(h)
        z = stage.module(h)
        zs.append(z)
        h = z if stage.activation is None else stage.activation(z)
    loss = (loss_fn or F.cross_entropy)(h, labels)
    deltas = torch.autograd.grad(loss, zs)
    return inputs, zs, list(deltas)


def architecture_index(model: nn.Module, input_shape: Sequence[int], *, seed: int = 0,
                       rtol: float | None = None) -> ArchitectureIndex:
    """Per-conv-layer rank(u⁽ⁱ⁾) − nᵢ and c(M) of ``model`` for inputs of ``input_shape``.

    Measured on the model's own weights (copied to float64 on the CPU) with ∂L/∂z of a random
    input in [0, 1) and a random label drawn from ``seed``; the generic count is kept beside it.
    """
    stages = layer_stages(model, input_shape)
    work = copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
    stages = layer_stages(work, input_shape)
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand((1, *input_shape), generator=generator, dtype=torch.float64)
    classes = stages[-1].out_shape[0]
    y = torch.randint(classes, (1,), generator=generator)
    _, _, deltas = forward_trace(work, stages, x, y)
    layers: list[LayerIndex] = []
    fc_inputs: list[int] = []
    for stage, delta in zip(stages, deltas):
        if not stage.is_conv:
            fc_inputs.append(stage.n_inputs)
            continue
        conv = stage.module
        with torch.no_grad():
            u = conv_system(conv, stage.in_shape, conv.weight.detach(), delta[0].detach())
        rank, gap = numerical_rank(u, rtol)
        visible = visible_inputs(conv, stage.in_shape)
        fwd = math.prod(stage.out_shape)
        deps = conv.out_channels ** 2
        generic = min(visible, fwd + conv.weight.numel() - deps)
        layers.append(LayerIndex(stage.in_shape, stage.n_inputs, fwd, conv.weight.numel(), rank, generic,
                                 visible, deps, gap))
    return ArchitectureIndex(layers, fc_inputs)
