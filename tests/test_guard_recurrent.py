"""Recurrent models guarded as they train: ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` in the guard's plain operators
(``flguard.risk.recurrent``), and a stacked layer's dropout between its layers recorded and replayed.

References: PyTorch's own layers — their outputs and draws under one seed, and dense float64 Jacobians by plain
reverse-over-reverse autograd through their kernels (one pass under a seed fixes the masks PyTorch draws, which are
the ones the guard records under that seed). The layers without dropout are also in ``tests/test_guard_layers.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flguard import GuardConfig, make_guarded
from flguard.risk.dropout_draws import DropoutDraws, active_dropouts
from flguard.risk.operator import JacobianOperator
from risk_reference import dense_jacobians

CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class SequenceClassifier(nn.Module):
    """A time series (N, T, 3) through a stacked recurrent layer, its last step's state to a linear head."""

    def __init__(self, cell: type[nn.RNNBase], dropout: float = 0.0, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = cell(3, 5, num_layers=3, dropout=dropout, batch_first=batch_first)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rnn(x if self.batch_first else x.transpose(0, 1))[0]
        return self.head(out[:, -1] if self.batch_first else out[-1])


@pytest.mark.parametrize("name", list(CELLS))
def test_a_recorded_stacked_layer_drops_as_pytorchs_own_and_replays_it(name):
    """Under one seed the recorded pass (plain operators, the drops through ``F.dropout``) gives PyTorch's own output
    and final states to float rounding, draws what PyTorch draws — the generator left where PyTorch leaves it — and
    its replay gives the same output exactly; the layer is listed among the dropouts the recorder records."""
    torch.manual_seed(0)
    layer = CELLS[name](4, 5, num_layers=3, dropout=0.3, batch_first=True).double()
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    torch.manual_seed(5)
    expected = layer(x)
    after = torch.rand(1)
    torch.manual_seed(5)
    with DropoutDraws() as recording:
        got = layer(x)
    draws = recording.finish()
    assert torch.equal(torch.rand(1), after)
    assert [tuple(d.shape) for d in draws] == [(7, 2, 5), (7, 2, 5)]  # time-major, between the three layers
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    with DropoutDraws(draws) as replay:
        again = layer(x)
    replay.finish()
    assert torch.equal(again[0], got[0])
    assert active_dropouts(nn.Sequential(layer)) == ["0"]
    assert active_dropouts(nn.Sequential(layer.eval())) == []


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("name", list(CELLS))
def test_the_operator_replays_a_stacked_layers_drops_against_pytorchs_dense_float64(name, batch_first):
    """The operator's K products on its three paths, its masks drawn in its first pass under a seed, equal the dense
    K_i = J_iJ_iᵀ of PyTorch's own layer under the same seed (the same masks: one batch pass, differentiated)."""
    torch.manual_seed(0)
    model = SequenceClassifier(CELLS[name], dropout=0.25, batch_first=batch_first).double().train()
    x, y = torch.randn(3, 6, 3, dtype=torch.float64), torch.tensor([0, 1, 3])
    torch.manual_seed(7)
    jac, _ = dense_jacobians(model, x, y)
    kernel = jac @ jac.transpose(1, 2)
    u = torch.randn(3, 2, jac.shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = torch.einsum("bij,bkj->bki", kernel, u)
    for products, chunk in (("cached", None), ("direct", 2), ("direct", 1)):
        torch.manual_seed(7)
        op = JacobianOperator(model, x, y, products=products)
        assert op.drew_masks and [tuple(d.shape) for d in op.draws] == [(3, 1, 6, 5), (3, 1, 6, 5)]
        if chunk is not None:
            op.sample_chunk = chunk
        torch.testing.assert_close(op.kmv(u), expected, rtol=1e-9, atol=1e-12, msg=f"{products}, chunks of {chunk}")


@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("name", list(CELLS))
def test_make_guarded_sends_a_recurrent_models_steps(name, dropout):
    """The user's loop on a stacked recurrent classifier, unchanged, with and without dropout between its layers: the
    steps are sent (each recomputed gradient, its drops replayed, is ``.grad``) — they were withheld before."""
    torch.manual_seed(0)
    model = SequenceClassifier(CELLS[name], dropout=dropout)
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0, max_rel_noise=40.0))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(8, 6, 3, generator=g), torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert [r.met for r in optimizer.guard_reports] == [True, True]


@pytest.mark.parametrize("name", list(CELLS))
def test_the_rewrite_gives_pytorchs_outputs_and_final_states_stacked_bidirectional_with_given_states(name):
    """The plain-operator recurrences (``flguard.risk.recurrent``) against PyTorch's kernels on a stacked
    bidirectional sequence-first layer with given initial states (the LSTM with a projection, the RNN with ReLU):
    the output and every final state, in PyTorch's (layer, direction) order, to float64 rounding."""
    from torch.overrides import TorchFunctionMode

    from flguard.risk.recurrent import CELLS as REWRITTEN
    from flguard.risk.recurrent import recurrent

    class Rewrite(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            value = recurrent(func, args, kwargs or {}, None) if func in REWRITTEN else None
            return func(*args, **(kwargs or {})) if value is None else value

    torch.manual_seed(0)
    options = {"lstm": {"proj_size": 2}, "gru": {}, "rnn": {"nonlinearity": "relu"}}[name]
    layer = CELLS[name](4, 3, num_layers=2, bidirectional=True, **options).double()
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    h0 = torch.randn(4, 2, 2 if name == "lstm" else 3, dtype=torch.float64)
    hx = (h0, torch.randn(4, 2, 3, dtype=torch.float64)) if name == "lstm" else h0
    expected = layer(x, hx)
    with Rewrite():
        got = layer(x, hx)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
