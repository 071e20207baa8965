"""make_guarded: an ordinary ``loss.backward(); optimizer.step()`` loop applies only guarded gradients.

The floor is checked against an independent dense float64 I²F (autograd Jacobians, torch.linalg.solve)
on the noise actually applied, recovered from the parameter change of a plain SGD step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flguard import GuardConfig, GuardFailure, make_guarded
from flguard.guard.training import GuardMisuse
from risk_reference import dense_jacobians, dense_metrics, assert_reported_rmse
from guard_settings import unclipped


def tiny_cnn(dropout: float = 0.0, layer: type[nn.Module] = nn.Dropout) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 2 * 2, 8), nn.Tanh()]
    if dropout:
        layers.append(layer(dropout))
    return nn.Sequential(*layers, nn.Linear(8, 4)).double()


def batch(size: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (size,), generator=g)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


CONFIG = unclipped(defense="gaussian", min_rmse=0.2, max_rel_noise=1e4, seed=0, rtol=1e-3)


@pytest.mark.parametrize("defense", ["gaussian", "eigen"])
def test_sgd_step_applies_noise_that_meets_the_floor_against_dense_i2f(defense):
    model = tiny_cnn()
    x, y = batch()
    theta0 = flat_params(model)
    reference_model = copy.deepcopy(model)
    lr = 0.5
    eigen = {"subspace_size": 4, "krylov_steps": 8} if defense == "eigen" else {}  # eigen's own fields
    config = CONFIG.model_copy(update={"defense": defense, **eigen})
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=lr),
                                               nn.CrossEntropyLoss(), config)
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()

    jac, g = dense_jacobians(reference_model, x, y)
    applied = (theta0 - flat_params(model)) / lr          # what the step applied: g + noise
    noise = applied - g
    report = optimizer.guard_reports[-1]
    assert report.met and len(optimizer.guard_reports) == 1
    assert float(noise.norm()) == pytest.approx(report.noise_norm, rel=1e-6)  # exactly what the guard added ...
    dense = dense_metrics(jac, g, noise, eps=report.eps.double())
    assert torch.all(dense["rmse_i2f"] >= CONFIG.min_rmse)  # ... and it meets the floor on every sample
    assert_reported_rmse(report, dense["rmse_i2f"], rtol=2e-2)


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=1e-2),
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
], ids=["sgd", "sgd-momentum", "adam", "adamw"])
def test_every_optimizer_steps_on_the_guarded_gradient_only(make_optimizer):
    model = tiny_cnn()
    twin = copy.deepcopy(model)
    twin_optimizer = make_optimizer(twin.parameters())
    model, optimizer, criterion = make_guarded(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                               CONFIG)
    for step in range(3):
        x, y = batch(seed=step)
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        unguarded = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        guarded = [p.grad for p in model.parameters()]  # left in .grad: what the optimizer used
        assert sum(float((a - b).norm()) for a, b in zip(guarded, unguarded)) > 0
        for p_twin, g in zip(twin.parameters(), guarded):  # the plain optimizer fed the same gradients
            p_twin.grad = g.clone()
        twin_optimizer.step()
        torch.testing.assert_close(flat_params(model), flat_params(twin), rtol=0, atol=0)
    assert len(optimizer.guard_reports) == 3 and all(r.met for r in optimizer.guard_reports)


def test_behaves_like_the_originals():
    model = tiny_cnn()
    keys = list(model.state_dict())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guarded_model, optimizer, criterion = make_guarded(model, sgd, nn.CrossEntropyLoss(reduction="sum"), CONFIG)
    assert guarded_model is model and list(model.state_dict()) == keys
    assert isinstance(optimizer, torch.optim.Optimizer) and optimizer.param_groups is sgd.param_groups
    assert criterion.reduction == "sum"
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = batch()
    with torch.no_grad():  # evaluation passes are not recorded
        model(x)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    scheduler.step()
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.05)
    assert "momentum_buffer" in optimizer.state_dict()["state"][0]


def _step(model, optimizer, criterion, x, y):
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()


def test_misuse_is_refused_and_nothing_is_applied():
    x, y = batch()
    x2, y2 = batch(seed=7)

    def guarded(**kw):
        model = tiny_cnn(**kw)
        m, opt, crit = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), CONFIG)
        return m, opt, crit, flat_params(model)

    cases = {}
    m, opt, crit, before = guarded()  # accumulation over micro-batches of two sizes
    opt.zero_grad()
    crit(m(x), y).backward()
    crit(m(x2[:3]), y2[:3]).backward()
    cases["forward passes.*different sizes"] = (opt, m, before)
    m, opt, crit, before = guarded()  # missing zero_grad: last step's gradient is still in .grad
    _step(m, opt, crit, x, y)
    before = flat_params(m)
    crit(m(x2), y2).backward()
    cases["accumulated"] = (opt, m, before)
    m, opt, crit, before = guarded()  # a loss term the wrapper cannot see
    opt.zero_grad()
    (crit(m(x), y) + 0.1 * sum(p.square().sum() for p in m.parameters())).backward()
    cases["cannot see"] = (opt, m, before)
    m, opt, crit, before = guarded()  # the loss computed without the guarded criterion
    opt.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    cases["without a call of the guarded criterion"] = (opt, m, before)
    m, opt, crit, before = guarded()  # the prediction computed from the output outside the model and the criterion
    opt.zero_grad()
    crit(nn.functional.log_softmax(m(x), 1)[:, :10] * 1.0, y).backward()
    cases["computed from the guarded model's output outside the model"] = (opt, m, before)
    m, opt, crit, before = guarded(dropout=0.5, layer=nn.AlphaDropout)  # a random layer the guard does not replay
    opt.zero_grad()
    crit(m(x), y).backward()
    cases["AlphaDropout"] = (opt, m, before)
    for message, (opt, m, before) in cases.items():
        with pytest.raises(GuardMisuse, match=message):
            opt.step()
        assert torch.equal(flat_params(m), before), message
        assert all(p.grad is None for p in m.parameters()), message  # the unguarded gradient is gone
    with pytest.raises(GuardMisuse, match="closure"):
        guarded()[1].step(lambda: 0.0)


def test_a_computation_on_the_output_folded_into_the_criterion_is_guarded():
    """What the refusal above asks for: the log-softmax moved into the criterion given to make_guarded — the step is
    sent, and it is the plain loop's gradient plus the noise the report states."""
    model = tiny_cnn()
    x, y = batch()
    loss = lambda out, target: nn.functional.nll_loss(nn.functional.log_softmax(out, 1), target)  # noqa: E731
    reference = torch.autograd.grad(loss(model(x), y), list(model.parameters()))
    m, opt, crit = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.0), loss, CONFIG)
    opt.zero_grad()
    crit(m(x), y).backward()
    opt.step()
    report = opt.guard_reports[-1]
    assert report.met
    noise = torch.cat([p.grad.reshape(-1) for p in m.parameters()]) - torch.cat([g.reshape(-1) for g in reference])
    assert float(noise.norm()) == pytest.approx(report.noise_norm, rel=1e-9)


