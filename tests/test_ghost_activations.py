"""GELU (exact and tanh-approximated) and SiLU with their second derivatives in closed form
(``flguard.risk.ghost_activations``) against PyTorch's own kernels through three orders of differentiation, and
against finite differences; an in-place SiLU left to PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flguard.risk.ghost_activations import closed_form_activation

KINDS = {"GELU": (F.gelu, {}), "GELU, tanh approximation": (F.gelu, {"approximate": "tanh"}), "SiLU": (F.silu, {})}


def _input() -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.randn(3, 7, dtype=torch.float64) * 3).requires_grad_(True)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_activation_and_its_two_derivatives_pass_finite_differences(kind):
    func, kwargs = KINDS[kind]
    x = _input()

    def ours(t: torch.Tensor) -> torch.Tensor:
        return closed_form_activation(func, (t,), kwargs)
    torch.testing.assert_close(ours(x), func(x, **kwargs), rtol=1e-14, atol=1e-15)
    assert torch.autograd.gradcheck(ours, (x,)) and torch.autograd.gradgradcheck(ours, (x,))


@pytest.mark.parametrize("kind", list(KINDS))
def test_three_orders_equal_pytorchs_kernels(kind):
    """Pass 1's recorded gradient, its derivative once more (the guard's passes 2 and 3: in x and in the upstream
    gradient's own inputs), and a third derivative (a graph of the closed form) against PyTorch's."""
    func, kwargs = KINDS[kind]
    x = _input()
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    results = []
    for activation in (lambda t: closed_form_activation(func, (t,), kwargs), lambda t: func(t, **kwargs)):
        (first,) = torch.autograd.grad((activation(x * w) * x.cos()).sum(), x, create_graph=True)
        second = torch.autograd.grad((first * first * x).sum(), (x, w), create_graph=True)
        third = torch.autograd.grad(second[0].sin().sum(), (x, w))
        results.append((first, *second, *third))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_in_place_silu_and_other_functions_are_left_to_pytorch():
    x = torch.randn(4)
    assert closed_form_activation(F.silu, (x,), {"inplace": True}) is None
    assert closed_form_activation(F.silu, (x, True), {}) is None
    assert closed_form_activation(F.relu, (x,), {}) is None
