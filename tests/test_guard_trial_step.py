"""The optimizer's own step measured on a copy (``flguard.guard.trial_step``), and ``clip_per_sample="auto"`` judging
what its noise does to an Adam step as it does to SGD's (``flguard.guard.damage``), on a 3-channel GroupNorm ResNet.
References: the steps torch's optimizers take on the model itself (and on a copy of model and optimizer with a zero
gradient); Adam's first step from a fresh state in closed form, −lr·g/(|g| + eps) (its bias corrections cancel);
torch's Adam fed one gradient among zeros, its denominator held by a large eps, for the momentum's later shares;
the batch loss evaluated on copies of the model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flguard import GuardConfig, make_guarded
from flguard.guard import Guard
from flguard.guard.damage import step_effect
from flguard.guard.trial_step import adam_gain, momentum_gain, trial_displacement
from flguard.risk.operator import JacobianOperator
from risk_reference import resnet8_gn_batch

OPTIMIZERS = [(torch.optim.Adam, {"lr": 1e-2}), (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}), (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9}),
              (torch.optim.Adagrad, {"lr": 1e-2}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True})]


@pytest.fixture(scope="module")
def problem():
    return resnet8_gn_batch()


def _flat_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _loss_moved(model: nn.Module, x: torch.Tensor, y: torch.Tensor, change: torch.Tensor) -> float:
    moved, offset = copy.deepcopy(model), 0
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(change[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return float(nn.functional.cross_entropy(moved(x), y))


def _fresh_adam(lr: float, eps: float):
    """A fresh Adam's step in closed form, −lr·g/(|g| + eps), at the gain the trial judges it with (t = 1)."""
    return lambda gradient: -adam_gain(0.9, 1) * lr * gradient / (gradient.abs() + eps)


def _clipped_upload(per: torch.Tensor, clip: float) -> torch.Tensor:
    """The dense clipped upload Σ_i min(1, C/‖g_i‖)·g_i / B from the per-sample gradients ``per``."""
    return (per * torch.clamp(clip / per.norm(dim=1), max=1.0)[:, None]).mean(0)


@pytest.mark.parametrize("kind, settings", OPTIMIZERS + [(torch.optim.Adam, {"lr": 1e-2, "channels_last": True})],
                         ids=lambda value: getattr(value, "__name__", str(value)))
def test_the_trial_is_the_step_the_optimizer_takes_and_leaves_it_untouched(problem, kind, settings):
    model, x, y, _ = problem
    model, settings = copy.deepcopy(model), dict(settings)
    if settings.pop("channels_last", False):  # convolution weights (and their gradients) stored channels-last
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
        assert not next(p for p in model.parameters() if p.dim() == 4).is_contiguous()
    params = list(model.parameters())
    optimizer = kind(params, **settings)
    for half in (slice(0, 4), slice(4, 8)):  # a state of two steps
        _flat_grad(model, x[half], y[half])
        optimizer.step()
    g = _flat_grad(model, x, y)
    kept = copy.deepcopy(optimizer.state_dict())
    before = torch.cat([p.detach().reshape(-1) for p in params])
    trial = trial_displacement(optimizer, params)
    noise = torch.randn(g.shape, generator=torch.Generator().manual_seed(3))
    other = trial(g + noise)  # another gradient first: each trial starts from the same state
    predicted = trial(g)
    for (key, value), (_, was) in zip(optimizer.state_dict()["state"].items(), kept["state"].items()):
        for name in value:
            assert torch.equal(torch.as_tensor(value[name]), torch.as_tensor(was[name])), (key, name)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), before)
    assert not torch.equal(other, predicted)
    idle_model, idle = copy.deepcopy((model, optimizer))  # the momentum's own step: a zero gradient
    for p in idle_model.parameters():
        p.grad = torch.zeros_like(p)
    idle.step()
    optimizer.step()  # the model's .grad is g
    idle_step = torch.cat([p.detach().reshape(-1) for p in idle_model.parameters()]) - before
    taken = torch.cat([p.detach().reshape(-1) for p in params]) - before
    torch.testing.assert_close(predicted, trial_gain_at(kind, settings) * (taken - idle_step), rtol=0, atol=3e-7)


def trial_gain_at(kind, settings) -> float:
    """The gain the trial used (``lifetime_gain`` written out): Adam's at its third step (two taken), SGD's with
    Nesterov its momentum's ÷ the first step's 1 + μ, RMSprop's 1/√(1 − μ²), none for Adagrad."""
    if kind is torch.optim.Adagrad:
        return 1.0
    if kind is torch.optim.SGD:
        return momentum_gain(0.9, 0.0, True) / 1.9
    if kind is torch.optim.RMSprop:
        return (1 - 0.9 ** 2) ** -0.5
    return adam_gain(0.9, 3)


