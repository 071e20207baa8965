"""GroupNorm's normalisation with its second derivative in closed form (``flguard.risk.ghost_group_norm``) against
PyTorch's own ``F.group_norm`` and its twice-differentiable backward, and against finite differences: on images, a
time series' [B, C, L], fully connected features [B, C], one group and one channel a group, a channels-last input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flguard.risk.ghost_group_norm import group_normalize

CASES = {"image, 3 groups": ((3, 6, 5, 4), 3), "series [B, C, L]": ((2, 4, 7), 2), "features [B, C]": ((4, 6), 3),
         "one channel a group": ((2, 8, 3, 3), 8), "one group": ((2, 4, 3, 3), 1)}


def _input(shape: tuple, channels_last: bool = False) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(True)


@pytest.mark.parametrize("case", list(CASES))
def test_the_normalisation_and_its_two_derivatives_pass_finite_differences(case):
    shape, groups = CASES[case]
    x = _input(shape)
    torch.testing.assert_close(group_normalize(x, groups, 1e-5), F.group_norm(x, groups, eps=1e-5), rtol=1e-12,
                               atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: group_normalize(t, groups, 1e-5), (x,))
    assert torch.autograd.gradgradcheck(lambda t: group_normalize(t, groups, 1e-5), (x,))


@pytest.mark.parametrize("case,channels_last", [(case, False) for case in CASES] + [("image, 3 groups", True)],
                         ids=list(CASES) + ["image, channels-last"])
def test_the_k_products_passes_equal_pytorchs_composite(case, channels_last):
    """The ghost product's pattern: pass 1 takes ∇_x of a loss through the normalisation with its graph (the upstream
    gradient itself depending on x, as a later layer's does), passes 2 and 3 differentiate ⟨∇_xℓ, v⟩ once more in x
    and in a parameter w after it — against the same passes through ``F.group_norm``."""
    shape, groups = CASES[case]
    x = _input(shape, channels_last)
    w = torch.randn(shape[1], dtype=torch.float64).reshape(1, -1, *[1] * (len(shape) - 2)).requires_grad_(True)
    u, v = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    results = []
    for normalise in (lambda t: group_normalize(t, groups, 1e-5), lambda t: F.group_norm(t, groups, eps=1e-5)):
        out = normalise(x) * w
        loss = (torch.tanh(out) * u).sum() + (out * x).square().sum()
        (input_grad,) = torch.autograd.grad(loss, x, create_graph=True)
        results.append(torch.autograd.grad((input_grad * v).sum(), (x, w)))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_a_third_derivative_equals_pytorchs():
    """The closed form takes μ and r as the forward pass's constants; where a graph of it is asked for, it takes them
    again from x, so a third derivative (never on the guard's passes) is exact too."""
    x = _input((2, 4, 3))
    results = []
    for normalise in (lambda t: group_normalize(t, 2, 1e-5), lambda t: F.group_norm(t, 2, eps=1e-5)):
        (first,) = torch.autograd.grad(normalise(x).sin().sum(), x, create_graph=True)
        (second,) = torch.autograd.grad((first * x).square().sum(), x, create_graph=True)
        results.append(torch.autograd.grad(second.cos().sum(), x)[0])
    torch.testing.assert_close(*results, rtol=1e-10, atol=1e-12)
