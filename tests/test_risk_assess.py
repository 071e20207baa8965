"""assess() against dense float64 references (autograd Jacobians + eigh/solve/trace)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flguard.risk import assess
from flguard.risk.closed_forms import expected_i2f_sq
from flguard.risk.operator import JacobianOperator
from risk_reference import dense_jacobians, dense_metrics

RTOL = 1e-3


def _linear():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 3))


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 3))


def _conv():
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(3 * 2 * 2, 3))


def _batchnorm():
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 2 * 2, 3))


MODELS = {"linear": _linear, "mlp": _mlp, "conv": _conv, "batchnorm-train": _batchnorm}


def _problem(name: str, batch: int, dtype=torch.float64):
    torch.manual_seed(1)
    model = MODELS[name]().to(dtype)
    x = torch.randn(batch, 1, 4, 4, dtype=dtype)
    y = torch.randint(0, 3, (batch,))
    return model, x, y


def _check_all(rep, ref, scale_dtype_tol=1.0):
    lam_max = ref["lambda_max"]
    torch.testing.assert_close(rep.lambda_max, lam_max, rtol=RTOL * scale_dtype_tol, atol=0)
    assert torch.all((rep.lambda_min - ref["lambda_min"]).abs() <= RTOL * lam_max * scale_dtype_tol)
    torch.testing.assert_close(rep.lavp_cos_max, ref["lavp_cos_max"], rtol=RTOL * scale_dtype_tol, atol=0)
    assert torch.all((rep.lavp_cos_min - ref["lavp_cos_min"]).abs() <= RTOL * ref["lavp_cos_max"] * scale_dtype_tol)
    torch.testing.assert_close(rep.jacobian_fro2, ref["jacobian_fro2"], rtol=1e-2, atol=0)
    torch.testing.assert_close(rep.i2f_lb, ref["i2f_lb"], rtol=2 * RTOL * scale_dtype_tol, atol=0)
    torch.testing.assert_close(rep.rmse_i2f_lb, ref["rmse_i2f_lb"], rtol=2 * RTOL * scale_dtype_tol, atol=0)
    torch.testing.assert_close(rep.i2f, ref["i2f"], rtol=1e-2, atol=0)
    torch.testing.assert_close(rep.rmse_i2f, ref["rmse_i2f"], rtol=1e-2, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("batch", [1, 3])
def test_every_field_matches_dense_reference(name, batch):
    model, x, y = _problem(name, batch)
    if name == "batchnorm-train" and batch == 1:
        pytest.skip("train-mode BatchNorm needs more than one sample")
    jac, g = dense_jacobians(model, x, y)
    delta = 0.1 * torch.randn(jac.shape[2], dtype=x.dtype)
    eps = 0.05 * float(torch.linalg.eigvalsh(jac @ jac.transpose(1, 2))[:, -1].mean())
    ref = dense_metrics(jac, g, delta, eps)
    rep = assess(model, x, y, delta=delta, eps=eps)
    assert rep.path == ("coupled" if name == "batchnorm-train" else "per-sample")
    assert bool(rep.converged.all())
    _check_all(rep, ref)
    per_sample = torch.stack([torch.cat([p.reshape(-1) for p in torch.autograd.grad(
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))])
        for i in range(batch)]) if name != "batchnorm-train" else None
    if per_sample is not None:
        torch.testing.assert_close(rep.grad_norm, per_sample.norm(dim=1), rtol=1e-10, atol=0)
    torch.testing.assert_close(rep.eps, torch.full((batch,), eps, dtype=x.dtype))


def test_batchnorm_train_mode_leaves_running_stats_alone():
    model, x, y = _problem("batchnorm-train", 4)
    before = [b.clone() for b in model.buffers()]
    assess(model, x, y, metrics=("lambda_max",))
    for old, new in zip(before, model.buffers()):
        assert torch.equal(old, new)


def test_float32_matches_float64_reference():
    model, x, y = _problem("conv", 3)
    jac, g = dense_jacobians(model, x, y)
    delta = 0.1 * torch.randn(jac.shape[2], dtype=x.dtype)
    ref = dense_metrics(jac, g, delta, eps=1e-3)
    rep = assess(model.float(), x.float(), y, delta=delta.float(), eps=1e-3)
    assert rep.lambda_max.dtype == torch.float32
    _check_all(_as64(rep), ref, scale_dtype_tol=5.0)


def _as64(rep):
    for name, value in rep.metrics().items():
        setattr(rep, name, value.double())
    return rep


def test_default_eps_is_relative_to_lambda_max():
    from flguard.risk import DEFAULT_EPS_RELATIVE

    model, x, y = _problem("mlp", 2)
    delta = torch.randn(sum(p.numel() for p in model.parameters()), dtype=x.dtype)
    rep = assess(model, x, y, delta=delta, metrics=("i2f", "lambda_max"))
    torch.testing.assert_close(rep.eps, DEFAULT_EPS_RELATIVE * rep.lambda_max)
    jac, g = dense_jacobians(model, x, y)
    ref = dense_metrics(jac, g, delta, eps=rep.eps)
    torch.testing.assert_close(rep.i2f, ref["i2f"], rtol=1e-2, atol=0)


def test_only_requested_metrics_are_computed():
    model, x, y = _problem("mlp", 2)
    full = assess(model, x, y)
    only = assess(model, x, y, metrics=("lambda_max",))
    assert only.lambda_min is None and only.lavp_cos_max is None and only.jacobian_fro2 is None and only.i2f is None
    torch.testing.assert_close(only.lambda_max, full.lambda_max, rtol=RTOL, atol=0)
    assert 0 < only.matvecs < full.matvecs


def test_eps_zero_i2f_is_invariant_to_the_batch_mean_factor():
    """J_i of the mean loss is J̃_i/B; an attacker rescales by B, so I(δ) with the mean loss equals
    I(Bδ) with the summed loss when ε = 0."""
    model, x, y = _problem("mlp", 3)
    delta = 0.1 * torch.randn(sum(p.numel() for p in model.parameters()), dtype=x.dtype)
    mean = assess(model, x, y, delta=delta, eps=0.0, metrics=("i2f",), rtol=1e-6)
    summed = assess(model, x, y, delta=3 * delta, eps=0.0, metrics=("i2f",), rtol=1e-6,
                    loss_fn=lambda z, t: nn.functional.cross_entropy(z, t, reduction="sum"))
    torch.testing.assert_close(mean.i2f, summed.i2f, rtol=1e-4, atol=0)
    jac, g = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    exact = torch.linalg.lstsq(kernel, (jac @ delta).unsqueeze(-1)).solution.squeeze(-1).norm(dim=1)
    torch.testing.assert_close(mean.i2f, exact, rtol=1e-3, atol=0)


def test_gaussian_closed_form_matches_monte_carlo():
    model, x, y = _problem("conv", 2)
    jac, _ = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    lam = torch.linalg.eigvalsh(kernel)
    sigma, eps = 0.3, 0.1 * float(lam[:, -1].mean())
    draws = sigma * torch.randn(20000, jac.shape[2], dtype=x.dtype, generator=torch.Generator().manual_seed(0))
    inverse = torch.linalg.inv(kernel + eps * torch.eye(jac.shape[1], dtype=x.dtype))
    values = torch.einsum("bij,bjp,np->nbi", inverse, jac, draws).pow(2).sum(-1).mean(0)
    torch.testing.assert_close(expected_i2f_sq(lam, sigma, eps), values, rtol=3e-2, atol=0)
    # and assess's I2F of one draw agrees with the dense value of that draw
    rep = assess(model, x, y, delta=draws[0], eps=eps, metrics=("i2f",))
    dense = torch.einsum("bij,bjp,p->bi", inverse, jac, draws[0]).norm(dim=1)
    torch.testing.assert_close(rep.i2f, dense, rtol=1e-2, atol=0)


@pytest.mark.parametrize("name,coupled,products,chunk", [("conv", False, "cached", 2), ("conv", False, "direct", 2),
                                                         ("conv", False, "direct", 1), ("conv", True, "auto", 2),
                                                         ("batchnorm-train", True, "auto", 2)])
def test_operator_products_equal_dense_jacobian_products(name, coupled, products, chunk):
    """J_iᵀu and J_i v with several vectors per sample, called repeatedly (the cached path reuses one
    pullback; the direct path, for large B·dθ, recomputes per sample in vmapped chunks, or one sample at
    a time with plain autograd), against the dense autograd Jacobian."""
    model, x, y = _problem(name, 3)
    jac, _ = dense_jacobians(model, x, y)
    op = JacobianOperator(model, x, y, coupled=coupled, products=products)
    assert op.coupled == coupled and op.direct == (products == "direct")
    op.sample_chunk = chunk  # two chunks of samples (1 + 2 would hide a chunk boundary bug in one call)
    assert op.one_at_a_time == (products == "direct" and chunk == 1)
    for _ in range(2):
        u = torch.randn(3, 4, op.dx, dtype=x.dtype)
        v = torch.randn(3, 2, op.dtheta, dtype=x.dtype)
        torch.testing.assert_close(op.jt(u), torch.einsum("bkd,bdp->bkp", u, jac), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(op.j(v), torch.einsum("bdp,bkp->bkd", jac, v), rtol=1e-10, atol=1e-12)
    assert op.applications == 2 * (4 + 2)


@pytest.mark.parametrize("after_a_product", [False, True])
@pytest.mark.parametrize("products", ["cached", "direct", "direct-1"])
def test_per_sample_gradients_match_one_backward_per_sample(after_a_product, products):
    """The cached path reads them off the J pullback's primal output, the direct one vmaps them (or takes
    them one sample at a time): equal to a loop of autograd calls on each sample's own loss, whether or
    not a J product came first."""
    model, x, y = _problem("conv", 3)
    op = JacobianOperator(model, x, y, products=products.split("-")[0])
    if products == "direct-1":
        op.sample_chunk = 1
        assert op.one_at_a_time
    if after_a_product:
        op.j(torch.randn(3, 1, op.dtheta, dtype=x.dtype))
    params = [p for p in model.parameters()]
    loop = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)]) for i in range(3)])
    torch.testing.assert_close(op.per_sample_gradients(), loop, rtol=1e-10, atol=1e-12)


def test_direct_chunks_take_a_share_of_a_cuda_devices_free_memory(monkeypatch):
    """On the CPU a chunk holds ⌊min(CACHED_UP_TO, DIRECT_CHUNK_FLOATS)/dθ⌋ samples (a ResNet-18's 11.2 M
    parameters: 1); on a CUDA device as many as CUDA_CHUNK_SHARE of its free memory holds at
    DIRECT_FLOATS_PER_PARAMETER floats per sample and parameter, never more than the batch."""
    from flguard.risk import sizing
    from flguard.risk.sizing import direct_sample_chunk
    resnet18 = 11_173_962
    assert direct_sample_chunk(resnet18, 32, torch.device("cpu")) == 1
    assert direct_sample_chunk(272_474, 32, torch.device("cpu")) == 32  # ⌊2^24 / dθ⌋ = 61, capped at B
    assert direct_sample_chunk(272_474, 100, torch.device("cpu")) == 61
    free = 16 * 2 ** 30  # a 16 GiB card: 2 GiB for a chunk, 32 bytes per sample and parameter
    monkeypatch.setattr(sizing.torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    assert direct_sample_chunk(resnet18, 64, torch.device("cuda")) == 2 ** 31 // (32 * resnet18) == 6
    assert direct_sample_chunk(resnet18, 4, torch.device("cuda")) == 4
    assert direct_sample_chunk(resnet18, 64, torch.device("cuda"), element_size=8) == 3
    free = 2 ** 20  # almost nothing free: the CPU's chunk is the least
    assert direct_sample_chunk(272_474, 100, torch.device("cuda")) == 61


def test_auto_keeps_the_cached_pullbacks_where_a_cuda_devices_memory_holds_them(monkeypatch):
    """"auto" takes the cached path while B·dθ ≤ CACHED_UP_TO floats; on a CUDA device also while
    B·dθ·CACHED_FLOATS_PER_PARAMETER floats fit in CUDA_CACHED_SHARE (a quarter) of its free memory: a
    ResNet-18 at B = 32 (11.4 GB) is cached on an 80 GB card, direct on a 16 GB one, where B = 8 (2.9 GB)
    is cached in float32 and direct in float64 (5.7 GB against 4 GB)."""
    from flguard.risk import sizing
    from flguard.risk.sizing import takes_cached
    resnet18, cpu, cuda = 11_173_962, torch.device("cpu"), torch.device("cuda")
    assert takes_cached(272_474, 32, cpu) and not takes_cached(resnet18, 8, cpu)
    for gib, b32, b8 in ((80, True, True), (16, False, True)):
        monkeypatch.setattr(sizing.torch.cuda, "mem_get_info", lambda device, free=gib * 2 ** 30: (free, free))
        assert takes_cached(resnet18, 32, cuda) is b32 and takes_cached(resnet18, 8, cuda) is b8
    assert not takes_cached(resnet18, 8, cuda, element_size=8)  # float64 on the 16 GB card: twice the bytes
    assert takes_cached(272_474, 32, cuda)  # under CACHED_UP_TO whatever the memory
    monkeypatch.setattr(sizing, "CUDA_CACHED_SHARE", 0.0)
    monkeypatch.setattr(sizing.torch.cuda, "mem_get_info", lambda device: (80 * 2 ** 30, 80 * 2 ** 30))
    assert not takes_cached(resnet18, 8, cuda)


def test_cached_products_fall_back_on_the_direct_path_when_the_device_runs_out_of_memory(monkeypatch):
    """Building the cached pullbacks can run a CUDA device out of memory where ``takes_cached``'s count of
    parameters misses large activations: the product is then taken on the direct path, exactly, and the
    operator stays there (its K products too)."""
    model, x, y = _problem("conv", 3)
    jac, _ = dense_jacobians(model, x, y)

    def out_of_memory(self):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    for build, product, shape in (("_transpose_pullback", "jt", "dx"), ("_pullback", "j", "dtheta")):
        op = JacobianOperator(model, x, y)
        assert not op.direct
        monkeypatch.setattr(JacobianOperator, build, out_of_memory)
        w = torch.randn(3, 2, getattr(op, shape), dtype=x.dtype)
        reference = torch.einsum("bdp,bkd->bkp" if product == "jt" else "bdp,bkp->bkd", jac, w)
        torch.testing.assert_close(getattr(op, product)(w), reference, rtol=1e-10, atol=1e-12)
        assert op.direct and op.applications == 2  # two vectors per sample, charged once
        u = torch.randn(3, 1, op.dx, dtype=x.dtype)
        torch.testing.assert_close(op.kmv(u), torch.einsum("bdp,bep,bke->bkd", jac, jac, u), rtol=1e-10, atol=1e-12)
        monkeypatch.undo()
    op = JacobianOperator(model, x, y)
    monkeypatch.setattr(JacobianOperator, "_pullback", out_of_memory)
    loop = JacobianOperator(model, x, y, products="direct").per_sample_gradients()
    torch.testing.assert_close(op.per_sample_gradients(), loop, rtol=1e-10, atol=1e-12)
    assert op.direct
    monkeypatch.undo()
    from flguard.risk import operator  # the summed Jᵀ product's whole-batch pass, then in the direct path's chunks
    op, calls, grad = JacobianOperator(model, x, y), [], operator.grad

    def grad_running_out_once(*args, **kwargs):
        calls.append(1)
        return out_of_memory(None) if len(calls) == 1 else grad(*args, **kwargs)

    monkeypatch.setattr(operator, "grad", grad_running_out_once)
    u = torch.randn(3, op.dx, dtype=x.dtype)
    torch.testing.assert_close(op.jt_sum(u), torch.einsum("bdp,bd->p", jac, u), rtol=1e-10, atol=1e-12)
    assert op.direct and op.applications == 1


def test_auto_products_go_direct_above_the_size_limit(monkeypatch):
    """"auto" keeps the cached pullbacks while B·dθ ≤ CACHED_UP_TO floats, then goes direct in chunks
    of ⌊min(CACHED_UP_TO, DIRECT_CHUNK_FLOATS)/dθ⌋ samples; both give the dense Jacobian's products."""
    from flguard.risk import sizing
    model, x, y = _problem("conv", 3)
    jac, _ = dense_jacobians(model, x, y)
    dtheta = sum(p.numel() for p in model.parameters())
    assert not JacobianOperator(model, x, y).direct
    monkeypatch.setattr(sizing, "CACHED_UP_TO", 2 * dtheta)
    op = JacobianOperator(model, x, y)
    assert op.direct and op.sample_chunk == 2
    u = torch.randn(3, 1, op.dx, dtype=x.dtype)
    torch.testing.assert_close(op.kmv(u), torch.einsum("bdp,bep,bke->bkd", jac, jac, u), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="products"):
        JacobianOperator(model, x, y, products="fast")


