"""make_guarded in the loops practitioners write for a ResNet: mixed precision (``torch.autocast``, ``GradScaler``,
a step it skips), a compiled model, a summed or class-weighted loss, and a gradient rescaled after backward — on the
3-channel GroupNorm ResNet-8 in channels-last memory.

The reference for every guarded step is the same seeded step in a plain float32 loop: the guard measures and sends
float32, so the parameters after it must be the same whatever precision the user's forward pass ran in.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from flguard import GuardConfig, check_model, make_guarded
from flguard.guard import GuardFailure
from flguard.guard.training import GuardMisuse, UnsupportedModel
from flguard.models.zoo import create

# oneDNN's channels-last strided 1×1 convolution gradient is wrong on some CPUs (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("sound_channels_last_convolutions")

LR = 0.05
CONFIG = GuardConfig(seed=0)  # the defaults, seeded so that two loops draw the same noise


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return create("resnet8_gn", image_size=8).to(memory_format=torch.channels_last)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 10, (4,), generator=g)


def flat(values) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1) for v in values])


def guarded(model: nn.Module, criterion: nn.Module | None = None, lr: float = LR):
    return make_guarded(model, torch.optim.SGD(model.parameters(), lr=lr), criterion or nn.CrossEntropyLoss(), CONFIG)


def float32_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The parameters after one seeded guarded step of a plain float32 loop on a copy of ``model``."""
    model, optimizer, criterion = guarded(copy.deepcopy(model))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert optimizer.guard_reports[-1].met
    return flat(model.parameters())


@pytest.mark.parametrize("step_inside_autocast", [False, True])
def test_a_bfloat16_forward_pass_is_guarded_in_float32(step_inside_autocast):
    """The user's bfloat16 gradient differs from float32's by percents; the guard checks .grad against the same
    autocast, then measures and sends the float32 gradient — the same step as the float32 loop's, bit for bit,
    also when optimizer.step() is called inside the autocast block (the guard switches autocast off)."""
    base = resnet()
    x, y = batch()
    expected = float32_step(base, x, y)
    model, optimizer, criterion = guarded(copy.deepcopy(base))
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = criterion(model(x), y)
        loss.backward()
        users = flat(p.grad for p in model.parameters())
        if step_inside_autocast:
            optimizer.step()
    if not step_inside_autocast:
        optimizer.step()
    exact = flat(torch.autograd.grad(nn.functional.cross_entropy(base(x), y), list(base.parameters())))
    assert float((users - exact).norm() / exact.norm()) > 1e-3  # the user's gradient really is half precision
    assert optimizer.guard_reports[-1].met
    assert torch.equal(flat(model.parameters()), expected)


def test_a_grad_scaler_loop_and_a_step_it_skips():
    """``scaler.step`` unscales .grad through the guarded optimizer's param_groups, then steps it; a step the scaler
    skips on an infinite gradient leaves its pass recorded, and the next step guards only its own batch."""
    base = resnet()
    (x1, y1), (x2, y2) = batch(1), batch(2)
    expected = float32_step(base, x2, y2)
    model, optimizer, criterion = guarded(copy.deepcopy(base))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before = flat(model.parameters())
    for step, (x, y) in enumerate([(x1, y1), (x2, y2)]):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = criterion(model(x), y)
        scaler.scale(loss).backward()
        if step == 0:  # an overflow in the scaled backward pass: the scaler skips this step
            grad = next(model.parameters()).grad
            grad[(0,) * grad.dim()] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        if step == 0:
            assert torch.equal(flat(model.parameters()), before) and not optimizer.guard_reports
    assert scaler.get_scale() == 2.0 ** 9  # backed off once
    assert len(optimizer.guard_reports) == 1 and optimizer.guard_reports[0].met
    assert torch.equal(flat(model.parameters()), expected)


def test_a_compiled_model_is_guarded_like_the_model():
    base = resnet()
    x, y = batch()
    expected = float32_step(base, x, y)
    model, optimizer, criterion = guarded(torch.compile(copy.deepcopy(base), backend="eager"))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert optimizer.guard_reports[-1].met
    assert torch.equal(flat(model.parameters()), expected)