class _TokenClassifier(nn.Module):
    """A text model: token ids through ``nn.Embedding``, mean pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.head = nn.Embedding(50, 8), nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(1))


def test_integer_inputs_are_withheld_with_the_reason_and_nothing_applied():
    """Token ids are no input to differentiate: the step is withheld (``GuardFailure``) naming them, nothing applied."""
    model = _TokenClassifier()
    m, opt, crit = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), CONFIG)
    before = flat_params(model)
    opt.zero_grad()
    crit(m(torch.randint(0, 50, (4, 6))), torch.tensor([0, 1, 2, 3])).backward()
    with pytest.raises(GuardFailure, match="token ids"):
        opt.step()
    assert torch.equal(flat_params(model), before)


def test_a_withheld_step_raises_guard_failure_and_leaves_the_model_unchanged():
    model = tiny_cnn()
    config = CONFIG.model_copy(update={"min_rmse": 50.0, "max_rel_noise": 1.0})  # out of the budget's reach
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               nn.CrossEntropyLoss(), config)
    before = flat_params(model)
    x, y = batch()
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    with pytest.raises(GuardFailure, match="max_rel_noise"):
        optimizer.step()
    assert torch.equal(flat_params(model), before)
    assert all(p.grad is None for p in model.parameters())
    assert len(optimizer.guard_reports) == 1 and not optimizer.guard_reports[0].met


def test_without_a_config_it_needs_the_flower_mod():
    model = tiny_cnn()
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               nn.CrossEntropyLoss())
    x, y = batch()
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    with pytest.raises(GuardMisuse, match="guard_mod"):
        optimizer.step()


def test_per_sample_clipping_and_a_psnr_floor_work_through_the_drop_in():
    """With clip_per_sample the step applies the clipped mean gradient plus the guard's noise."""
    model = tiny_cnn()
    config = unclipped(defense="eigen", max_psnr=20.0, pixel_mean=0.5, pixel_std=0.5, clip_per_sample=0.5,
                         max_rel_noise=50.0, subspace_size=4, krylov_steps=8, seed=0)
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                               nn.CrossEntropyLoss(), config)
    x, y = batch()
    theta0 = flat_params(model)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    report = optimizer.guard_reports[-1]
    assert report.met, report.reason
    applied = theta0 - flat_params(model)
    assert float(applied.norm()) <= 0.5 + report.noise_norm + 1e-9  # ‖clipped mean‖ ≤ C, plus the noise


