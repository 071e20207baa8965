"""Fine-tuning: a pretrained BatchNorm kept frozen (``fix_model(batchnorm="frozen")``), a frozen backbone in an
optimizer built over ``model.parameters()``, and a head-only optimizer over a backbone left trainable — each
guarded on the parameters the optimizer applies, against dense float64 I²F and against the same step taken with
the backbone frozen."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from flguard import GuardConfig, check_model, fix_model, make_guarded
from flguard.guard import FrozenBatchNorm
from risk_reference import assert_certified_on_dense_float64

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


class SmallBatchNormResNet(nn.Module):
    """A 3-channel residual block with BatchNorm (as torchvision's ResNets), pooling and a linear head."""

    def __init__(self, width: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(width)
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn0(self.stem(x)))
        h = torch.relu(h + self.bn1(self.conv(h)))
        return self.fc(self.pool(h).flatten(1))


def _pretrained(seed: int = 0) -> SmallBatchNormResNet:
    """Running statistics away from their initial 0 / 1 and affine weights away from 1 / 0: train-mode passes."""
    torch.manual_seed(seed)
    model = SmallBatchNormResNet().double()
    with torch.no_grad():
        for norm in (model.bn0, model.bn1):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.3, 0.3)
        for _ in range(4):
            model(torch.randn(8, 3, 6, 6, dtype=torch.float64) * 2 + 0.5)
    return model


def _batch():
    x = (torch.rand(4, 3, 6, 6, dtype=torch.float64) - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(
        STD).view(1, 3, 1, 1)
    return x.to(memory_format=torch.channels_last), torch.tensor([0, 1, 3, 4])


def test_frozen_batchnorm_computes_the_pretrained_eval_map_in_train_mode_and_is_accepted():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10)
    with torch.no_grad():
        model(torch.randn(8, 3, 32, 32) * 2 + 1)  # running statistics of a "pretraining"
    model.eval()
    x = torch.randn(3, 3, 32, 32)
    expected = model(x)
    fixed = fix_model(model, batchnorm="frozen").train()
    assert check_model(fixed) == [] and len(check_model(model)) == 20  # not in place
    assert isinstance(fixed.layer2[0].downsample[1], FrozenBatchNorm)
    statistics = fixed.bn1.running_mean.clone()
    torch.testing.assert_close(fixed(x), expected, rtol=1e-5, atol=1e-6)  # train mode: the eval map
    assert torch.equal(fixed.bn1.running_mean, statistics)  # nothing updated from the batch
    assert torch.equal(fixed.bn1.weight, model.bn1.weight) and fixed.bn1.weight is not model.bn1.weight
    assert sum(p.numel() for p in fixed.parameters()) == sum(p.numel() for p in model.parameters())
    model.bn1.weight.requires_grad_(False)
    assert not fix_model(model, batchnorm="frozen").bn1.weight.requires_grad  # requires_grad carried over


def test_fix_model_refuses_a_batchnorm_without_running_statistics_and_an_unknown_fix():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.raises(ValueError, match=r"1 \(BatchNorm2d\).*track_running_stats=False.*groupnorm"):
        fix_model(model, batchnorm="frozen")
    with pytest.raises(ValueError, match="batchnorm='instance'"):
        fix_model(model, batchnorm="instance")
    assert isinstance(fix_model(model)[1], nn.GroupNorm)


def test_a_frozen_pretrained_backbone_in_an_optimizer_over_all_parameters_is_certified_on_the_head():
    """The usual fine-tuning loop: BatchNorms frozen as pretrained, the backbone frozen, SGD built over
    model.parameters() (torch skips the frozen ones). It was refused ("a parameter that is not a trainable
    parameter"); now the guard measures the head — the noise sent certifies every kept sample against dense
    float64 I²F over the head's parameters, the backbone does not move, and a stale gradient left on a frozen
    parameter is cleared, never applied."""
    model = fix_model(_pretrained(), batchnorm="frozen")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    backbone = [p.detach().clone() for name, p in model.named_parameters() if not name.startswith("fc.")]
    model.stem.weight.grad = torch.ones_like(model.stem.weight)  # stale, from before the freeze
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=3, clip_per_sample="median", max_excluded=0.25,
                         max_rel_noise=40.0, rtol=1e-2)
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                               nn.CrossEntropyLoss(), config)
    x, y = _batch()
    optimizer.zero_grad(set_to_none=False)  # keeps the stale gradient's tensor (zeroed): set it again below
    model.stem.weight.grad.fill_(1.0)
    criterion(model(x), y).backward()
    optimizer.step()
    report = optimizer.guard_reports[0]
    assert report.met, report.reason
    assert model.stem.weight.grad is None
    assert all(torch.equal(a, p) for a, (name, p) in zip(backbone, [(n, q) for n, q in model.named_parameters()
                                                                    if not n.startswith("fc.")]))
    assert_certified_on_dense_float64(model, x, y, config, report)


