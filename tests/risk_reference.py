"""Independent dense references for the risk engine: J_i built column by column with autograd."""

from __future__ import annotations

import math

import torch
from torch import nn

from flguard.risk.operator import JacobianOperator


def dense_jacobians(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """J [B, dx, dθ] with J[i, a, p] = ∂/∂x_i[a] ∂L(X)/∂θ_p, and the batch gradient g [dθ].

    Built by one autograd call per parameter coordinate: slow and obviously correct.
    """
    loss_fn = loss_fn or nn.functional.cross_entropy
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = x.detach().clone().requires_grad_(True)
    loss = loss_fn(model(inputs), y)
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params, create_graph=True)])
    columns = []
    for p in range(g.numel()):
        gx = torch.autograd.grad(g[p], inputs, retain_graph=True, allow_unused=True)[0]
        columns.append(torch.zeros_like(inputs) if gx is None else gx)
    jac = torch.stack([c.reshape(len(x), -1) for c in columns], dim=2)
    return jac.detach(), g.detach()


def dense_metrics(jac: torch.Tensor, g: torch.Tensor, delta: torch.Tensor | None = None, eps=None) -> dict:
    """Every RiskReport number from dense matrices with eigh / solve / trace."""
    kernel = jac @ jac.transpose(1, 2)
    lam = torch.linalg.eigvalsh(kernel)
    g_hat = g / g.norm()
    proj = torch.eye(len(g), dtype=g.dtype) - torch.outer(g_hat, g_hat)
    h_cos = jac @ proj @ jac.transpose(1, 2) / g.dot(g)
    mu = torch.linalg.eigvalsh(h_cos)
    out = {"lambda_max": lam[:, -1], "lambda_min": lam[:, 0].clamp_min(0), "eigenvalues": lam,
           "jacobian_fro2": kernel.diagonal(dim1=1, dim2=2).sum(-1),
           "lavp_cos_max": mu[:, -1], "lavp_cos_min": mu[:, 0].clamp_min(0)}
    out["lavp_fusion"] = (out["lambda_max"] * out["lavp_cos_min"]).sqrt()
    if delta is not None:
        b = jac @ delta
        dx = jac.shape[1]
        eye = torch.eye(dx, dtype=jac.dtype)
        eps_t = torch.as_tensor(eps, dtype=jac.dtype).expand(len(jac))
        sol = torch.linalg.solve(kernel + eps_t.view(-1, 1, 1) * eye, b.unsqueeze(-1)).squeeze(-1)
        out["i2f"] = sol.norm(dim=1)
        out["i2f_lb"] = b.norm(dim=1) / out["lambda_max"]
        out["rmse_i2f"] = out["i2f"] / dx**0.5
        out["rmse_i2f_lb"] = out["i2f_lb"] / dx**0.5
    return out