@pytest.mark.parametrize("rescale, named", [
    (lambda params: nn.utils.clip_grad_norm_(params, 1e-3), "clip_grad_norm_"),
    (lambda params: [p.grad.mul_(2.0 ** 16) for p in params], "scaler.update"),
])
def test_a_gradient_rescaled_after_backward_is_refused_and_named(rescale, named):
    model, optimizer, criterion = guarded(resnet())
    x, y = batch()
    before = flat(model.parameters())
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    rescale(list(model.parameters()))
    with pytest.raises(GuardMisuse, match=named):
        optimizer.step()
    assert torch.equal(flat(model.parameters()), before)
    assert all(p.grad is None for p in model.parameters())


def test_mixup_as_two_criterion_calls_is_refused_naming_its_one_call_form_which_is_sent():
    """Mixup written as lam·criterion(out, y) + (1 − lam)·criterion(out, y[perm]) is refused (nothing applied, the
    message naming one_hot); its one-call form with the mixed targets as class probabilities — the same loss, to float
    rounding — is sent (at the median clip level: four samples' mixed step is otherwise withheld for its damage)."""
    model = resnet()
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=LR),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0, clip_per_sample="median"))
    x, y = batch()
    lam, perm = 0.7, torch.tensor([2, 0, 3, 1])
    mixed = lam * x + (1 - lam) * x[perm]
    before = flat(model.parameters())
    optimizer.zero_grad()
    out = model(mixed)
    two_calls = lam * criterion(out, y) + (1 - lam) * criterion(out, y[perm])
    two_calls.backward()
    with pytest.raises(GuardMisuse, match="one_hot"):
        optimizer.step()
    assert torch.equal(flat(model.parameters()), before)
    optimizer.zero_grad()
    targets = lam * nn.functional.one_hot(y, 10).float() + (1 - lam) * nn.functional.one_hot(y[perm], 10).float()
    one_call = criterion(model(mixed), targets)
    torch.testing.assert_close(one_call, two_calls.detach(), rtol=1e-6, atol=0.0)
    one_call.backward()
    optimizer.step()
    assert optimizer.guard_reports[-1].met


def test_a_summed_loss_is_guarded_as_the_mean_it_scales():
    """reduction='sum' is the mean times B: the same training at lr/B. The certificate is scale-free and the budget's
    unit is the clipped update's largest norm (B·C for a sum, the operator's ``span``), so the step is the mean's — before,
    the sum's budget stayed C and the same step needed B times the budget."""
    base = resnet()
    x, y = batch()
    expected = float32_step(base, x, y)
    model, optimizer, criterion = guarded(copy.deepcopy(base), nn.CrossEntropyLoss(reduction="sum"), LR / len(y))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert optimizer.guard_reports[-1].met
    start = flat(base.parameters())
    moved, reference = flat(model.parameters()) - start, expected - start
    assert float((moved - reference).norm()) <= 1e-4 * float(reference.norm())


