"""The one-at-a-time J_iᵀu and K product with convolutions' input gradients as transposed convolutions
(``flguard.risk.transposed_input_grads``) against dense float64 Jacobians, on every convolution setting a user's model
may have: strides that leave a row unreached (output padding), uneven padding, dilation, groups, no bias, 1×1."""

from __future__ import annotations

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from flguard.risk import operator, sample_autograd
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator
from flguard.risk.transposed_input_grads import InputOnly, transposed_input_grads
from risk_reference import dense_jacobians

CONVS = {
    "stride 2, even height": dict(kernel_size=3, stride=2, padding=1),
    "uneven padding, dilation 2": dict(kernel_size=3, padding=(2, 1), dilation=2),
    "groups 2, no bias": dict(kernel_size=3, padding=1, groups=2, bias=False),
    "1×1, stride 2": dict(kernel_size=1, stride=2),
    "5×3, stride (2, 1), reflect": dict(kernel_size=(5, 3), stride=(2, 1), padding=(2, 1), padding_mode="reflect"),
}


def _model(conv: dict) -> nn.Module:
    """conv(3 → 4) → GroupNorm → ReLU → conv(4 → 4, the setting under test) → tanh → pool → linear, float64."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, **conv),
                         nn.Tanh(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3)).double()


@pytest.mark.parametrize("setting", list(CONVS))
def test_one_at_a_time_products_match_the_dense_jacobian(setting):
    model = _model(CONVS[setting])
    torch.manual_seed(1)
    x = torch.randn(2, 3, 8, 9, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 2])
    jac, _ = dense_jacobians(model, x, y)  # [B, dx, dθ] of the batch loss
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    assert op.one_at_a_time and sample_autograd.TRANSPOSED_INPUT_GRADS
    u = torch.randn(2, 1, op.dx, dtype=torch.float64)
    want_jt = torch.einsum("bap,ba->bp", jac, u[:, 0])
    torch.testing.assert_close(op.jt(u)[:, 0], want_jt, rtol=1e-9, atol=1e-12)
    want_k = torch.einsum("bap,bp->ba", jac, want_jt)
    torch.testing.assert_close(op.kmv(u)[:, 0], want_k, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("setting", ["stride 2, even height", "groups 2, no bias", "5×3, stride (2, 1), reflect"])
def test_cached_pullbacks_built_with_transposed_input_grads_match_the_dense_jacobian(setting, monkeypatch):
    """The opt-in ``CACHED_TRANSPOSED_INPUT_GRADS``: the cached (vmapped) Jᵀ pullback built through the rerouted
    convolutions (the function's generated vmap rule) — one and two vectors per sample, the K product, the clipped
    K product — against the dense float64 Jacobian."""
    monkeypatch.setattr(operator, "CACHED_TRANSPOSED_INPUT_GRADS", True)
    entered = []

    def recorded(input_only):
        entered.append(input_only)
        return transposed_input_grads(input_only)
    monkeypatch.setattr(operator, "transposed_input_grads", recorded)
    model = _model(CONVS[setting])
    torch.manual_seed(1)
    x = torch.randn(3, 3, 8, 9, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 2, 1])
    jac, _ = dense_jacobians(model, x, y)
    op = JacobianOperator(model, x, y, products="cached")
    assert not op.direct
    u = torch.randn(3, 2, op.dx, dtype=torch.float64)
    want_jt = torch.einsum("bap,bka->bkp", jac, u)
    torch.testing.assert_close(op.jt(u[:, :1]), want_jt[:, :1], rtol=1e-9, atol=1e-12)
    assert len(entered) == 1  # the pullback was built through the rerouted convolutions, once
    torch.testing.assert_close(op.jt(u), want_jt, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.kmv(u), torch.einsum("bap,bkp->bka", jac, want_jt), rtol=1e-9, atol=1e-12)
    # clipped at the median of the operator's norms, as the guard clips: the middle sample sits at C, unclipped by the
    # guard's rule (‖g_i‖ > C clips, from the norms C came from); the reference's gradients by plain autograd
    guard_norms = op.per_sample_gradients().norm(dim=1)
    clip = float(guard_norms.median())
    clipped, branch = ClippedJacobian(op, clip), guard_norms > clip
    params = list(model.parameters())
    per = torch.stack([torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)]) for i in range(3)])
    norms = per.norm(dim=1)
    assert int(branch.sum()) == 1
    s = torch.where(branch, clip / norms, torch.ones_like(norms))
    unit = torch.where(branch.unsqueeze(1), per / norms.unsqueeze(1), torch.zeros_like(per))
    proj = s.view(-1, 1, 1) * (torch.eye(op.dtheta, dtype=torch.float64) - unit.unsqueeze(2) * unit.unsqueeze(1))
    bar = jac @ proj  # [B, dx, dθ]: J_i s_i(I − ĝ_iĝ_iᵀ) (J_i in the batch loss's scale)
    want_k = torch.einsum("bap,bcp,bkc->bka", bar, bar, u)
    torch.testing.assert_close(clipped.kmv(u), want_k, rtol=1e-9, atol=1e-12)


def test_the_convolutions_are_rerouted_and_the_first_pass_skips_the_weights():
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1).double()
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    input_only = InputOnly()
    with transposed_input_grads(input_only):
        out = conv(x)
    assert "_Conv2d" in type(out.grad_fn).__name__  # rerouted, not PyTorch's own convolution node
    want = F.conv2d(x, conv.weight, conv.bias, 2, 1)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    with input_only():
        (gx,) = torch.autograd.grad(out, x, g, create_graph=True)
    (want_gx,) = torch.autograd.grad(want, x, g, create_graph=True)
    torch.testing.assert_close(gx, want_gx)
    # recorded as a transposed convolution (not as convolution_backward, whose node is ConvolutionBackwardBackward0)
    assert type(gx.grad_fn).__name__ == "ConvolutionBackward0" and gx.grad_fn._saved_transposed
    # the second derivative through the rerouted input gradient equals PyTorch's
    v = torch.randn_like(gx)
    got = torch.autograd.grad((gx * v).sum(), conv.weight, retain_graph=True)[0]
    torch.testing.assert_close(got, torch.autograd.grad((want_gx * v).sum(), conv.weight)[0])
    # outside the first pass the weights' gradients are formed again
    gw = torch.autograd.grad(conv(x).sum(), conv.weight)[0]
    with transposed_input_grads(input_only):
        torch.testing.assert_close(torch.autograd.grad(conv(x).sum(), conv.weight)[0], gw)
