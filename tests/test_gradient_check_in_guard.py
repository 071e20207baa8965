"""``make_guarded``'s step checks ``.grad`` against the guard's own gradient of the batch loss (``CHECK_IN_GUARD``):
the sum of the per-sample gradients its clipping takes anyway, handed to ``Guard.protect``'s ``check_gradient`` —
instead of recomputing the pass's gradient first. The same steps are sent and the same loops refused; the pass is
recomputed only where the guard's sum does not explain ``.grad``. On the 3-channel GroupNorm ResNet-8 in
channels-last memory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flguard import GuardConfig, make_guarded
from flguard.guard import Guard, GuardFailure, training
from flguard.guard.failure import UnexplainedGradient
from flguard.guard.training import GuardedOptimizer, GuardMisuse
from flguard.models.zoo import create
from flguard.risk import sample_gradients

pytestmark = pytest.mark.usefixtures("sound_channels_last_convolutions")

CONFIG = GuardConfig(seed=0)


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return create("resnet8_gn", image_size=8).to(memory_format=torch.channels_last)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.rand(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last), torch.randint(0, 10, (4,),
                                                                                                           generator=g)


def flat(values) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1) for v in values])


def counted_recomputes(monkeypatch) -> list[int]:
    calls = [0]
    recompute = GuardedOptimizer._recompute

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return recompute(self, *args, **kwargs)
    monkeypatch.setattr(GuardedOptimizer, "_recompute", counting)
    return calls


def two_steps(model: nn.Module, extra: float = 0.0) -> torch.Tensor:
    """The parameters after two seeded guarded steps, the first sent (``extra``: a term the criterion does not see;
    the second withheld or sent, as the guard finds)."""
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                               nn.CrossEntropyLoss(), CONFIG)
    x, y = batch()
    for _ in range(2):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        (loss + extra * sum(p.square().sum() for p in model.parameters())).backward()
        try:
            optimizer.step()
        except GuardFailure as failure:
            if isinstance(failure, GuardMisuse):
                raise
    assert len(optimizer.guard_reports) == 2 and optimizer.guard_reports[0].met
    return flat(model.parameters())


def test_the_step_sends_the_same_update_without_recomputing_the_pass(monkeypatch):
    base = resnet()
    calls = counted_recomputes(monkeypatch)
    monkeypatch.setattr(training, "CHECK_IN_GUARD", False)
    expected = two_steps(copy.deepcopy(base))
    assert calls[0] == 2  # one recompute a step, before the guard
    monkeypatch.setattr(training, "CHECK_IN_GUARD", True)
    assert torch.equal(two_steps(copy.deepcopy(base)), expected)
    assert calls[0] == 2  # none more: .grad was explained by the guard's own gradient


def test_where_the_guards_sum_does_not_explain_grad_the_pass_is_recomputed(monkeypatch):
    """A sum of per-sample gradients off by more than rounding (1e-3 here, made so) is not taken as the check: the
    pass is recomputed inside the guard's step, which then goes on — the same update as without the check."""
    base = resnet()
    monkeypatch.setattr(training, "CHECK_IN_GUARD", False)
    expected = two_steps(copy.deepcopy(base))
    monkeypatch.setattr(training, "CHECK_IN_GUARD", True)
    take = sample_gradients.SampleGradients._take_total
    monkeypatch.setattr(sample_gradients.SampleGradients, "_take_total", lambda self: take(self) * (1 + 1e-3))
    calls = counted_recomputes(monkeypatch)
    got = two_steps(copy.deepcopy(base))
    assert calls[0] == 2
    assert float((got - expected).norm()) <= 1e-4 * float(expected.norm())  # (the clipping read the scaled sum)


def test_a_grad_of_another_loss_is_refused_with_the_same_error(monkeypatch):
    errors = []
    for check in (False, True):
        monkeypatch.setattr(training, "CHECK_IN_GUARD", check)
        with pytest.raises(GuardMisuse) as caught:
            two_steps(resnet(), extra=1e-2)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert ".grad differs from the gradient of criterion(model(x), y)" in errors[1]


def test_protect_hands_check_gradient_the_batch_loss_gradient_and_draws_nothing_when_refused():
    model = resnet()
    x, y = batch()
    exact = flat(torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters())))
    seen = []

    def refuse(measured: torch.Tensor) -> bool:
        seen.append(measured)
        return False
    guard = Guard(CONFIG)
    with pytest.raises(UnexplainedGradient):
        guard.protect(model, x, y, exact, check_gradient=refuse)
    assert len(seen) == 1
    assert float((seen[0] - exact).norm()) <= 1e-5 * float(exact.norm())
    # nothing of the guard's moved: its next step is a fresh guard's first
    after = guard.protect(model, x, y, exact, check_gradient=lambda measured: True)
    fresh = Guard(CONFIG).protect(model, x, y, exact)
    assert after.report.met and torch.equal(after.gradient, fresh.gradient)
