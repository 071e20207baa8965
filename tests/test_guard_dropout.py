"""Train-mode dropout guarded as it trains: each pass's masks recorded and replayed (``flguard.risk.dropout_draws``).

The references here never use the replay: a copy of the model's forward pass multiplies by the masks as plain
tensors (``DropoutResNet.fixed``), and the masks of the user's pass are read off the dropout layers' own inputs and
outputs by forward hooks. Against them: the operator's products on its three paths, and the noise that
``make_guarded`` sends, certified by dense float64 I²F.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

import flguard
from flguard import GuardConfig, GuardFailure, check_model, make_guarded
from flguard.guard import Guard
from flguard.guard.recorder import GuardMisuse
from flguard.risk.dropout_draws import DropoutDraws, ReplayedDropPath
from flguard.risk.functional import functional_forward
from flguard.risk.operator import JacobianOperator
from guard_settings import unclipped
from risk_reference import (sample_gradient, assert_certified_on_dense_float64, assert_reported_rmse,
                            clipped_upload_jacobians)

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


class DropoutResNet(nn.Module):
    """A 3-channel residual block with GroupNorm, channel dropout and stochastic depth (``ReplayedDropPath``, what
    ``fix_model`` makes of torchvision's) on its branch, pooling and element dropout before the head; with ``fixed`` =
    (channel multipliers [1, C, 1, 1], the branch's [1, 1, 1, 1], feature multipliers [1, C]) it multiplies by those
    instead of dropping — the reference forward pass of one sample with its masks."""

    def __init__(self, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.gn0 = nn.GroupNorm(2, width)
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.gn1 = nn.GroupNorm(2, width)
        self.drop2d = nn.Dropout2d(0.25)
        self.drop_path = ReplayedDropPath(0.3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(width, classes)
        self.fixed: tuple[torch.Tensor, ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.gn0(self.stem(x)))
        branch = self.gn1(self.conv(h))
        branch = branch * self.fixed[0] * self.fixed[1] if self.fixed is not None else self.drop_path(self.drop2d(branch))
        z = self.pool(torch.relu(h + branch)).flatten(1)
        z = z * self.fixed[2] if self.fixed is not None else self.drop(z)
        return self.fc(z)


def _problem(batch: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    model = DropoutResNet().double().train().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 5, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    return model, x, torch.arange(batch) % 3


def _masked_forward(model: DropoutResNet, masks: tuple[torch.Tensor, ...]):
    """``forward(params, x_i[None], i)`` for the dense references: sample i's pass with its masks as plain tensors."""
    from torch.func import functional_call

    def forward(params, inputs, i):
        model.fixed = tuple(mask[i:i + 1] for mask in masks)
        try:
            return functional_call(model, params, (inputs,))
        finally:
            model.fixed = None
    return forward


def _masks_of_the_next_pass(model: DropoutResNet):
    """Hooks reading the multipliers off the dropout layers' inputs and outputs in the next pass: out / in (0 where
    the input is 0 — a feature that is 0 before its dropout has no derivative through it either)."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name, dims):
        def read(module, args, output):
            if name not in seen:
                ratio = torch.where(args[0] != 0, output / args[0], torch.zeros_like(output)).detach()
                seen[name] = ratio.amax(dims, keepdim=True) if dims else ratio
        return read
    handles = [model.drop2d.register_forward_hook(hook("channel", (2, 3))),
               model.drop_path.register_forward_hook(hook("path", (1, 2, 3))),
               model.drop.register_forward_hook(hook("feature", ()))]
    return seen, handles


@pytest.mark.parametrize("path", ["cached", "direct", "one at a time"])
def test_the_operator_replays_each_samples_masks_on_every_path_against_dense_float64(path):
    """The operator draws the masks in its first pass (no draws given) and every product replays sample i's own:
    J_iv, J_iᵀu, K_iu, the per-sample gradients, Σ_iJ_iᵀu_i and a restricted operator's rows equal the dense
    Jacobians of the model with those masks as fixed multipliers, on the cached path, the vmapped direct path and
    plain autograd one sample at a time, with channels-last weights and inputs."""
    model, x, y = _problem()
    op = JacobianOperator(model, x, y, products="cached" if path == "cached" else "direct")
    if path == "one at a time":
        op.sample_chunk = 1
    assert op.one_at_a_time == (path == "one at a time") and op.drew_masks and len(op.draws) == 3
    channel, branch, feature = op.draws
    assert channel.shape == (6, 4, 1, 1) and branch.shape == (6, 1, 1, 1) and feature.shape == (6, 4)
    assert set(channel.unique().tolist()) <= {0.0, 1 / 0.75} and set(feature.unique().tolist()) <= {0.0, 2.0}
    forward = _masked_forward(model, op.draws)
    jac = clipped_upload_jacobians(model, x, y, 1.0, torch.zeros(6, dtype=torch.bool), forward)  # (1/B) J̃_i
    g = torch.Generator().manual_seed(1)
    v = torch.randn(6, 2, op.dtheta, generator=g, dtype=torch.float64)
    u = torch.randn(6, 2, op.dx, generator=g, dtype=torch.float64)
    close = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.j(v), torch.einsum("bap,bkp->bka", jac, v), **close)
    torch.testing.assert_close(op.jt(u), torch.einsum("bap,bka->bkp", jac, u), **close)
    torch.testing.assert_close(op.kmv(u), torch.einsum("bap,bcp,bkc->bka", jac, jac, u), **close)
    torch.testing.assert_close(op.jt_sum(u[:, 0]), torch.einsum("bap,ba->p", jac, u[:, 0]), **close)
    index = torch.tensor([4, 1])
    torch.testing.assert_close(op.restricted(index).j(v[index]), op.j(v)[index], **close)
    params = {n: p.detach() for n, p in model.named_parameters()}
    per = torch.stack([sample_gradient(model, forward, params, x[i], y[i], i) for i in range(6)])
    torch.testing.assert_close(op.per_sample_gradients(), per, **close)
    torch.testing.assert_close(op.batch_gradient(), per.mean(0), **close)


def _guarded_step(config: GuardConfig, seed: int = 0):
    """One ``make_guarded`` SGD step (lr 0, so ``.grad`` keeps what was sent) of ``_problem``'s model under ``config``:
    (model, x, y, its report, the reference forward pass with the masks the hooks read off the user's pass)."""
    model, x, y = _problem(seed=seed)
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                               nn.CrossEntropyLoss(), config)
    seen, handles = _masks_of_the_next_pass(model)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    for handle in handles:
        handle.remove()
    optimizer.step()
    report = optimizer.guard_reports[0]
    assert report.met, report.reason
    return model, x, y, report, _masked_forward(model, (seen["channel"], seen["path"], seen["feature"]))


def test_make_guarded_sends_a_dropout_models_step_certified_against_dense_float64():
    """The user's loop with Dropout2d and Dropout in train mode, unchanged: the step is guarded (it was refused),
    ``.grad`` is the gradient of the user's own pass — its masks read off the layers by hooks — and the noise sent
    certifies every kept sample against dense float64 I²F of that masked map."""
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=3, clip_per_sample="median", max_excluded=0.25,
                         max_rel_noise=40.0, rtol=1e-2)
    model, x, y, report, forward = _guarded_step(config)
    assert_certified_on_dense_float64(model, x, y, config, report, forward=forward)


def test_the_unclipped_step_of_a_dropout_model_meets_the_floor_against_dense_float64():
    """Without per-sample clipping the guard sends ``.grad`` itself plus noise: that gradient is the user's pass's
    (masks read off by hooks), and the noise gives each sample dense I²F ≥ τ of the masked map, as reported."""
    config = unclipped(defense="gaussian", min_rmse=0.2, max_rel_noise=1e4, seed=0)
    # seeds 0 and 1 draw a sample whose noise has no measurable effect (its gradient does not move with its input, as
    # when all four features are dropped), which the unclipped guard, leaving no sample out, cannot certify: it withholds
    model, x, y, report, forward = _guarded_step(config, seed=2)
    jac = clipped_upload_jacobians(model, x, y, 1.0, torch.zeros(6, dtype=torch.bool), forward)
    params = {n: p.detach() for n, p in model.named_parameters()}
    gradient = torch.stack([sample_gradient(model, forward, params, x[i], y[i], i) for i in range(6)]).mean(0)
    noise = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) - gradient
    kernel = jac @ jac.transpose(1, 2)
    eps = config.eps * torch.linalg.eigvalsh(kernel)[:, -1]
    shift = torch.linalg.solve(kernel + eps.view(-1, 1, 1) * torch.eye(kernel.shape[1], dtype=kernel.dtype),
                               (jac @ noise).unsqueeze(-1)).squeeze(-1)
    rmse = shift.norm(dim=1) / shift.shape[1] ** 0.5
    assert bool((rmse >= config.floor).all()), rmse
    assert_reported_rmse(report, rmse, rtol=3 * config.rtol)


