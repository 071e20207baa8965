"""The models the batched products refuse keep the one-sample loop, with the reason said: BatchNorm in eval mode,
'same' padding, a weight handed to another function or used transposed, a parameter whose rows meet the batch's rows;
and the switch that turns the loop back on. Each product against the dense float64 Jacobians."""

from __future__ import annotations

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from flguard.risk import direct
from flguard.risk.ghost_forward import Unsupported, ghost_support
from flguard.risk.ghost_products import GhostKmv
from flguard.risk.operator import JacobianOperator
from ghost_shapes import RowByRow, ScaledNorm, TiedTranspose, dense_k, resnet_shaped, sample_batch


@pytest.mark.parametrize("case", ["BatchNorm in eval mode", "a weight used elsewhere", "'same' padding",
                                  "a weight used transposed"])
def test_models_the_ghost_product_refuses_keep_the_loop(case):
    torch.manual_seed(0)
    if case == "BatchNorm in eval mode":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
        model(torch.randn(2, 3, 8, 9))
        model.eval()
        static = "1: a BatchNorm2d with trainable parameters"
    elif case == "'same' padding":
        model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Conv2d(6, 6, 3, padding="same"), nn.Flatten(), nn.LazyLinear(3))
        model(torch.randn(2, 3, 8, 9))
        static = "1: a 'same'-padded convolution"
    else:
        model = {"a weight used elsewhere": ScaledNorm, "a weight used transposed": TiedTranspose}[case]()
        static = None
    model = model.double()
    assert ghost_support(model) == static
    x, y = sample_batch(2)
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    u = torch.randn(2, 1, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    assert getattr(op, "_ghost", None) is None
    if static is None:  # refused by the forward pass's check, and said why
        assert op.ghost_products
        expected = {"a weight used elsewhere": "takes the parameter norm",
                    "a weight used transposed": "t takes the parameter encode.weight"}[case]
        assert expected in op.ghost_refused
        with pytest.raises(Unsupported, match=expected.split(" is")[0]):
            GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    else:
        assert not op.ghost_products


def test_a_parameter_that_meets_the_batch_row_by_row_is_refused():
    """A parameter entering elementwise beside the activations is taken per sample only where it broadcasts over the
    batch; one whose rows meet the batch's rows (``RowByRow``) is refused by the forward pass's check (on one
    sample, where the rows no longer match), and so is one added to a scalar or read through a tensor attribute."""
    model = RowByRow().double()
    assert ghost_support(model) is None
    x, y = sample_batch(2)
    op = JacobianOperator(model, x, y, products="direct")
    with pytest.raises(Unsupported, match="the parameter rows meets a tensor of its own rank"):
        GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)

    class _Doubled(RowByRow):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.conv(x).flatten(1) * (2 * self.head.bias).sum()))
    model = _Doubled().double()
    op = JacobianOperator(model, x, y, products="direct")
    with pytest.raises(Unsupported, match="an elementwise product or sum takes the parameter head.bias beside no batch"):
        GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)

    class _Transposed(RowByRow):  # the parameter's transpose: an attribute of its per-sample view would be wrong
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.conv(x).flatten(1) @ self.rows.T))
    model = _Transposed().double()
    model.head = nn.Linear(2, 3).double()
    op = JacobianOperator(model, x, y, products="direct")
    with pytest.raises(Unsupported, match="a tensor attribute or comparison of the parameter rows"):
        GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)


def test_the_switch_turns_the_loop_back_on(monkeypatch):
    monkeypatch.setattr(direct, "GHOST_KMV", False)
    model = resnet_shaped()
    x, y = sample_batch(2)
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    assert not op.ghost_products
    u = torch.randn(2, 1, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    assert getattr(op, "_ghost", None) is None


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_an_activation_of_a_parameter_is_refused_as_before_the_closed_form(activation):
    """GELU and SiLU run through their closed-form second derivatives (``flguard.risk.ghost_activations``) on
    activations only: one handed a parameter (a learned gate) is refused by the forward pass's check, as any function
    of a parameter the batched product does not rewrite, and the operator keeps the exact one-sample loop."""

    class _Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.gate = nn.Parameter(torch.randn(4))
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.conv(x)).mean((2, 3)) * getattr(F, activation)(self.gate))

    torch.manual_seed(0)
    model = _Gated().double()
    x, y = sample_batch(2)
    op = JacobianOperator(model, x, y, products="direct")
    with pytest.raises(Unsupported, match=f"{activation} takes the parameter gate"):
        GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    op.sample_chunk = 1
    u = torch.randn(2, 1, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    assert getattr(op, "_ghost", None) is None and "takes the parameter gate" in op.ghost_refused