def _head_step(freeze_backbone: bool, x, y) -> tuple[list[torch.Tensor], nn.Module]:
    model = fix_model(_pretrained(1), batchnorm="frozen")
    if freeze_backbone:
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("fc."))
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=5, max_rel_noise=40.0, max_excluded=0.25)
    optimizer = torch.optim.SGD(model.fc.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, criterion = make_guarded(model, optimizer, nn.CrossEntropyLoss(), config)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert optimizer.guard_reports[0].met, optimizer.guard_reports[0].reason
    return [p.detach().clone() for p in model.parameters()], model


def test_a_head_only_optimizer_over_a_trainable_backbone_is_guarded_as_the_frozen_backbone_is():
    """An optimizer over model.fc alone while the backbone stays trainable: the guard used to measure, clip and
    perturb every trainable parameter (the backbone's products too) while the optimizer applied the head's part.
    Now make_guarded warns naming the backbone's parameters, the step measures the head alone — the very step of
    the same loop with the backbone frozen, bit for bit — and clears the backbone's unguarded gradients."""
    x, y = _batch()
    frozen, _ = _head_step(True, x, y)
    with pytest.warns(UserWarning, match=r"6 trainable parameters .*\(stem\.weight, bn0\.weight, bn0\.bias, …\)"):
        trainable, model = _head_step(False, x, y)
    assert all(torch.equal(a, b) for a, b in zip(frozen, trainable))
    assert all(p.grad is None for name, p in model.named_parameters() if not name.startswith("fc."))
    assert all(p.requires_grad for p in model.parameters())  # restored after the step


def test_make_guarded_refuses_an_optimizer_over_foreign_or_only_frozen_parameters():
    model = fix_model(_pretrained(), batchnorm="frozen")
    other = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="not one of the model's"):
        make_guarded(model, torch.optim.SGD([*model.parameters(), other], lr=0.1), nn.CrossEntropyLoss(), GuardConfig())
    model.fc.requires_grad_(False)
    with pytest.raises(ValueError, match="none of the model's trainable parameters"):
        make_guarded(model, torch.optim.SGD(model.fc.parameters(), lr=0.1), nn.CrossEntropyLoss(), GuardConfig())


def _unfrozen_step(later: bool) -> list[torch.Tensor]:
    """fc, then bn1's affine weights trained; ``later``: bn1 unfrozen after make_guarded and added with
    add_param_group (a generator, as ``model.bn1.parameters()``); else both in the optimizer from the start."""
    model = fix_model(_pretrained(), batchnorm="frozen")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc.") or (not later and name.startswith("bn1.")))
    groups = [{"params": model.fc.parameters()}] + ([] if later else [{"params": model.bn1.parameters(), "lr": 0.05}])
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(groups, lr=0.1), nn.CrossEntropyLoss(),
                                               GuardConfig(seed=1, max_rel_noise=1e3))
    if later:
        model.bn1.requires_grad_(True)
        optimizer.add_param_group({"params": model.bn1.parameters(), "lr": 0.05})
        with pytest.raises(ValueError, match="add_param_group: .*not one of the model's"):
            optimizer.add_param_group({"params": nn.Parameter(torch.zeros(2))})
    x, y = _batch()
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert optimizer.guard_reports[0].met, optimizer.guard_reports[0].reason
    assert len(optimizer.param_groups) == 2 and len(optimizer.param_groups[1]["params"]) == 2
    assert model.stem.weight.grad is None
    return [p.detach().clone() for p in model.parameters()]


def test_a_layer_unfrozen_and_added_later_is_guarded_as_if_held_from_the_start():
    """Progressive unfreezing: the step after bn1 joins the optimizer measures fc and bn1 together — the same step
    as an optimizer that held both from the start, bit for bit (bn1 moved by the guarded gradient, not its own); a
    tensor outside the model is refused by add_param_group."""
    start, later = _unfrozen_step(False), _unfrozen_step(True)
    assert all(torch.equal(a, b) for a, b in zip(start, later))


def test_freezing_a_batchnorm_that_has_seen_no_batch_warns_to_use_groupnorm():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with pytest.warns(UserWarning, match=r"1 BatchNorm\(s\) have seen no batch \(1\).*batchnorm='groupnorm'"):
        fix_model(model, batchnorm="frozen")
    model.train()
    model(torch.randn(2, 3, 5, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fix_model(model, batchnorm="frozen")


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's kind of BatchNorm: normalisation and an activation in one module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


@pytest.mark.parametrize("batchnorm", ["groupnorm", "frozen"])
def test_fix_model_refuses_a_batchnorm_subclass_with_a_forward_of_its_own(batchnorm):
    """Replaced by a normalisation alone, its activation would vanish: refused by name instead."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2d(4))
    model.train()
    model(torch.randn(2, 3, 5, 5))
    with pytest.raises(ValueError, match=r"1 \(BatchNormAct2d\) is a BatchNorm with a forward pass of its own"):
        fix_model(model, batchnorm=batchnorm)
    plain = nn.Sequential(nn.BatchNorm1d(3))
    plain(torch.randn(4, 3))
    assert not isinstance(fix_model(plain, batchnorm=batchnorm)[0], nn.BatchNorm1d)  # a plain one is replaced