def tiny_conv_problem(batch: int = 3, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 conv → tanh → linear net on 6×6 inputs with 3 classes, a random batch and labels:
    small enough for dense Jacobians, with a real convolution in it."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)).double()
    x = torch.randn(batch, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (batch,))
    return model, x, y


def outlier_kernels(batch: int = 4, dx: int = 200, top: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense PSD K_i [B, dx, dx] with ``top`` large eigenvalues (a conv net's per-sample spectrum: a
    few outliers, then a tail far below them) and right-hand sides in their range [B, dx], float64."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(batch, dx, dx, generator=gen, dtype=torch.float64))[0]
    values = 1e-4 * torch.rand(batch, dx, generator=gen, dtype=torch.float64)
    values[:, :top] = torch.logspace(0, -2, top, dtype=torch.float64)
    kernel = (basis * values.unsqueeze(1)) @ basis.transpose(1, 2)
    rhs = torch.einsum("bij,bj->bi", kernel, torch.randn(batch, dx, generator=gen, dtype=torch.float64))
    return kernel, rhs


def dense_shifted_solve(kernel: torch.Tensor, rhs: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """(K_i + ε_iI)⁻¹ rhs_i by ``torch.linalg.solve``."""
    eye = torch.eye(kernel.shape[1], dtype=kernel.dtype)
    return torch.linalg.solve(kernel + eps.view(-1, 1, 1) * eye, rhs.unsqueeze(-1)).squeeze(-1)


def residual_ball_of(iterate: torch.Tensor, rhs: torch.Tensor, apply, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(centre, radius) recomputed here from a solver's ``iterate``: its TRUE residual r = rhs − (K+εI)x by
    ``apply`` (x ↦ Kx), centre x + r/(2ε), radius ‖r‖/(2ε) — what a verified solver must return."""
    r = rhs - apply(iterate) - eps.unsqueeze(1) * iterate
    return iterate + r / (2 * eps.unsqueeze(1)), r.norm(dim=1) / (2 * eps)


def assert_reported_rmse(report, dense: torch.Tensor, rtol: float, where: torch.Tensor | None = None,
                         solver_rtol: float | None = None) -> None:
    """The guard's ``rmse_after`` against a dense recomputation: within the report's own per-sample
    ``rmse_error`` (the noise scale × the solver's verified error bound) and ``rtol`` of rounding —
    a sample the solver stopped early reports its value to its own accuracy, the binding one to rtol.
    The error bound must also be non-trivial where it matters: the least-protected sample's is within
    the solver's tolerance (``solver_rtol``, the guard's rtol; default ``rtol``)."""
    reported, error = report.rmse_after.double().cpu(), report.rmse_error.double().cpu()  # a CUDA guard's too
    dense = dense.double()
    if where is not None:
        where = where.cpu()
        reported, error, dense = reported[where], error[where], dense[where]
    assert torch.all((reported - dense).abs() <= error + rtol * dense), (reported, dense, error)
    binding = int(dense.argmin())
    assert float(error[binding]) <= (solver_rtol or rtol) * float(dense[binding]), (error, dense)


def per_sample_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∇_θ ℓ(f(x_i), y_i) [B, dθ] for the cross-entropy of each sample alone, by autograd one sample at a time."""
    from torch.func import functional_call, grad

    params = {n: p.detach() for n, p in model.named_parameters()}
    rows = []
    for i in range(x.shape[0]):
        tree = grad(lambda p: nn.functional.cross_entropy(functional_call(model, p, x[i:i + 1]), y[i:i + 1]))(params)
        rows.append(torch.cat([t.reshape(-1) for t in tree.values()]))
    return torch.stack(rows)


def resnet8_gn_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(model, x, y, per-sample gradients): the zoo's 3-channel GroupNorm ResNet-8 in float64 on eight 6×6 inputs,
    seeded — the guard's clip-level and damage tests' batch."""
    from flguard.models import create

    torch.manual_seed(0)
    model = create("resnet8_gn", image_size=6).double()
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.arange(8) % 10
    return model, x, y, per_sample_gradients(model, x, y)


def sample_gradient(model, forward, params, xi, yi, i):
    """∇θ ℓ(x_i) flat, with ``forward(params, x_i[None], i)`` the model on sample i (None: the model itself)."""
    from torch.func import functional_call, grad

    run = forward or (lambda ps, inputs, _: functional_call(model, ps, (inputs,)))
    tree = grad(lambda ps: nn.functional.cross_entropy(run(ps, xi.unsqueeze(0), i), yi.unsqueeze(0)))(params)
    return torch.cat([t.reshape(-1) for t in tree.values()])


def step_reading_masks(model, optimizer, criterion, x, y, read_masks):
    """One ``make_guarded`` step of ``model`` on (x, y) with the masks of the user's own pass read off its dropout
    layers (``read_masks()`` → (the masks it fills, its hook handles), removed before the step); (its report, which
    must be met, and the masks)."""
    seen, handles = read_masks()
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    for handle in handles:
        handle.remove()
    optimizer.step()
    report = optimizer.guard_reports[-1]
    assert report.met, report.reason
    return report, seen


def assert_products_match_dense(op, jac: torch.Tensor, vectors: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator's J_iv, J_iᵀu and K_iu against dense J [B, dx, dθ] (float64, 1e-9) on seeded random vectors, so
    many per sample; returns (v, u) for further checks."""
    g = torch.Generator().manual_seed(1)
    batch = jac.shape[0]
    v = torch.randn(batch, vectors, op.dtheta, generator=g, dtype=torch.float64)
    u = torch.randn(batch, vectors, op.dx, generator=g, dtype=torch.float64)
    close = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.j(v), torch.einsum("bap,bkp->bka", jac, v), **close)
    torch.testing.assert_close(op.jt(u), torch.einsum("bap,bka->bkp", jac, u), **close)
    torch.testing.assert_close(op.kmv(u), torch.einsum("bap,bcp,bkc->bka", jac, jac, u), **close)
    return v, u


def clipped_upload_jacobians(model, x, y, clip, clipped, forward=None):
    """Dense J̄_i [dx, dθ] (θ: the trainable parameters) of sample i's clipped term (1/B)·clip_C(∇θℓ(x_i)), C fixed:
    forward-mode columns (one per input coordinate) of the plain per-sample gradient map, written independently.
    ``clipped`` (one bool per sample) fixes each sample's branch as the guard decides it (clipped iff ‖g_i‖ > C): at a
    median clip level one sample's norm is C itself, and ``clamp(C/‖g‖, max=1)`` would pick its branch by the last bit of
    the norm recomputed here (PyTorch 2.11 and 2.14 picked differently). ``forward(params, x_i[None], i)``: sample i's
    own forward pass (a dropout model's, with its masks fixed; None: the model's)."""
    from torch.func import jacfwd

    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}  # the others: the model's

    def term(xi, i):
        g = sample_gradient(model, forward, params, xi, y[i], i)
        return (g * (clip / g.norm()) if bool(clipped[i]) else g) / len(x)

    return torch.stack([jacfwd(lambda xi: term(xi, i))(x[i].contiguous()).reshape(  # noqa: B023 (called at once)
        -1, x[i].numel()).T for i in range(len(x))])


def assert_certified_on_dense_float64(model, x, y, config, report, forward=None):
    """The noise in the model's ``.grad`` (the sent update less the kept samples' clipped gradients at the median
    clip level) gives every kept sample a dense-recomputed, box-clipped I²F RMSE ≥ τ, and the report agrees.
    ``forward``: as ``clipped_upload_jacobians``' (the per-sample gradients are then recomputed with it too)."""
    sent = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    if forward is None:
        per = JacobianOperator(model, x, y).per_sample_gradients()
    else:
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        per = torch.stack([sample_gradient(model, forward, params, x[i], y[i], i) for i in range(len(x))])
    norms = per.norm(dim=1)
    clip = float(norms.median())
    kept = torch.isfinite(report.rmse_after).cpu()
    factor = torch.clamp(clip / norms, max=1.0)
    noise = sent - (per * factor.unsqueeze(1))[kept].sum(0) / len(x)
    jac = clipped_upload_jacobians(model, x, y, clip, norms > clip, forward)
    kernel = jac @ jac.transpose(1, 2)
    lam = torch.linalg.eigvalsh(kernel)[:, -1]
    eps = config.eps * lam
    b = jac @ noise
    shift = torch.zeros_like(b)  # a left-out sample's block may be zero (no gradient): solved for the kept ones
    shift[kept] = torch.linalg.solve(kernel[kept] + eps[kept].view(-1, 1, 1) * torch.eye(kernel.shape[1],
                                                                                         dtype=kernel.dtype),
                                     b[kept].unsqueeze(-1)).squeeze(-1)
    low = ((0 - torch.tensor(config.pixel_mean)) / torch.tensor(config.pixel_std)).view(1, 3, 1, 1).double()
    high = ((1 - torch.tensor(config.pixel_mean)) / torch.tensor(config.pixel_std)).view(1, 3, 1, 1).double()
    moved = torch.clamp(x + shift.view_as(x), low, high) - x
    rmse = moved.flatten(1).norm(dim=1) / math.sqrt(shift.shape[1])
    assert bool((rmse[kept] >= config.floor).all()), (rmse, config.floor)
    assert_reported_rmse(report, rmse, rtol=3 * config.rtol, where=kept)