def test_a_class_weighted_mean_is_guarded_as_its_weighted_sum():
    """CrossEntropyLoss(weight=w) divides by the batch's total weight W = Σ_j w_{y_j}: the guard splits it as
    (1/W) Σ_i w_{y_i}·CE_i (``flguard.risk.loss_split``) and sends the weighted sum's step times 1/W — the same
    parameters as the weighted sum stepped at lr/W, to float rounding (W is no power of two). Before, every step of
    a weighted mean was refused."""
    weights = torch.linspace(0.5, 2.0, 10)
    x, y = batch()
    total = float(weights[y].sum())
    base = resnet()
    after = []
    for reduction, lr in (("mean", LR), ("sum", LR / total)):
        model, optimizer, criterion = guarded(copy.deepcopy(base), nn.CrossEntropyLoss(weight=weights,
                                                                                      reduction=reduction), lr)
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        assert optimizer.guard_reports[-1].met
        after.append(flat(model.parameters()) - flat(base.parameters()))
    assert float((after[0] - after[1]).norm()) <= 1e-4 * float(after[1].norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_refused_up_front_naming_autocast(dtype):
    """A model cast to half precision cannot carry the certificate (its products err near 1e-2–1e-3); before, its
    steps failed one by one with unrelated reasons (the loss 'not separable', the gradient 'not the loss's')."""
    model = resnet().to(dtype)
    assert any("autocast" in problem for problem in check_model(model))
    with pytest.raises(UnsupportedModel, match=f"{dtype}.*torch.autocast"):
        guarded(model)


def test_adam_above_its_measured_learning_rate_is_warned_about():
    model = resnet()
    with pytest.warns(UserWarning, match="AdamW at lr 0.01.*lr ≤ 1e-3 or SGD"):
        make_guarded(model, torch.optim.AdamW(model.parameters(), lr=0.01), nn.CrossEntropyLoss(), CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_guarded(model, torch.optim.Adam(model.parameters(), lr=1e-3), nn.CrossEntropyLoss(), CONFIG)
        make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), CONFIG)


def test_gradient_accumulation_over_micro_batches_is_guarded_as_one_batch():
    """Two micro-batches of 4 accumulated in .grad (mean losses) are one batch of 8 with the summed loss, 2 × the
    mean over all eight: the same step as a plain loop that steps once on the eight with that loss."""
    base = resnet()
    (x1, y1), (x2, y2) = batch(1), batch(2)
    x, y = torch.cat([x1, x2]).contiguous(memory_format=torch.channels_last), torch.cat([y1, y2])
    model, optimizer, criterion = guarded(copy.deepcopy(base), lambda z, t: 2 * nn.functional.cross_entropy(z, t))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    expected = flat(model.parameters())
    model, optimizer, criterion = guarded(copy.deepcopy(base))
    optimizer.zero_grad()
    for xb, yb in ((x1, y1), (x2, y2)):
        criterion(model(xb), yb).backward()
    optimizer.step()
    report = optimizer.guard_reports[-1]
    assert report.met and report.rmse_after.shape == (8,) and report.details["micro_batches"] == 2
    start = flat(base.parameters())
    moved, reference = flat(model.parameters()) - start, expected - start
    assert float((moved - reference).norm()) <= 1e-5 * float(reference.norm())


def test_accumulated_micro_batches_whose_losses_do_not_add_up_are_refused_by_name():
    """Class-weighted means divide each micro-batch by its own total weight: no one loss over the eight samples."""
    model, optimizer, criterion = guarded(resnet(), nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 10)))
    before = flat(model.parameters())
    optimizer.zero_grad()
    for seed in (1, 2):
        xb, yb = batch(seed)
        criterion(model(xb), yb).backward()
    with pytest.raises(GuardMisuse, match="do not add up"):
        optimizer.step()
    assert torch.equal(flat(model.parameters()), before)


class Checkpointed(nn.Module):
    """The ResNet-8 with its residual layers under torch.utils.checkpoint."""

    def __init__(self, model: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.model, self.reentrant = model, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.model.layers, self.model.stem(x), use_reentrant=self.reentrant)
        return self.model.fc(self.model.pool(h).flatten(1))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_is_refused_by_name_and_nothing_is_applied(reentrant):
    """Checkpointing's saved-tensor hooks (non-reentrant) fail inside the guard's torch.func transforms, and the
    reentrant form refuses the step's torch.autograd.grad: both withheld naming torch.utils.checkpoint (they were a
    bare RuntimeError — the reentrant one escaped the step with the unguarded .grad left in place)."""
    model = Checkpointed(resnet(), reentrant)
    model, optimizer, criterion = guarded(model)
    before = flat(model.parameters())
    x, y = batch()
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    with pytest.raises(GuardFailure, match=r"use_reentrant=True" if reentrant else r"checkpointing \(torch\.utils"):
        optimizer.step()
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(flat(model.parameters()), before)
