"""``split_loss``: the batch loss as c Σ_i ℓ(sample i), against closed forms — a mean (c = 1/B), a sum (c = 1), a
class-weighted mean (c = 1/Σ_j w_{y_j}, ℓ = w_{y_i}·CE_i), an ignored label (c = 1/the labels kept), soft targets
(a plain mean) — and a loss that is no such sum refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from flguard.risk.loss_split import split_loss


def logits_and_labels():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 4, generator=g, dtype=torch.float64), torch.tensor([0, 3, 3, 1, 2])


def per_sample(split, logits, labels):
    return torch.stack([split.per_sample(logits[i:i + 1], labels[i:i + 1]) for i in range(len(labels))])


def test_mean_and_sum():
    logits, labels = logits_and_labels()
    ce = F.cross_entropy(logits, labels, reduction="none")
    mean, total = split_loss(nn.CrossEntropyLoss(), logits, labels), split_loss(nn.CrossEntropyLoss(reduction="sum"),
                                                                               logits, labels)
    assert (mean.scale, mean.span) == (1 / 5, 1.0) and (total.scale, total.span) == (1.0, 5.0)
    for split in (mean, total):
        torch.testing.assert_close(per_sample(split, logits, labels), ce)


def test_class_weights_and_an_ignored_label_split_by_the_batch_total_weight():
    logits, labels = logits_and_labels()
    w = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    split = split_loss(nn.CrossEntropyLoss(weight=w), logits, labels)
    total = float(w[labels].sum())  # 0.5 + 4 + 4 + 1 + 2
    assert split.scale == pytest.approx(1 / total) and split.span == pytest.approx(5 / total)
    torch.testing.assert_close(per_sample(split, logits, labels), w[labels] * F.cross_entropy(logits, labels,
                                                                                            reduction="none"))
    ignored = labels.clone()
    ignored[1] = -100
    split = split_loss(nn.NLLLoss(), F.log_softmax(logits, 1), ignored)
    assert split.scale == pytest.approx(1 / 4)
    assert float(per_sample(split, F.log_softmax(logits, 1), ignored)[1]) == 0.0


def test_soft_targets_are_a_plain_mean_and_a_coupled_loss_is_refused():
    logits, _ = logits_and_labels()
    soft = torch.softmax(torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), 1)
    split = split_loss(nn.CrossEntropyLoss(weight=torch.rand(4, dtype=torch.float64)), logits, soft)
    assert split.scale == 1 / 5
    _, labels = logits_and_labels()
    assert split_loss(lambda z, y: F.cross_entropy(z, y) ** 2, logits, labels) is None


def test_class_weights_within_the_checks_tolerance_of_uniform_keep_their_weighting():
    """Weights 1 + 1e-5 and 1 + 2e-5: the batch loss is within 1e-4 of the plain mean, which the split used to take
    first —
    dropping the weighting; now a criterion with weights is split as the weighted mean, ℓ_i = w_{y_i}·CE_i."""
    logits, labels = logits_and_labels()
    w = torch.tensor([1.0, 1.0 + 1e-5, 1.0 + 2e-5, 1.0], dtype=torch.float64)
    split = split_loss(nn.CrossEntropyLoss(weight=w), logits, labels)
    assert split.scale == pytest.approx(1 / float(w[labels].sum()), rel=1e-12) and split.scale != 1 / 5
    torch.testing.assert_close(per_sample(split, logits, labels),
                               w[labels] * F.cross_entropy(logits, labels, reduction="none"), rtol=1e-12, atol=0)