def test_recorded_masks_are_drawn_as_pytorchs_dropout_draws_them():
    """Recording changes the implementation, not the draws: under one seed the recorded pass's output is PyTorch's
    own dropout's, bit for bit, and the generator is left where PyTorch's leaves it (CPU, PyTorch 2.x) — a guarded
    loop drops what the unguarded one would. And the law: each element kept with probability 1 − p and scaled by
    1/(1 − p) (Dropout), one draw per sample and channel (Dropout2d), nothing drawn in eval mode."""
    signal = torch.randn(64, 8, 5, 5)
    for layer in (nn.Dropout(0.3), nn.Dropout2d(0.4)):
        torch.manual_seed(5)
        plain, after = layer(signal), torch.rand(3)
        torch.manual_seed(5)
        with DropoutDraws():
            recorded = layer(signal)
        assert torch.equal(recorded, plain) and torch.equal(torch.rand(3), after)
    x = torch.ones(200, 50, 4, 4)
    with DropoutDraws() as drawing:
        out = nn.Dropout(0.3)(x)
        channels = nn.Dropout2d(0.6)(x)
        nn.Dropout(0.3).eval()(x)
    element, channel = drawing.finish()
    assert torch.equal(out, element) and torch.equal(channels, channel.expand_as(x))
    assert element.unique().tolist() == [0.0, pytest.approx(1 / 0.7)]
    assert channel.shape == (200, 50, 1, 1)
    kept, n = float((element > 0).double().mean()), element.numel()
    assert abs(kept - 0.7) < 5 * (0.21 / n) ** 0.5
    kept, n = float((channel > 0).double().mean()), channel.numel()
    assert abs(kept - 0.4) < 5 * (0.24 / n) ** 0.5


