"""Segmentation models guarded as practitioners train them: a per-pixel loss over a small 3-channel U-Net (GroupNorm,
pooling, a transposed convolution, a skip connection), certified against dense float64 I²F; a Dice loss pooled over
the batch withheld naming its per-sample form, and ``F.one_hot`` in a loss named with its tensor form.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flguard import GuardConfig, GuardFailure, make_guarded
from risk_reference import assert_certified_on_dense_float64

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)
CLASSES = 3


class TinyUNet(nn.Module):
    """One level down and up: (N, 3, H, W) images to (N, CLASSES, H, W) per-pixel logits."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.MaxPool2d(2))
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.skip = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Conv2d(8, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.up(self.down(x)), self.skip(x)], 1))


def _batch(size: int = 6):
    g = torch.Generator().manual_seed(1)
    return (torch.rand(size, 3, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (size, 6, 6), generator=g))


def _step(loss, config: GuardConfig):
    torch.manual_seed(0)
    model = TinyUNet().double()
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.0), loss, config)
    x, t = _batch()
    optimizer.zero_grad()
    criterion(model(x), t).backward()
    optimizer.step()
    return model, x, t, optimizer.guard_reports[-1]


def test_a_segmentation_step_is_certified_against_dense_float64():
    """The per-pixel cross-entropy's mean is each image's mean over its pixels, averaged: per-sample separable. The
    noise sent certifies every kept image against dense float64 I²F with the pixel box."""
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=3, clip_per_sample="median", max_excluded=0.25,
                         max_rel_noise=40.0, rtol=1e-2)
    model, x, t, report = _step(nn.CrossEntropyLoss(), config)
    assert report.met, report.reason
    assert_certified_on_dense_float64(model, x, t, config, report)


def _dice(out: torch.Tensor, t: torch.Tensor, one_hot, dims: tuple[int, ...]) -> torch.Tensor:
    p, target = out.softmax(1), one_hot(t)
    overlap, total = (p * target).sum(dims), p.sum(dims) + target.sum(dims)
    return F.cross_entropy(out, t) + (1 - (2 * overlap + 1) / (total + 1)).mean()


def _one_hot(t: torch.Tensor) -> torch.Tensor:
    return F.one_hot(t, CLASSES).permute(0, 3, 1, 2).double()


def _tensor_one_hot(t: torch.Tensor) -> torch.Tensor:  # the form the guard's reason gives
    return (t.unsqueeze(1) == torch.arange(CLASSES, device=t.device).view(1, CLASSES, *[1] * (t.dim() - 1))).double()


@pytest.mark.parametrize("case, match", [
    ("pooled over the batch", "compute it per sample"),
    ("one_hot", r"F\.one_hot\(t, C\) as"),
    ("per sample", None),
])
def test_dice_losses_pooled_over_the_batch_or_with_one_hot_are_withheld_naming_the_fix_which_is_sent(case, match):
    """A Dice loss summed over every image's pixels together couples the samples: withheld, the reason naming its
    per-sample form. Per sample with ``F.one_hot`` (whose range check reads the targets' values inside ``vmap``):
    withheld, the reason giving its tensor form. Per sample in tensor operations: sent."""
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=3, clip_per_sample="median", max_rel_noise=40.0)
    one_hot, dims = {"pooled over the batch": (_tensor_one_hot, (0, 2, 3)), "one_hot": (_one_hot, (2, 3)),
                     "per sample": (_tensor_one_hot, (2, 3))}[case]
    loss = lambda out, t: _dice(out, t, one_hot, dims)  # noqa: E731
    if match is None:
        assert _step(loss, config)[3].met
        return
    with pytest.raises(GuardFailure, match=match):
        _step(loss, config)
