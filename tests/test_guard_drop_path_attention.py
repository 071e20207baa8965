"""Stochastic depth and attention dropout guarded as they train: ``fix_model``'s ``ReplayedDropPath`` in place of
torchvision's ``StochasticDepth`` and timm's ``DropPath``, and attention's weights dropped through ``F.dropout`` while a
pass is recorded or replayed (``flguard.risk.dropout_draws``).

References: torchvision's and PyTorch's own layers under one seed (the same draws, the same outputs), and dense float64
Jacobians of each sample's pass with its own masks.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

import flguard
from flguard import GuardConfig, check_model, make_guarded
from flguard.risk.dropout_draws import DropoutDraws, ReplayedDropPath
from flguard.risk.operator import JacobianOperator
from risk_reference import (assert_certified_on_dense_float64, assert_products_match_dense, clipped_upload_jacobians,
                            sample_gradient, step_reading_masks)

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


class DropPath(nn.Module):
    """timm's ``DropPath``, by name and attributes (timm is not a dependency)."""

    def __init__(self, drop_prob: float, scale_by_keep: bool = True) -> None:
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_fix_model_replaces_stochastic_depth_by_a_replayed_drop_path_of_the_same_law():
    """torchvision's ConvNeXt-T lists 17 StochasticDepth layers, each naming fix_model; the fixed copy lists none,
    computes the same eval-mode output, and each ReplayedDropPath keeps the layer's probability. Under one seed it
    drops exactly what torchvision's layer drops (CPU); its draws are one per sample, kept with probability 1 − p and
    scaled by 1/(1 − p) (timm's ``scale_by_keep=False``: unscaled). Batch mode (one draw for the whole batch) is
    refused by name."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    convnext = torchvision.models.convnext_tiny(num_classes=10)
    listed = check_model(convnext)
    assert len(listed) == 17 and all("StochasticDepth" in p and "fix_model" in p for p in listed)
    fixed = flguard.fix_model(convnext)
    assert check_model(fixed) == []
    depths = [m for m in fixed.modules() if isinstance(m, ReplayedDropPath)]
    originals = [m for m in convnext.modules() if type(m).__name__ == "StochasticDepth"]
    assert len(depths) == 18 and [d.p for d in depths] == [o.p for o in originals]
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fixed.eval()(x), convnext.eval()(x), rtol=0, atol=0)
    signal = torch.randn(64, 4, 3, 3)
    torch.manual_seed(5)
    torchvisions = torchvision.ops.StochasticDepth(0.3, "row")(signal)
    torch.manual_seed(5)
    assert torch.equal(ReplayedDropPath(0.3)(signal), torchvisions)  # the same draws, bit for bit (CPU)
    timm_like = flguard.fix_model(nn.Sequential(nn.Linear(3, 3), DropPath(0.4, scale_by_keep=False)))
    assert isinstance(timm_like[1], ReplayedDropPath) and not timm_like[1].scale_by_keep
    ones = torch.ones(20000, 2, 3)
    with DropoutDraws() as drawing:
        dropped, unscaled = ReplayedDropPath(0.3)(ones), timm_like[1](ones)
    kept = dropped[:, 0, 0] > 0
    assert torch.equal(dropped, kept.double().div(0.7).float().view(-1, 1, 1).expand_as(ones))
    assert abs(float(kept.double().mean()) - 0.7) < 5 * (0.21 / 20000) ** 0.5
    assert unscaled.unique().tolist() == [0.0, pytest.approx(1.0)] and len(drawing.finish()) == 2
    with pytest.raises(ValueError, match=r"features\.1\.0\.stochastic_depth is StochasticDepth\(mode='batch'\)"):
        convnext.features[1][0].stochastic_depth.mode = "batch"
        flguard.fix_model(convnext)


def test_a_fixed_convnext_with_stochastic_depth_is_guarded_as_it_trains():
    """torchvision's ConvNeXt (two stages, stochastic depth 0.5 — LayerNorm on a channels-last view, permutes, layer
    scale) through ``fix_model`` and ``make_guarded``: every step's drop-path draws are replayed — the recomputed
    gradient is ``.grad`` — and both steps are sent."""
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    model = flguard.fix_model(ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)],
                                       stochastic_depth_prob=0.5, num_classes=3)).train()
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                               nn.CrossEntropyLoss(),
                                               GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=0, max_rel_noise=40.0))
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    for _ in range(2):
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert [r.met for r in optimizer.guard_reports] == [True, True]


@pytest.mark.parametrize("name", ["efficientnet_b0", "swin_t"])
def test_fix_model_leaves_nothing_listed_in_torchvisions_models_with_stochastic_depth(name):
    """EfficientNet-B0 (BatchNorm, stochastic depth, a dropout head) and Swin-T (stochastic depth, LayerNorm,
    windowed attention): after ``fix_model(batchnorm="frozen")`` ``check_model`` lists nothing, and the fixed copy
    computes the original's eval-mode output."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    assert any("StochasticDepth" in p for p in check_model(model))
    with pytest.warns(UserWarning, match="have seen no batch") if name == "efficientnet_b0" else nullcontext():
        fixed = flguard.fix_model(model, batchnorm="frozen")
    assert check_model(fixed) == []
    assert any(isinstance(m, ReplayedDropPath) for m in fixed.modules())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fixed.eval()(x), model.eval()(x), rtol=1e-5, atol=1e-6)