def test_guard_protect_without_the_passs_masks_withholds_and_with_them_sends():
    """``Guard.protect`` given a gradient of a dropout model cannot know its masks: withheld, saying so. Recorded
    with ``DropoutDraws`` and passed as ``draws``, the same step is sent."""
    model, x, y = _problem()
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=3, max_rel_noise=40.0, max_excluded=0.25)
    with DropoutDraws() as drawing:
        loss = nn.functional.cross_entropy(model(x), y)
    gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
    withheld = Guard(config).protect(model, x, y, gradient)
    assert withheld.gradient is None and "masks the guard does not know" in withheld.report.reason
    sent = Guard(config).protect(model, x, y, gradient, draws=drawing.finish())
    assert sent.gradient is not None and sent.report.met, sent.report.reason


def test_a_pass_that_calls_other_dropouts_than_were_recorded_is_refused():
    """Replay is by call order: a replayed pass with another number of dropout calls raises, naming the count."""
    model, x, _ = _problem()
    params = dict(model.named_parameters())
    with DropoutDraws() as drawing:
        model(x)
    draws = drawing.finish()
    with pytest.raises(ValueError, match="did not call"):
        functional_forward(model, params, x, draws[:1])
    with pytest.raises(ValueError, match="called 3 train-mode dropouts where the recorded pass drew 4"):
        functional_forward(model, params, x, (*draws, draws[1]))