@pytest.mark.parametrize("make_optimizer, step_size, sent", [
    (lambda params: torch.optim.SGD(params, lr=1e3), 1e3, "resolvent"),  # lr × the Gaussian's noise ≫ 10% of ‖θ‖
    (lambda params: torch.optim.SGD(params, lr=1e-9), 1e-9, "gaussian"),
    (lambda params: torch.optim.Adam(params, lr=1e3), None, "gaussian"),  # Adam's step is not lr × g: no step size
    (lambda params: torch.optim.SGD(params, lr=1e-9, momentum=0.9), 1e-9 / 0.19 ** 0.5, "gaussian"),  # √(1 − 0.9²)
    (lambda params: torch.optim.SGD(params, lr=1e3, momentum=1.0), None, "gaussian"),  # no stationary RMS: no move
])
def test_auto_judges_the_gaussians_move_by_an_sgd_learning_rate(make_optimizer, step_size, sent):
    """``make_guarded`` hands ``auto`` the step size of a plain SGD optimizer (its largest lr) and none for
    others; with a step at which the Gaussian's noise would swamp the weights, the aimed noise (``auto``'s default
    fallback, resolvent) is applied, and
    it meets the floor under dense recomputation (the noise recovered from the parameter change)."""
    model = tiny_cnn()
    x, y = batch()
    theta0 = flat_params(model)
    reference_model = copy.deepcopy(model)
    config = CONFIG.model_copy(update={"defense": "auto", "subspace_size": 4, "krylov_steps": 8})
    model, optimizer, criterion = make_guarded(model, make_optimizer(model.parameters()), nn.CrossEntropyLoss(),
                                               config)
    assert optimizer._sgd_step_size() == (None if step_size is None else pytest.approx(step_size, rel=1e-12))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    report = optimizer.guard_reports[-1]
    assert report.met and report.details["defense_used"] == sent
    if sent == "resolvent":  # plain SGD: the parameters moved by lr × (g + noise)
        jac, g = dense_jacobians(reference_model, x, y)
        noise = (theta0 - flat_params(model)) / step_size - g
        dense = dense_metrics(jac, g, noise, report.eps)["rmse_i2f"]
        assert torch.all(dense >= 0.2), dense


@pytest.mark.parametrize("momentum, dampening, nesterov", [(0.0, 0.0, False), (0.9, 0.0, False), (0.5, 0.3, False),
                                                           (0.9, 0.0, True)])
def test_momentum_gain_is_the_rms_step_of_torchs_sgd_on_independent_noise(momentum, dampening, nesterov):
    """``momentum_gain`` (the move rule's step size ÷ lr) against torch.optim.SGD itself: fed independent
    unit-RMS noise as gradients, its steps' root mean square after a burn-in is lr × the gain (2.29× at
    μ = 0.9, 2.66× with Nesterov), to the 2% that 100 × 4,000 samples resolve."""
    from flguard.guard.training import momentum_gain
    generator = torch.Generator().manual_seed(0)
    param = nn.Parameter(torch.zeros(4000, dtype=torch.float64))
    sgd = torch.optim.SGD([param], lr=0.5, momentum=momentum, dampening=dampening, nesterov=nesterov)
    squares = []
    for step in range(300):
        before = param.detach().clone()
        param.grad = torch.randn(4000, generator=generator, dtype=torch.float64)
        sgd.step()
        if step >= 200:  # μ^200 ≈ 1e-9: stationary
            squares.append(float((param.detach() - before).square().mean()))
    measured = (sum(squares) / len(squares)) ** 0.5 / 0.5
    assert measured == pytest.approx(momentum_gain(momentum, dampening, nesterov), rel=0.02)
    assert momentum_gain(0.9) == pytest.approx(0.19 ** -0.5) and momentum_gain(0.9, nesterov=True) > momentum_gain(0.9)