def test_attention_dropout_is_recorded_as_pytorchs_own_and_replayed():
    """``nn.MultiheadAttention(dropout=0.3)`` while training: under one seed the recorded pass computes PyTorch's own
    output and weights (its explicit path, ``need_weights=True``) to 1e-15 and leaves the generator where PyTorch's
    leaves it; the mask is one per sample, head and weight ([N, H, L, S]); replayed with ``need_weights=False`` (the
    SDPA path PyTorch would take) it computes the recorded output exactly. ``F.scaled_dot_product_attention``'s
    dropout is recorded the same way."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, dropout=0.3).double().train()
    x = torch.randn(5, 3, 8, dtype=torch.float64)  # (L, N, E)
    torch.manual_seed(5)
    (out, weights), after = attention(x, x, x), torch.rand(3)
    torch.manual_seed(5)
    with DropoutDraws() as drawing:
        recorded, recorded_weights = attention(x, x, x)
    assert torch.equal(torch.rand(3), after)
    torch.testing.assert_close(recorded, out, rtol=0, atol=1e-15)
    torch.testing.assert_close(recorded_weights, weights, rtol=0, atol=1e-15)
    (mask,) = drawing.finish()
    assert mask.shape == (3, 2, 5, 5) and set(mask.unique().tolist()) <= {0.0, 1 / 0.7}
    with DropoutDraws((mask,)) as replay:
        replayed, _ = attention(x, x, x, need_weights=False)
    replay.finish()
    assert torch.equal(replayed, recorded)
    q = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    with DropoutDraws() as drawing:
        value = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    (sdpa_mask,) = drawing.finish()
    plain = torch.softmax(q @ q.transpose(-2, -1) / 2.0, -1)
    torch.testing.assert_close(value, (plain * sdpa_mask) @ q)


class TinyViT(nn.Module):
    """2×2 patches of a 3-channel image, one ``nn.TransformerEncoderLayer`` (dropout 0.25: attention, residual and
    feed-forward dropouts, its default layout), mean pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 2, stride=2)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.25, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.encoder(tokens).mean(1))


@pytest.mark.parametrize("path", ["cached", "direct", "one at a time"])
def test_a_transformer_with_dropout_is_replayed_per_sample_against_dense_float64(path):
    """The operator's products for a transformer layer with its four dropouts training equal dense Jacobians of each
    sample's pass with its own masks (computed by plain ``torch.func`` transforms through the replay), on all three
    paths; ``make_guarded`` sends its steps (the recomputed gradient, attention masks replayed, is ``.grad``)."""
    torch.manual_seed(0)
    model = TinyViT().double().train()
    x, y = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    op = JacobianOperator(model, x, y, products="cached" if path == "cached" else "direct")
    if path == "one at a time":
        op.sample_chunk = 1
    assert [tuple(d.shape) for d in op.draws] == [(4, 2, 4, 4), (4, 4, 8), (4, 4, 16), (4, 4, 8)]
    from torch.func import functional_call

    def forward(params, inputs, i):
        with DropoutDraws(tuple(d[i:i + 1] for d in op.draws)) as replay:
            out = functional_call(model, params, (inputs,))
        replay.finish()
        return out
    jac = clipped_upload_jacobians(model, x, y, 1.0, torch.zeros(4, dtype=torch.bool), forward)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(4, 1, op.dtheta, generator=g, dtype=torch.float64)
    u = torch.randn(4, 1, op.dx, generator=g, dtype=torch.float64)
    torch.testing.assert_close(op.j(v), torch.einsum("bap,bkp->bka", jac, v), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.kmv(u), torch.einsum("bap,bcp,bkc->bka", jac, jac, u), rtol=1e-9, atol=1e-12)
    if path != "cached":
        return
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0, max_rel_noise=40.0))
    for _ in range(2):
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert [r.met for r in optimizer.guard_reports] == [True, True]


class _AttentionOnly(nn.Module):
    """Patch tokens through ``nn.MultiheadAttention(dropout=0.3)`` alone: no ``nn.Dropout`` layer in the model (a
    torchvision ViT with ``attention_dropout`` > 0 and ``dropout=0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 2, stride=2)
        self.attention = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.attention(tokens, tokens, tokens, need_weights=False)[0].mean(1))


def test_attention_dropout_alone_is_recorded_and_the_step_sent():
    """A model whose only random layer is attention dropout has its pass recorded all the same: the step is sent
    (the recomputed gradient, its attention mask replayed, is ``.grad``)."""
    torch.manual_seed(0)
    model = _AttentionOnly().double().train()
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0, max_rel_noise=40.0))
    x, y = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert optimizer.guard_reports[-1].met


class _Times(nn.Module):
    """A fixed multiplier in a dropout layer's place: the reference pass."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask


class SequenceFirstViT(nn.Module):
    """``TinyViT`` in PyTorch's default layout (``batch_first=False``): the layer's residual and feed-forward dropouts
    draw on (L, N, E) tensors, the batch second. Attention dropout is off here (its weights are batch-first, tested
    above), so that hooks read every mask."""

    DROPOUTS = ("dropout1", "dropout", "dropout2")  # in call order

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 2, stride=2)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.25)  # batch_first=False
        self.encoder.self_attn.dropout = 0.0
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).permute(2, 0, 1)  # (L, N, E)
        return self.head(self.encoder(tokens).mean(0))

    def masks_of_the_next_pass(self):
        """Hooks reading the dropouts' multipliers (L, N, E) off their inputs and outputs in the next pass."""
        seen: dict[str, torch.Tensor] = {}

        def hook(name):
            def read(module, args, output):
                if name not in seen:
                    seen[name] = torch.where(args[0] != 0, output / args[0], torch.zeros_like(output)).detach()
            return read
        return seen, [getattr(self.encoder, n).register_forward_hook(hook(n)) for n in self.DROPOUTS]

    def masked_forward(self, seen: dict[str, torch.Tensor]):
        """``forward(params, x_i[None], i)``: sample i's pass, each dropout replaced by its masks' column i, (L, 1, E),
        as a plain multiplier; attention on PyTorch's math kernel (its CPU flash kernel has no forward derivative)."""
        from torch.func import functional_call
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def forward(params, inputs, i):
            layers = {n: getattr(self.encoder, n) for n in self.DROPOUTS}
            for n in layers:
                setattr(self.encoder, n, _Times(seen[n][:, i:i + 1]))
            try:
                with sdpa_kernel(SDPBackend.MATH):
                    return functional_call(self, params, (inputs,))
            finally:
                for n, layer in layers.items():
                    setattr(self.encoder, n, layer)
        return forward


@pytest.mark.parametrize("path", ["cached", "direct", "one at a time"])
def test_a_sequence_first_transformer_layer_is_replayed_per_sample_against_dense_float64(path):
    """``nn.TransformerEncoderLayer`` with its defaults' (L, N, E) layout, as many tokens as samples (L = N = 4): each
    mask's batch is found from a one-sample pass's shapes and put first (its place kept, ``check_batch``), each
    sample's column replayed in place; J_iv, J_iᵀu, K_iu and the per-sample gradients equal dense Jacobians of each
    sample's pass with its masks — read off the layers by hooks — as plain multipliers, on all three paths."""
    torch.manual_seed(0)
    model = SequenceFirstViT().double().train()
    x, y = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0])  # L = 4 tokens, N = 4
    seen, handles = model.masks_of_the_next_pass()
    op = JacobianOperator(model, x, y, products="cached" if path == "cached" else "direct")
    for handle in handles:
        handle.remove()
    if path == "one at a time":
        op.sample_chunk = 1
    assert [tuple(d.shape) for d in op.draws] == [(4, 1, 4, 8), (4, 1, 4, 16), (4, 1, 4, 8)]
    forward = model.masked_forward(seen)
    unclipped = torch.zeros(4, dtype=torch.bool)
    assert_products_match_dense(op, clipped_upload_jacobians(model, x, y, 1.0, unclipped, forward))
    params = {n: p.detach() for n, p in model.named_parameters()}
    per = torch.stack([sample_gradient(model, forward, params, x[i], y[i], i) for i in range(4)])
    torch.testing.assert_close(op.per_sample_gradients(), per, rtol=1e-9, atol=1e-12)


def test_make_guarded_sends_a_sequence_first_transformers_steps_certified_against_dense_float64():
    """The user's loop on a sequence-first transformer layer, unchanged: the step is sent, ``.grad`` is the gradient
    of the user's own pass and its noise certifies every kept sample against dense float64 I²F of that masked map —
    with as many samples as the width (N = E = 8); two accumulated micro-batches of as many samples as tokens (each
    pass's masks put batch first, then concatenated) are sent too."""
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=3, clip_per_sample="median", max_excluded=0.25,
                         max_rel_noise=40.0, rtol=1e-2)
    torch.manual_seed(0)
    model = SequenceFirstViT().double().train()
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                               nn.CrossEntropyLoss(), config)
    x, y = torch.rand(8, 3, 4, 4, dtype=torch.float64), torch.arange(8) % 3
    report, seen = step_reading_masks(model, optimizer, criterion, x, y, model.masks_of_the_next_pass)
    assert_certified_on_dense_float64(model, x, y, config, report, forward=model.masked_forward(seen))
    optimizer.zero_grad()
    for part in (slice(0, 4), slice(4, 8)):
        criterion(model(x[part]), y[part]).backward()
    optimizer.step()
    assert optimizer.guard_reports[1].details["micro_batches"] == 2 and optimizer.guard_reports[1].met
