"""Fishing (Wen et al. 2022): the fished parameters isolate the target class's samples in a batch
gradient (against per-sample autograd gradients), the count is read off the bias, the project's
attack inverts the isolated sample, and a server-made dead network gets its own reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flguard import Guard, GuardConfig, data
from flguard.attacks import metrics
from flguard.attacks.base import split_gradient
from flguard.attacks.unroll import simulate_update
from flguard.guard.failure import SUSPICIOUS
from flguard.models import create
from flguard.server.fishing import (attack_fished, count_targets, fish_class, fish_feature, last_linear,
                                    penultimate_features)
from flguard.server import AttackRunner, AttackSpec, CapturedUpload, Fishing, ResultWriter, TrueBatch
from flguard.server.uploads import ClientUpdate

pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(model, x, y) -> list[torch.Tensor]:
    return list(torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters())))


def _flat(parts) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in parts])


def _before_classifier(model, parts) -> torch.Tensor:
    name, _ = last_linear(model)
    return _flat([g for (n, _), g in zip(model.named_parameters(), parts) if not n.startswith(name + ".")])


def _lenet_with_one_three(others: int, before: int):
    """The sigmoid LeNet (seed 0) fished for class 3, and a batch of MNIST-5k with one 3 after ``before``
    of ``others`` other digits: (dataset, fished model, the 3's dataset index, batch index, x, y)."""
    dataset = data.load("mnist5k")
    torch.manual_seed(0)
    model = create("lenet", in_channels=1, num_classes=10, image_size=28, init="uniform")
    target = (dataset.labels == 3).nonzero()[0, 0]
    rest = (dataset.labels != 3).nonzero()[:others, 0]
    index = torch.cat([rest[:before], target.view(1), rest[before:]])
    return dataset, fish_class(model, 3), target, index, dataset.normalize(dataset.images[index]), dataset.labels[index]


@pytest.mark.parametrize("name,shape", [("cnn", (1, 28, 28)), ("resnet8_gn", (3, 16, 16))])
def test_class_fishing_leaves_only_the_target_samples_gradients_before_the_last_layer(name, shape):
    torch.manual_seed(0)
    model = create(name, in_channels=shape[0], num_classes=10, image_size=shape[1]).double()
    x = torch.randn(12, *shape, dtype=torch.float64).to(memory_format=torch.channels_last if shape[0] == 3 else
                                                       torch.contiguous_format)
    y = torch.tensor([0, 3, 5, 3, 1, 2, 7, 9, 3, 4, 6, 8])
    fished = fish_class(model, 3)
    batch = _before_classifier(fished, _grads(fished, x, y))
    targets = [_before_classifier(fished, _grads(fished, x[i:i + 1], y[i:i + 1])) for i in (1, 3, 8)]
    expected = torch.stack(targets).sum(0) / 12
    assert float(expected.norm()) > 0
    torch.testing.assert_close(batch, expected, rtol=1e-10, atol=1e-14)
    # the model the client had is untouched; the classifier is the fished one
    assert not torch.equal(last_linear(model)[1].weight, last_linear(fished)[1].weight)
    assert float(last_linear(fished)[1].bias[0].detach()) == 1000.0 and torch.all(last_linear(fished)[1].weight[3] == 0.5)


def test_count_targets_reads_the_count_with_and_without_the_batch_size():
    torch.manual_seed(1)
    model = create("cnn", in_channels=1, num_classes=10, image_size=28)
    x = torch.randn(16, 1, 28, 28)
    for count in (0, 1, 2, 3):
        y = torch.tensor([2] * count + [5, 6, 7, 1] * 4)[:16]
        fished = fish_class(model, 2)
        gradient = _flat(_grads(fished, x, y))
        assert count_targets(gradient, fished, 2, batch_size=16) == count
        update = ClientUpdate(_grads(fished, x, y), [], 16, 1, 0.1)
        assert count_targets(update, fished, 2) == count
    y = torch.tensor([2, 5, 6, 7, 1, 0, 0, 3, 4, 8, 9, 9, 5, 6, 1, 3])  # counts not all even: B is determined
    assert count_targets(_flat(_grads(fish_class(model, 2), x, y)), fish_class(model, 2), 2) == 1


def test_feature_fishing_keeps_target_samples_below_the_threshold_and_other_classes_above_it():
    torch.manual_seed(2)
    model = create("cnn", in_channels=1, num_classes=10, image_size=28).double()
    x = torch.randn(10, 1, 28, 28, dtype=torch.float64)
    y = torch.tensor([4, 4, 4, 1, 2, 3, 4, 5, 6, 7])
    features = penultimate_features(model, x)
    f = int(features.var(0).argmax())
    threshold = float(features[:, f].median())
    fished = fish_feature(model, 4, feature=f, threshold=threshold, feature_multiplier=1e4)
    below = features[:, f] < threshold
    keep = ((y == 4) & below) | ((y != 4) & ~below)
    assert 0 < int(keep.sum()) < 10
    batch = _before_classifier(fished, _grads(fished, x, y))
    per = [_before_classifier(fished, _grads(fished, x[i:i + 1], y[i:i + 1])) for i in range(10)]
    torch.testing.assert_close(batch, torch.stack(per)[keep].sum(0) / 10, rtol=1e-8, atol=1e-10)
    for i in (~keep).nonzero()[:, 0].tolist():
        assert float(per[i].norm()) < 1e-8 * float(per[int(keep.nonzero()[0])].norm())


def test_attack_fished_recovers_the_lone_target_of_a_batch_of_eight():
    """The sigmoid LeNet on MNIST (as in the DLG tests): one sample of class 3 among eight, class
    fishing, DLG through ``attack_fished`` — the isolated digit comes back above 30 dB, where the
    same attack on the unfished batch gradient cannot single it out."""
    dataset, fished, target, index, x, y = _lenet_with_one_three(others=7, before=3)
    update = ClientUpdate(_grads(fished, x, y), [], 8, 1, 0.1)
    rec = attack_fished(fished, update, 3, (1, 28, 28), method="dlg", iterations=15, seed=0)
    assert rec.extra["targets"] == 1 and rec.images.shape == (1, 1, 28, 28) and rec.labels.tolist() == [3]
    psnr = float(metrics.psnr(dataset.denormalize(rec.images).clamp(0, 1), dataset.images[target:target + 1]))
    assert psnr > 30.0, psnr
    with pytest.raises(ValueError, match="one-step"):
        count_targets(ClientUpdate(update.gradient, [], 16, 2, 0.1), fished, 3)
    with pytest.raises(ValueError, match="no update"):
        attack_fished(fished, ClientUpdate(update.gradient, [], 16, 2, 0.1), 3, (1, 28, 28))


def test_attack_fished_unrolls_a_two_step_upload_and_recovers_the_first_steps_target():
    """A 2-step upload of 2 + 2 samples from the fished sigmoid LeNet, the class-3 sample in the first
    step's batch: ``attack_fished`` unrolls the client's steps (lr 0.1, batches of 2) and the target
    comes back above 30 dB — the first step's feature gradient is its alone — while the second step's
    samples, whose gradients mix once the zeroed rows have trained back, do not (< 15 dB)."""
    dataset, fished, _, index, x, y = _lenet_with_one_three(others=3, before=1)
    steps = split_gradient(fished, simulate_update(fished, x, y, local_steps=2, local_lr=0.1, local_batch_size=2))
    upload = ClientUpdate([-u / 0.2 for u in steps], steps, 4, 2, 0.1)
    rec = attack_fished(fished, upload, 3, (1, 28, 28), method="dlg", iterations=15, seed=0, labels=y.tolist())
    assert rec.images.shape == (4, 1, 28, 28) and rec.extra["targets"] == 1 and rec.extra["unrolled"] == 2
    psnr = metrics.psnr(dataset.denormalize(rec.images).clamp(0, 1), dataset.images[index])
    assert float(psnr[1]) > 30.0 and float(psnr[2:].max()) < 15.0, psnr


@pytest.mark.parametrize("name,shape", [("cnn", (1, 28, 28)), ("resnet8_gn", (3, 16, 16))])
@pytest.mark.parametrize("defense", ["auto", "gaussian", "eigen"])
def test_a_server_made_dead_network_is_withheld_as_suspicious_parameters(name, shape, defense):
    torch.manual_seed(3)
    model = create(name, in_channels=shape[0], num_classes=10, image_size=shape[1])
    with torch.no_grad():  # the server kills the last hidden layer's ReLUs
        if name == "cnn":
            model.fc2.bias.fill_(-1000.0)
        else:
            block = model.layers[-1]
            block.norm2.bias.fill_(-1000.0)
            block.shortcut[1].bias.fill_(-1000.0)
    x, y = torch.randn(6, *shape), torch.tensor([0, 1, 2, 3, 4, 5])
    gradient = _flat(_grads(model, x, y))
    out = Guard(GuardConfig(defense=defense)).protect(model, x, y, gradient)
    assert out.gradient is None and not out.report.met
    assert out.report.reason.startswith(SUSPICIOUS), out.report.reason


def test_the_fished_class_is_the_one_the_victims_last_upload_trained_on_most():
    fishing = Fishing()
    update = torch.tensor([0.01, -0.2, 0.3, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert fishing.target_class(4, 10, update) == 2
    assert fishing.target_class(4, 10, None) == 3  # nothing seen yet: the rotation
    assert Fishing(infer_target=False).target_class(4, 10, update) == 3
    assert Fishing(target=7).target_class(4, 10, update) == 7
    with pytest.raises(ValueError, match="feature"):
        Fishing(kind="feature")


def test_a_misread_count_is_scored_on_the_best_matched_pairs(tmp_path):
    """Two samples of the fished class, an upload whose bias gradient reads one: the runner scores the
    one reconstruction against the closer of the two, and says how many there were."""
    torch.manual_seed(4)
    model = create("cnn", in_channels=1, num_classes=10, image_size=28)
    fished = fish_class(model, 2)
    x, y = torch.randn(8, 1, 28, 28), torch.tensor([2, 5, 2, 7, 1, 0, 3, 4])
    lr = 0.1
    before = {k: v.clone() for k, v in fished.state_dict().items()}
    after = {k: v.clone() for k, v in before.items()}
    for (name, _), grad in zip(fished.named_parameters(), _grads(fished, x, y)):
        after[name] -= lr * grad
    after["fc3.bias"][2] = before["fc3.bias"][2] + lr * (1 / 8)  # the count now reads 1, not 2
    writer = ResultWriter(tmp_path, save_images=False)
    runner = AttackRunner(model_fn=lambda: create("cnn", in_channels=1, num_classes=10, image_size=28),
                          input_shape=(1, 28, 28), attacks=[AttackSpec("dlg", iterations=1)], writer=writer,
                          blocking=True)
    truth = TrueBatch(x, y, run_id=1, server_round=1, node_id=5, partition_id=0)
    upload = CapturedUpload(1, 5, before, after, {"lr": lr, "local-steps": 1, "batch-size": 8}, truth, "fishing", 2)
    row = runner.run(upload, runner.attacks[0])
    assert row["status"] == "ok", row["error"]
    assert row["targets"] == 1 and row["true_targets"] == 2 and row["scored"] and row["fished_class"] == 2
    assert row["true_labels"] == "2" and row["psnr"] == row["psnr"]
