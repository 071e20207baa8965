"""Train-mode dropout guarded as it trains: each pass's masks recorded and replayed (``flguard.risk.dropout_draws``).

The references here never use the replay: a copy of the model's forward pass multiplies by the masks as plain
tensors (``DropoutResNet.fixed``), and the masks of the user's pass are read off the dropout layers' own inputs and
outputs by forward hooks. Against them: the operator's products on its three paths, and the noise that
``make_guarded`` sends, certified by dense float64 I²F.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flguard import GuardConfig, GuardFailure, check_model, make_guarded
from flguard.guard import Guard
from flguard.guard.recorder import GuardMisuse
from flguard.risk import direct
from flguard.risk.dropout_draws import DropoutDraws, ReplayedDropPath
from flguard.risk.functional import functional_forward
from flguard.risk.operator import JacobianOperator
from guard_settings import unclipped
from risk_reference import (sample_gradient, assert_certified_on_dense_float64, assert_products_match_dense,
                            assert_reported_rmse, clipped_upload_jacobians, step_reading_masks)

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
        fixed = self.fixed
        branch = branch * fixed[0] * fixed[1] if fixed is not None else self.drop_path(self.drop2d(branch))
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


@pytest.mark.parametrize("path", ["cached", "direct", "one at a time", "ghost"])
def test_the_operator_replays_each_samples_masks_on_every_path_against_dense_float64(path, monkeypatch):
    """The operator draws the masks in its first pass (no draws given) and every product replays sample i's own:
    J_iv, J_iᵀu, K_iu, the per-sample gradients, Σ_iJ_iᵀu_i and a restricted operator's rows equal the dense
    Jacobians of the model with those masks as fixed multipliers, on the cached path, the vmapped direct path, plain
    autograd one sample at a time and the batched ghost products (their graphs built with each row's masks), with
    channels-last weights and inputs."""
    if path == "one at a time":
        monkeypatch.setattr(direct, "GHOST_KMV", False)
    model, x, y = _problem()
    op = JacobianOperator(model, x, y, products={"cached": "cached", "ghost": "ghost"}.get(path, "direct"))
    if path == "one at a time":
        op.sample_chunk = 1
    assert op.one_at_a_time == (path in ("one at a time", "ghost")) and op.drew_masks and len(op.draws) == 3
    assert (getattr(op, "_ghost", None) is not None) == (path == "ghost")
    channel, branch, feature = op.draws
    assert channel.shape == (6, 4, 1, 1) and branch.shape == (6, 1, 1, 1) and feature.shape == (6, 4)
    assert set(channel.unique().tolist()) <= {0.0, 1 / 0.75} and set(feature.unique().tolist()) <= {0.0, 2.0}
    forward = _masked_forward(model, op.draws)
    jac = clipped_upload_jacobians(model, x, y, 1.0, torch.zeros(6, dtype=torch.bool), forward)  # (1/B) J̃_i
    v, u = assert_products_match_dense(op, jac)
    close = dict(rtol=1e-9, atol=1e-12)
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
    report, seen = step_reading_masks(model, optimizer, criterion, x, y, lambda: _masks_of_the_next_pass(model))
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
    # seeds 0 and 1 draw a sample whose noise has no measurable effect (its gradient does not move with its input,
    # as when all four features are dropped), which the unclipped guard, leaving no sample out, cannot certify: it
    # withholds
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


class _DropsTheWeight(nn.Module):
    """Dropout on a weight ("DropConnect"): one mask shared by every sample of the batch, no dimension of it theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(12, 3), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.flatten(1), self.drop(self.fc.weight), self.fc.bias)


def test_make_guarded_refuses_masks_it_cannot_give_each_sample_and_random_layers_it_does_not_replay():
    """A dropout none of whose dimensions is the batch cannot be split per sample: the step is refused (nothing
    applied, ``.grad`` cleared). Alpha dropout and stochastic depth are still listed by ``check_model``; PyTorch's
    dropout layers are not."""
    model = _refused_step(_DropsTheWeight(), GuardMisuse, "no one dimension of it is the batch")
    assert all(p.grad is None for p in model.parameters())
    assert check_model(nn.Sequential(nn.Dropout(0.5), nn.Dropout1d(0.2), nn.Dropout2d(0.1), nn.Dropout3d(0.3))) == []
    problems = check_model(nn.Sequential(nn.Linear(2, 2), nn.AlphaDropout(0.2), nn.FeatureAlphaDropout(0.1)))
    assert [p.split(":")[0] for p in problems] == ["1", "2"] and "nn.Dropout" in problems[0]


class _DropsAcrossTheBatch(nn.Module):
    """Dropout on a transposed activation (features, batch): the batch is its second dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(12, 3), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(torch.tanh(x.flatten(1)).t()).t())


def test_masks_with_the_batch_at_another_dimension_are_stored_batch_first_and_replayed_in_place():
    """``check_batch`` finds each mask's batch where a one-sample pass's shape has 1 and the batch's has N — whatever
    the other sizes (here all five) — moves it to the front, marking its place by the rank, and is idempotent;
    ``aligned`` puts each sample's column, and the batch's, back where the pass has them (exactly the recorded
    values); a mask shared by the samples or paired across them is refused. ``make_guarded`` then sends the step of a
    model that drops a transposed activation (its batch second)."""
    from flguard.risk.dropout_draws import aligned, as_one_sample, check_batch, sample_rows

    drawn = torch.rand(5, 5, 5)  # (L, N, E): the batch of five second, the other sizes five too
    (stored,) = check_batch((drawn,), 5, [torch.Size((5, 1, 5))])
    assert stored.shape == (5, 1, 5, 5) and check_batch((stored,), 5, [torch.Size((5, 1, 5))])[0] is stored
    assert torch.equal(aligned(stored, torch.zeros(5, 5, 5)), drawn)
    for i in range(5):
        (one,) = as_one_sample(sample_rows((stored,), i))
        assert torch.equal(aligned(one, torch.zeros(5, 1, 5)), drawn[:, i:i + 1])
    assert torch.equal(aligned(stored[1:3], torch.zeros(5, 2, 5)), drawn[:, 1:3])
    with pytest.raises(ValueError, match="replayed on a tensor of shape"):
        aligned(stored, torch.zeros(5, 4, 5))
    for shared, one in ((torch.rand(3, 12), (3, 12)), (torch.rand(5, 5), (1, 1))):  # on a weight; pairwise (N, N)
        with pytest.raises(ValueError, match="no one dimension of it is the batch"):
            check_batch((shared,), 5, [torch.Size(one)])
    torch.manual_seed(0)
    model = _DropsAcrossTheBatch().double()
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0, max_rel_noise=40.0))
    x, y = torch.randn(5, 3, 2, 2, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert optimizer.guard_reports[-1].met, optimizer.guard_reports[-1].reason


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
    """``F.dropout`` and ``torch.dropout`` called in ``forward``, with or without an ``nn.Dropout`` layer beside
    them."""

    def __init__(self, with_layer: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(0.2) if with_layer else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.tanh(self.fc1(x.flatten(1))), 0.5, self.training)
        h = torch.dropout(h, 0.2, train=self.training)  # torch's own name for it
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