def _refused_step(model: nn.Module, error: type[Exception], match: str) -> nn.Module:
    """One ``make_guarded`` step of ``model`` (float64, a batch of four 3×2×2 inputs) refused with ``error`` matching
    ``match``, the parameters left as they were; the model returned."""
    model = model.double()
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0, max_rel_noise=40.0))
    x, y = torch.randn(4, 3, 2, 2, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    with pytest.raises(error, match=match):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return model


class _DropsAcrossTheBatch(nn.Module):
    """Dropout on a transposed activation: its first dimension is the features, not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(12, 3), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(x.flatten(1).t()).t())


def test_make_guarded_refuses_masks_it_cannot_give_each_sample_and_random_layers_it_does_not_replay():
    """A dropout whose first dimension is not the batch cannot be split per sample: the step is refused (nothing
    applied, ``.grad`` cleared). Alpha dropout and stochastic depth are still listed by ``check_model``; PyTorch's
    dropout layers are not."""
    model = _refused_step(_DropsAcrossTheBatch(), GuardMisuse, "first dimension is not the batch")
    assert all(p.grad is None for p in model.parameters())
    assert check_model(nn.Sequential(nn.Dropout(0.5), nn.Dropout1d(0.2), nn.Dropout2d(0.1), nn.Dropout3d(0.3))) == []
    problems = check_model(nn.Sequential(nn.Linear(2, 2), nn.AlphaDropout(0.2), nn.FeatureAlphaDropout(0.1)))
    assert [p.split(":")[0] for p in problems] == ["1", "2"] and "nn.Dropout" in problems[0]


def test_accumulated_micro_batches_and_a_mixed_precision_pass_replay_their_masks():
    """Two micro-batches accumulated in ``.grad`` (each pass's masks, concatenated) and a bfloat16 autocast pass
    (its masks recomputed in float32) are both found in ``.grad`` and sent."""
    model, x, y = _problem(batch=8)
    model = model.float()
    x = x.float()
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=1, max_rel_noise=40.0, max_excluded=0.25)
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                               nn.CrossEntropyLoss(), config)
    optimizer.zero_grad()
    for part in (slice(0, 4), slice(4, 8)):
        criterion(model(x[part]), y[part]).backward()
    optimizer.step()
    assert optimizer.guard_reports[-1].details["micro_batches"] == 2
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    assert len(optimizer.guard_reports) == 2


class _FunctionalDropout(nn.Module):
    """``F.dropout`` called in ``forward``, with or without an ``nn.Dropout`` layer beside it."""

    def __init__(self, with_layer: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(0.2) if with_layer else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.tanh(self.fc1(x.flatten(1))), 0.5, self.training)
        return self.fc2(self.drop(h))


@pytest.mark.parametrize("with_layer", [False, True])
def test_a_dropout_called_as_a_function_is_replayed_beside_a_layer_and_named_without_one(with_layer):
    """A model with an nn.Dropout layer has every dropout of its pass recorded, a functional one too: sent. Without
    any layer nothing is recorded, and the step is refused naming nn.Dropout, nothing applied."""
    torch.manual_seed(0)
    model = _FunctionalDropout(with_layer).double()
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0, max_rel_noise=40.0))
    x, y = torch.randn(6, 3, 2, 2, dtype=torch.float64), torch.arange(6) % 3
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    if with_layer:
        optimizer.step()
        assert optimizer.guard_reports[0].met
        return
    with pytest.raises(GuardMisuse, match="use nn.Dropout"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_the_simulations_local_sgd_guards_a_dropout_model_inside_a_guard_session():
    """``flguard.simulation.task.local_sgd`` (the ClientApp's training, ``guard_step`` on every step) records each
    pass's masks and hands them to the guard: every step of the zoo's dropout CNN is sent."""
    from flguard.data import ImageDataset
    from flguard.guard.session import open_session
    from flguard.models import create
    from flguard.simulation.task import local_sgd

    torch.manual_seed(0)
    images, labels = torch.rand(24, 1, 8, 8), torch.arange(24) % 3
    data = ImageDataset("tiny", images, labels, ("a", "b", "c"), (0.5,), (0.3,))
    model = create("dropout_cnn", in_channels=1, num_classes=3, image_size=8)
    guard = Guard(GuardConfig(pixel_mean=(0.5,), pixel_std=(0.3,), seed=2, max_rel_noise=40.0, max_excluded=0.25))
    with open_session(guard) as session:
        local_sgd(model, data, lr=0.05, steps=2, batch_size=6, generator=torch.Generator().manual_seed(0))
    assert len(session.reports) == 2 and all(report.met for report in session.reports), session.reports


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



class _DropsMixedRows(nn.Module):
    """Dropout on rows that mix samples: the batch's [B, 12] features regrouped as another [B, 12] (B = 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(12, 3), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)
        mixed = self.drop(h.t().reshape(h.shape)).reshape(h.shape[1], h.shape[0]).t()
        return self.fc(mixed)


def test_masks_whose_rows_have_the_batchs_size_but_mix_samples_are_refused():
    """The masks' first dimension is the batch's size, so ``check_batch`` passes them; each sample's pass with its
    own rows then differs from its row of the batch's output, and the step is refused, nothing applied."""
    torch.manual_seed(0)
    _refused_step(_DropsMixedRows(), GuardFailure, "do not split by sample")


class _Recurrent(nn.Module):
    """A dropout model that calls itself once (weights tied across two applications), or raises when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop, self.fail, self.inner = nn.Linear(12, 12), nn.Dropout(0.3), False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("a forward pass that fails")
        h = self.drop(torch.tanh(self.fc(x.flatten(1))))
        if self.inner:
            return h
        self.inner = True
        try:
            return self(h)[:, :3]
        finally:
            self.inner = False


def test_a_pass_that_raises_or_calls_the_model_again_leaves_no_recording_behind():
    """The recording mode lives exactly as long as the outer pass: a pass that raises leaves PyTorch's function-mode
    stack as it was, and a model that calls itself records both calls' masks in one pass, which the step replays and
    sends."""
    torch.manual_seed(0)
    model = _Recurrent().double()
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0, max_rel_noise=40.0))
    x, y = torch.randn(4, 3, 2, 2, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    depth = torch._C._len_torch_function_stack()
    model.fail = True
    with pytest.raises(RuntimeError, match="fails"):
        model(x)
    assert torch._C._len_torch_function_stack() == depth
    model.fail = False
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    assert torch._C._len_torch_function_stack() == depth
    optimizer.step()
    assert optimizer.guard_reports[-1].met


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