def test_forced_coupled_path_agrees_with_per_sample_path():
    model, x, y = _problem("conv", 3)
    delta = torch.randn(sum(p.numel() for p in model.parameters()), dtype=x.dtype)
    fast = assess(model, x, y, delta=delta, eps=1e-3)
    slow = assess(model, x, y, delta=delta, eps=1e-3, coupled=True)
    for name in ("lambda_max", "i2f_lb", "i2f", "lavp_cos_max", "grad_norm"):
        torch.testing.assert_close(getattr(fast, name), getattr(slow, name), rtol=1e-2, atol=0)


def test_bad_arguments_are_clear_errors():
    model, x, y = _problem("mlp", 2)
    with pytest.raises(ValueError, match="unknown"):
        assess(model, x, y, metrics=("lambda_maxx",))
    with pytest.raises(ValueError, match="need delta"):
        assess(model, x, y, metrics=("i2f",))
    with pytest.raises(ValueError, match="delta must be a flat tensor"):
        assess(model, x, y, delta=torch.zeros(3, dtype=x.dtype))
    dropout = nn.Sequential(nn.Flatten(), nn.AlphaDropout(0.5), nn.Linear(16, 3)).double().train()
    with pytest.raises(ValueError, match="AlphaDropout"):
        assess(dropout, x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    model, x, y = _problem("conv", 3)
    delta = torch.randn(sum(p.numel() for p in model.parameters()), dtype=x.dtype)
    cpu = assess(model, x, y, delta=delta, eps=1e-3)
    gpu = assess(model.cuda(), x.cuda(), y.cuda(), delta=delta.cuda(), eps=1e-3)
    for name, value in cpu.metrics().items():
        torch.testing.assert_close(getattr(gpu, name).cpu(), value, rtol=1e-2, atol=1e-12)


@pytest.mark.parametrize("products", ["cached", "direct", "direct-1"])
def test_an_operator_is_freed_by_reference_counting(products):
    """No reference cycle through an operator after its products (cached, vmapped, one sample at a time):
    with Python's cyclic collector off it is freed as soon as it is dropped, with its per-sample gradients
    (a cycle left [B, dθ] to the collector: 0.36 GB a step on a ResNet-18 at B = 8)."""
    import gc
    import weakref

    from flguard.risk.clipped import ClippedJacobian

    model, x, y = _problem("conv", 3)
    op = JacobianOperator(model, x, y, products=products.split("-")[0])
    if products == "direct-1":
        op.sample_chunk = 1
    clipped = ClippedJacobian(op, float(op.per_sample_gradients().norm(dim=1).median()))
    u = torch.randn(3, 1, op.dx, dtype=x.dtype)
    clipped.kmv(u), clipped.jt_sum(u[:, 0]), clipped.j(torch.randn(3, 1, op.dtheta, dtype=x.dtype)), op.jt(u)
    alive = weakref.ref(op)
    gc.disable()
    try:
        del op, clipped
        assert alive() is None
    finally:
        gc.enable()
