"""Few-channel convolutions under ``vmap`` as unfold + batched matmul (``flguard.risk.unfolded_convs``): the rewrite
against PyTorch's convolution on every setting it accepts, which convolutions it takes, and the operator's cached Jᵀ,
J and K products built through it against dense float64 Jacobians."""

from __future__ import annotations

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from torch.func import vmap

from flguard.risk import unfolded_convs
from flguard.risk.operator import JacobianOperator
from flguard.risk.unfolded_convs import unfolded_conv2d, unfolded_per_sample_convs
from risk_reference import dense_jacobians

SETTINGS = {
    "3×3, padding 1": dict(stride=1, padding=1, dilation=1),
    "stride 2 leaving a row": dict(stride=2, padding=1, dilation=1),
    "5×3 kernel, uneven padding, dilation 2": dict(stride=(1, 2), padding=(2, 1), dilation=2),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("bias", [True, False])
def test_the_unfolded_convolution_is_pytorchs(setting, bias):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 9, 8, dtype=torch.float64)
    kernel = (5, 3) if "5×3" in setting else (3, 3)
    weight = torch.randn(6, 4, *kernel, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64) if bias else None
    want = F.conv2d(x, weight, b, **SETTINGS[setting])
    got = unfolded_conv2d(x, weight, b, **SETTINGS[setting])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    original = unfolded_convs.unfolded_conv2d

    def counted(x, weight, *rest):
        calls.append(tuple(weight.shape))
        return original(x, weight, *rest)
    monkeypatch.setattr(unfolded_convs, "unfolded_conv2d", counted)
    return calls


def test_only_few_channel_convolutions_with_a_weight_per_sample_and_image_layers_are_rewritten(monkeypatch):
    """Under vmap: a 3 → 8 layer with a weight per sample is unfolded (equal to the grouped convolution), and so is a
    3-channel image layer with one weight for the batch inside ``grad`` (the J pullback's form); a 16 → 16 layer
    with a weight per sample is not, nor a shared weight on 16 channels, nor a layer whose patches would exceed the
    budget, nor anything outside the context, outside vmap or off the CPU."""
    calls = _counting(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 7, 7, dtype=torch.float64)
    few = torch.randn(4, 8, 3, 3, 3, dtype=torch.float64)  # one 3 → 8 weight per sample
    wide = torch.randn(4, 16, 16, 3, 3, dtype=torch.float64)
    xw = torch.randn(4, 16, 7, 7, dtype=torch.float64)

    def per_sample(xi, wi):
        return F.conv2d(xi.unsqueeze(0), wi, padding=1)[0]

    def weight_gradient(xi, wi):  # a shared weight inside grad under vmap: the cached J pullback's form
        return torch.func.grad(lambda w: per_sample(xi, w).square().sum())(wi)
    want = torch.stack([per_sample(xi, wi) for xi, wi in zip(x, few)])
    want_grad = torch.stack([weight_gradient(xi, few[0]) for xi in x])
    with unfolded_per_sample_convs(torch.device("cpu")):
        got = vmap(per_sample)(x, few)
        assert calls == [(8, 3, 3, 3)]
        got_grad = vmap(lambda xi: weight_gradient(xi, few[0]))(x)
        assert calls == [(8, 3, 3, 3)] * 2
        vmap(per_sample)(xw, wide)  # 16 channels in and out: PyTorch's grouped kernel
        big = torch.randn(2, 3, 600, 600, dtype=torch.float64)  # 27 × 600² floats of patches per sample: too many
        vmap(per_sample)(big, few[:2])
        vmap(lambda xi: weight_gradient(xi, wide[0]))(xw)  # a shared weight on 16 input channels
        F.conv2d(x, few[0], padding=1)  # no vmap
    assert len(calls) == 2
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    vmap(per_sample)(x, few)  # outside the context
    with unfolded_per_sample_convs(torch.device("meta")):  # another device: not rewritten
        vmap(per_sample)(x, few)
    assert len(calls) == 2


def _resnet_shaped() -> nn.Module:
    """A 3-channel ResNet-shaped block with few channels: a stem, a residual pair with GroupNorm, a strided 5×5
    convolution without bias, pooling, a linear head (float64)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3, padding=1)
            self.block = nn.Sequential(nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                                       nn.GroupNorm(2, 4), nn.Tanh())
            self.down = nn.Conv2d(4, 6, 5, stride=2, padding=2, bias=False)
            self.head = nn.Sequential(nn.Tanh(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            return self.head(self.down(h + self.block(h)))
    return Net().double()


def test_the_operators_cached_products_through_unfolded_convolutions_match_the_dense_jacobian(monkeypatch):
    calls = _counting(monkeypatch)
    model = _resnet_shaped()
    torch.manual_seed(1)
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 2, 1])
    jac, _ = dense_jacobians(model, x, y)  # [B, dx, dθ] of the batch loss
    op = JacobianOperator(model, x, y, products="cached")
    u = torch.randn(3, 2, op.dx, dtype=torch.float64)
    want_jt = torch.einsum("bap,bka->bkp", jac, u)
    torch.testing.assert_close(op.jt(u), want_jt, rtol=1e-9, atol=1e-12)
    assert sorted(set(calls)) == [(4, 3, 3, 3), (4, 4, 3, 3), (6, 4, 5, 5)]  # every convolution, in the Jᵀ build
    torch.testing.assert_close(op.kmv(u), torch.einsum("bap,bkp->bka", jac, want_jt), rtol=1e-9, atol=1e-12)
    v = torch.randn(3, 2, op.dtheta, dtype=torch.float64)
    torch.testing.assert_close(op.j(v), torch.einsum("bap,bkp->bka", jac, v), rtol=1e-9, atol=1e-12)
    monkeypatch.setattr(unfolded_convs, "UNFOLD_PER_SAMPLE_CONVS", False)
    built = len(calls)
    plain = JacobianOperator(model, x, y, products="cached")
    torch.testing.assert_close(plain.jt(u), want_jt, rtol=1e-9, atol=1e-12)
    assert len(calls) == built  # switched off: PyTorch's grouped convolutions
