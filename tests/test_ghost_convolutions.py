"""The ghost products' convolution pieces (``flguard.risk.ghost_convolutions``) against PyTorch's own: a convolution's
patches and their fold (both differentiable twice), its input gradient as a transposed convolution, a fully connected
layer's pair dot products, and a convolution taken on its input's patches — with stride, padding and dilation
uneven and channels-last inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flguard.risk.ghost_convolutions import Convolution


@pytest.mark.parametrize("channels", [3, 16], ids=["col2im backward", "slices backward"])
def test_patches_equal_unfold_and_its_gradient(channels):
    """``_Patches`` (a strided view copied, its backward strided slice additions or ``F.fold``) against ``F.unfold``
    on a channels-last input with uneven stride, padding and dilation."""
    from flguard.risk.ghost_convolutions import _Patches

    torch.manual_seed(3)
    x = torch.randn(2, channels, 9, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    settings = ((3, 2), (2, 1), (1, 2), (2, 1))  # kernel, stride, padding, dilation
    want = F.unfold(x, settings[0], dilation=settings[3], padding=settings[2], stride=settings[1])
    got = _Patches.apply(x, *settings)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    cotangent = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, x, cotangent)[0], torch.autograd.grad(want, x, cotangent)[0],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("channels, slices_from", [(3, 1024), (16, 1024), (3, 0), (16, 0)],
                         ids=["index_add-3", "index_add-16", "slices-3", "slices-16"])
def test_patches_and_their_fold_are_differentiable_twice(channels, slices_from, monkeypatch):
    """``unfold`` (``_Patches``) and its backward ``_Fold`` differentiated again — pass 1 records the fold of a
    convolution taken on its patches — against finite differences, and the fold against ``F.fold``, with stride,
    padding and dilation uneven: the CPU's two routes (one ``index_add_`` on small maps, strided slices on large
    ones)."""
    from flguard.risk import ghost_convolutions
    from flguard.risk.ghost_convolutions import _Fold, unfold

    monkeypatch.setattr(ghost_convolutions, "SLICES_FROM_POSITIONS", slices_from)
    torch.manual_seed(5)
    x = torch.randn(2, channels, 7, 6, dtype=torch.float64, requires_grad=True)
    settings = ((3, 2), (2, 1), (1, 2), (2, 1))  # kernel, stride, padding, dilation
    assert torch.autograd.gradgradcheck(lambda t: unfold(t, *settings), (x,))
    columns = unfold(x, *settings).detach().requires_grad_(True)
    torch.testing.assert_close(_Fold.apply(columns, x.shape, settings),
                               F.fold(columns, (7, 6), settings[0], settings[3], settings[2], settings[1]),
                               rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradgradcheck(lambda t: _Fold.apply(t, x.shape, settings), (columns,))


@pytest.mark.parametrize("channels", [1, 4])
def test_the_input_gradient_of_a_convolution_equals_autograds(channels):
    """``Convolution.transposed`` (a transposed convolution) against autograd's input gradient of the convolution,
    with stride, padding and dilation uneven and a last row and column the stride never reaches."""
    torch.manual_seed(4)
    x = torch.randn(2, channels, 10, 9, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, channels, 3, 2, dtype=torch.float64)
    settings = ((2, 3), (1, 2), (2, 1))  # stride, padding, dilation
    layer = Convolution(weight, "conv", settings, torch.zeros(()))
    y = layer.convolve(x)
    g = torch.randn_like(y)
    torch.testing.assert_close(layer.transposed(g, x.shape), torch.autograd.grad(y, x, g)[0], rtol=1e-12, atol=1e-12)


def test_a_fully_connected_layers_pairs_dot_the_per_sample_weight_gradients():
    """``pair_dot`` on a fully connected layer (P = 1, its pairs in one expression): Σ_j ⟨δ_j ⊗ x_j, Σ_pairs a_j ⊗ b_j⟩
    against the per-sample outer products formed, with a pair whose b is pass 1's x; its gradient in δ and x (pass 3)
    against autograd of the formed expression; no pairs, zero."""
    from flguard.risk.ghost_convolutions import Dense, pair_dot

    torch.manual_seed(8)
    delta = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    layer = Dense(torch.randn(5, 7, dtype=torch.float64), "fc", (), torch.zeros(()))
    layer.first = (delta, x)
    a1, a2 = torch.randn(2, 4, 5, dtype=torch.float64)
    b2 = torch.randn(4, 7, dtype=torch.float64)
    layer.pairs = [(a1, None), (a2, b2)]
    got = pair_dot(layer, True)
    w = torch.einsum("bo,bi->boi", a1, x.detach()) + torch.einsum("bo,bi->boi", a2, b2)
    want = (torch.einsum("bo,bi->boi", delta, x) * w).sum()
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    for g, h in zip(torch.autograd.grad(got, (delta, x)), torch.autograd.grad(want, (delta, x))):
        torch.testing.assert_close(g, h, rtol=1e-13, atol=1e-14)
    layer.pairs = []
    assert float(pair_dot(layer, True)) == 0.0


@pytest.mark.parametrize("channels", [1, 3, 6])
def test_a_convolution_on_its_patches_equals_autograds(channels):
    """``Patched`` on a channels-last input's patches: its output, its input gradient folded back, its summed and
    per-sample weight gradients against ``F.conv2d`` and autograd, with stride, padding and dilation uneven."""
    from flguard.risk.ghost_convolutions import Patched, output_positions, unfold

    torch.manual_seed(6)
    x = torch.randn(3, channels, 10, 9, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    weight = torch.randn(5, channels, 3, 2, dtype=torch.float64, requires_grad=True)
    settings = ((2, 3), (1, 2), (2, 1))  # stride, padding, dilation
    layer = Patched(weight.detach().reshape(5, -1), "conv", settings, torch.zeros(()))
    patches = unfold(x, (3, 2), *settings)
    want = F.conv2d(x, weight, None, *settings)
    got = layer.convolve(patches)
    torch.testing.assert_close(got.reshape(*got.shape[:2], *output_positions(x, (3, 2), *settings)), want,
                               rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    input_grad, weight_grad = torch.autograd.grad(want, (x, weight), g)
    folded = torch.autograd.grad(patches, x, layer.transposed(g.reshape(*got.shape), x.shape))[0]
    torch.testing.assert_close(folded, input_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight_gradient(g.reshape(*got.shape), patches.detach()),
                               weight_grad.reshape(5, -1), rtol=1e-12, atol=1e-12)
    each = torch.stack([torch.autograd.grad(F.conv2d(x[i:i + 1], weight, None, *settings), weight, g[i:i + 1])[0]
                        for i in range(3)])
    torch.testing.assert_close(layer.per_sample_weights(g.reshape(*got.shape), patches.detach()),
                               each.reshape(3, 5, -1), rtol=1e-12, atol=1e-12)
