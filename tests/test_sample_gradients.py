"""The per-sample gradients as the guard reads them (``flguard.risk.sample_gradients``): never formed, each operation
one pass over the ghost products' graphs, against plain autograd one sample at a time; the operator choosing that form
where the graphs fit only in the matrix's room; and the guard's step certified on it with the matrix never formed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from flguard import GuardConfig, make_guarded
from flguard.models import create
from flguard.risk import ghost_products, sizing
from flguard.risk.ghost_products import GhostKmv
from flguard.risk.operator import JacobianOperator
from flguard.risk.sample_gradients import GhostSampleGradients, SampleGradients
from risk_reference import assert_certified_on_dense_float64, per_sample_gradients
from ghost_shapes import SHAPES, sample_batch

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


@pytest.mark.parametrize("kept", [True, False], ids=["graphs kept", "rebuilt in chunks of 2"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_unformed_gradients_match_plain_autograd(shape, kept, monkeypatch):
    """Norms, dot products with one vector, weighted sums and a_i = ⟨g_i, Σ_jg_j⟩ from the graphs, against the [B, dθ]
    matrix of plain autograd on each sample alone — on every model shape the batched products take (grouped and
    depthwise convolutions, fully connected layers on inner positions, attention batch first and sequence first,
    weights used several times)."""
    if not kept:
        monkeypatch.setattr(ghost_products, "RETAINED_BYTES", 0)
    model = SHAPES[shape]()
    x, y = sample_batch()
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    ghost = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    if not kept:
        ghost.chunk = 2
    unformed = GhostSampleGradients(ghost, lambda: pytest.fail("formed"))
    with sdpa_kernel(SDPBackend.MATH):
        per = per_sample_gradients(model, x, y)
    dense = SampleGradients(per)
    torch.testing.assert_close(unformed.norms(), per.norm(dim=1), rtol=1e-10, atol=1e-12)
    v, w = torch.randn(per.shape[1], dtype=torch.float64), torch.randn(per.shape[0], dtype=torch.float64)
    torch.testing.assert_close(unformed.dots(v), per @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(unformed.weighted(w), w @ per, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(unformed.along_sum(), dense.along_sum(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dense.along_sum(), per @ per.sum(0), rtol=1e-12, atol=1e-14)


def _unformed_sizes(monkeypatch, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """A batch the cached pullbacks do not hold (the direct path), whose ghost graphs exceed ``RETAINED_BYTES`` by a
    byte: they fit only in the room of its per-sample gradients."""
    dtheta = sum(p.numel() for p in model.parameters())
    probe = JacobianOperator(model, x, y, products="direct")
    sample_bytes = GhostKmv(model, probe.params, probe.buffers, probe.loss_fn, probe.x, probe.y).sample_bytes
    monkeypatch.setattr(sizing, "CACHED_UP_TO", dtheta)
    monkeypatch.setattr(ghost_products, "RETAINED_BYTES", x.shape[0] * sample_bytes - 1)


def test_the_operator_never_forms_the_gradients_where_the_graphs_fit_only_in_their_room(monkeypatch):
    """``products="ghost"`` on a batch too large for the cached pullbacks: with graphs that fit only in the matrix's
    room the operator keeps them and reads the gradients unformed; without that room (``UNFORMED_GRADIENTS`` off) the
    graphs are rebuilt and the matrix formed, as before."""
    from flguard.risk import direct

    model = SHAPES["ResNet"]()
    x, y = sample_batch(4)
    _unformed_sizes(monkeypatch, model, x, y)
    op = JacobianOperator(model, x, y, products="ghost")
    assert op.direct and op._ghost.retained and op._ghost.unformed_gradients
    gradients = op.sample_gradient_set()
    assert isinstance(gradients, GhostSampleGradients) and gradients is op.sample_gradient_set()
    torch.testing.assert_close(gradients.norms(), per_sample_gradients(model, x, y).norm(dim=1), rtol=1e-10,
                               atol=1e-12)
    assert getattr(op, "_per_sample", None) is None
    sub = op.restricted(torch.tensor([0, 2]))  # a restricted copy keeps its graphs in the same room
    assert sub._ghost_kmv().retained and getattr(sub, "_gradient_set", None) is None
    monkeypatch.setattr(direct, "UNFORMED_GRADIENTS", False)
    before = JacobianOperator(model, x, y, products="ghost")
    assert before.direct and not before._ghost.retained and not before._ghost.unformed_gradients
    assert type(before.sample_gradient_set()) is SampleGradients


@pytest.mark.parametrize("defense", ["resolvent", "gaussian", "eigen", "rowspace"])
def test_the_guard_certifies_without_forming_the_per_sample_gradients(defense, monkeypatch):
    """make_guarded with median clipping, exclusion and the 15 dB pixel floor on a channels-last 3-channel GroupNorm
    ResNet whose graphs fit only in the room of its per-sample gradients: with every kind of noise the step never forms
    them (the graphs' ``sample_gradients`` fails the test), and the noise sent gives every kept sample a
    dense-recomputed float64 I²F RMSE ≥ τ, with the report's values the dense ones."""
    torch.manual_seed(0)
    model = create("resnet8_gn", image_size=6).double()
    x = torch.rand(4, 3, 6, 6, dtype=torch.float64)
    x = ((x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)).to(
        memory_format=torch.channels_last)
    y = torch.tensor([0, 3, 5, 7])
    _unformed_sizes(monkeypatch, model, x, y)
    monkeypatch.setattr(GhostKmv, "sample_gradients", lambda self: pytest.fail("the per-sample gradients were formed"))
    config = GuardConfig(defense=defense, pixel_mean=MEAN, pixel_std=STD, seed=3, clip_per_sample="median",
                         max_excluded=0.25, max_rel_noise=40.0, rtol=1e-2)
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                               nn.CrossEntropyLoss(), config)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    report = optimizer.guard_reports[0]
    assert report.met, report.reason
    monkeypatch.undo()  # the reference's own operator forms them
    assert_certified_on_dense_float64(model, x, y, config, report)


@pytest.mark.parametrize("retention", [0.3, 0.9])
def test_the_retention_clip_level_off_the_graphs_equals_the_matrixs(retention, monkeypatch):
    """``clip_per_sample="retention"`` (the default "auto"'s first level) with the gradients never formed: the same C
    as from plain autograd's [B, dθ] matrix on a GroupNorm ResNet at B = 8."""
    from flguard.guard.clipping import clip_level, retained_clip_level

    torch.manual_seed(0)
    model = create("resnet8_gn", image_size=6).double()
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.arange(8) % 10
    per = per_sample_gradients(model, x, y)
    want = retained_clip_level(per, float(per.norm(dim=1).sort().values[3]), retention)
    _unformed_sizes(monkeypatch, model, x, y)
    op = JacobianOperator(model, x, y, products="ghost")
    assert isinstance(op.sample_gradient_set(), GhostSampleGradients)
    assert clip_level("retention", op, 0.5, retention) == pytest.approx(want, rel=1e-12)