@pytest.mark.parametrize("step", [1, 3, 50])
def test_adams_gain_against_torchs_adam(step):
    """A gradient of 1 at step t among zeros, through torch's Adam with eps = 1e6 (its step then m̂·lr/eps to 1e-6):
    the root mean square of its shares of the steps from t on ÷ its share in step t; stationary 1/√(1 − β1²)."""
    param = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    adam = torch.optim.Adam([param], lr=1.0, eps=1e6, betas=(0.9, 0.999))
    shares = []
    for number in range(1, step + 400):
        param.grad = torch.ones_like(param) if number == step else torch.zeros_like(param)
        before = float(param.detach())
        adam.step()
        if number >= step:
            shares.append(float(param.detach()) - before)
    measured = sum(share * share for share in shares) ** 0.5 / abs(shares[0])
    assert adam_gain(0.9, step) == pytest.approx(measured, rel=1e-5)
    assert adam_gain(0.9, 10 ** 4) == pytest.approx(0.19 ** -0.5, rel=1e-9) and adam_gain(0.0, 1) == 1.0


def test_adams_first_step_in_closed_form_and_its_effect(problem):
    """A fresh Adam's step is −lr·g/(|g| + eps), judged at its gain at t = 1 (its first moment's later shares); P and
    D on that step against the batch loss on moved copies."""
    model, x, y, per = problem
    lr, eps = 3e-3, 1e-8
    params = list(model.parameters())
    trial = trial_displacement(torch.optim.Adam(params, lr=lr, eps=eps), params)
    g = per.mean(0)
    noise = 0.3 * torch.randn(g.shape, generator=torch.Generator().manual_seed(4))
    adam = _fresh_adam(lr, eps)
    torch.testing.assert_close(trial(g), adam(g), rtol=1e-6, atol=1e-10)
    progress, damage, loss = step_effect(JacobianOperator(model, x, y), trial)(g, noise)
    stepped = _loss_moved(model, x, y, adam(g))
    assert loss == pytest.approx(_loss_moved(model, x, y, torch.zeros_like(g)), rel=1e-9)
    assert progress == pytest.approx(loss - stepped, rel=1e-4, abs=1e-7)
    assert damage == pytest.approx(_loss_moved(model, x, y, adam(g + noise)) - stepped, rel=1e-4, abs=1e-7)


def test_make_guarded_judges_adams_step(problem):
    """Through ``make_guarded`` with Adam and ``clip_per_sample="auto"`` (the default): the step starts from the median
    (no step size, no move to judge) and its report carries P and D of Adam's own step, its noise the gradient sent
    less the dense clipped upload at the reported C."""
    model, x, y, per = problem
    model = copy.deepcopy(model)
    lr, eps = 1e-4, 1e-8
    model, optimizer, criterion = make_guarded(model, torch.optim.Adam(model.parameters(), lr=lr, eps=eps),
                                               nn.CrossEntropyLoss(), GuardConfig(min_rmse=0.05, seed=5,
                                                                                  max_excluded=0.0))
    start = copy.deepcopy(model)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    details = optimizer.guard_reports[-1].details
    assert optimizer.guard_reports[-1].met and details["clip_rule"] == "median"
    sent = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    upload, adam = _clipped_upload(per, details["clip"]), _fresh_adam(lr, eps)
    stepped = _loss_moved(start, x, y, adam(upload))
    assert details["batch_loss"] - stepped == pytest.approx(details["step_progress"], rel=1e-3, abs=1e-7)
    assert _loss_moved(start, x, y, adam(sent)) - stepped == pytest.approx(details["noise_damage"], rel=1e-3, abs=1e-7)


def test_the_functional_path_passes_the_step_rule(problem):
    """``guard_step(step_rule=…)`` under a session: the report judges that step (P and D of Adam's closed-form first
    step with the upload at the reported C), from the median."""
    from flguard.flower.guard_mod import guard_step
    from flguard.guard.session import open_session

    model, x, y, per = problem
    lr, eps = 1e-4, 1e-8
    params = list(model.parameters())
    rule = trial_displacement(torch.optim.Adam(params, lr=lr, eps=eps), params)
    g = per.mean(0)
    with open_session(Guard(GuardConfig(min_rmse=0.05, seed=6, max_excluded=0.0))) as session:
        sent = guard_step(model, x, y, list(g.split([p.numel() for p in params])), step_rule=rule)
    details = session.reports[-1].details
    assert details["clip_rule"] == "median"
    upload, adam = _clipped_upload(per, details["clip"]), _fresh_adam(lr, eps)
    stepped = _loss_moved(model, x, y, adam(upload))
    noisy = torch.cat([piece.reshape(-1) for piece in sent])
    assert _loss_moved(model, x, y, adam(noisy)) - stepped == pytest.approx(details["noise_damage"], rel=1e-3, abs=1e-7)


class _Uncopyable(torch.optim.SGD):
    def __deepcopy__(self, memo):
        raise TypeError("holds something that cannot be copied")


def test_an_optimizer_that_cannot_be_copied_is_not_judged(problem):
    model, *_ = problem
    params = list(model.parameters())
    assert trial_displacement(_Uncopyable(params, lr=0.1), params) is None
