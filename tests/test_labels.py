"""Label recovery: iDLG on single samples, the bias-corrected count method on batches."""

import pytest
import torch
import torch.nn.functional as F

from flguard import data
from flguard.attacks import idlg, recover_labels
from flguard.attacks.labels import batch_counts, last_layer_gradients
from flguard.models import create


def _gradient(model, x, y):
    return list(torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters())))


@pytest.fixture(scope="module")
def mnist():
    return data.load("mnist5k")


def test_idlg_is_exact_on_twenty_mnist_samples(mnist):
    torch.manual_seed(0)
    model = create("lenet", in_channels=1, num_classes=10, image_size=28, init="uniform")
    index = torch.randperm(len(mnist), generator=torch.Generator().manual_seed(0))[:20]
    x, y = mnist.normalize(mnist.images[index]), mnist.labels[index]
    assert len(set(y.tolist())) >= 5
    found = torch.cat([idlg(model, _gradient(model, x[i:i + 1], y[i:i + 1])) for i in range(20)])
    assert torch.equal(found, y)


@pytest.mark.parametrize("name", ["mlp", "cnn2_v1"])
def test_idlg_without_or_with_bias_on_other_models(name):
    torch.manual_seed(1)
    model = create(name, in_channels=1, num_classes=10, image_size=12)
    x = torch.rand(10, 1, 12, 12)
    y = torch.arange(10)
    found = torch.cat([idlg(model, _gradient(model, x[i:i + 1], y[i:i + 1])) for i in range(10)])
    assert torch.equal(found, y)


def test_idlg_from_weight_rows_when_there_is_no_bias():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 5, bias=False))
    for label in range(5):
        grads = _gradient(model, torch.randn(1, 1, 4, 4), torch.tensor([label]))
        assert last_layer_gradients(model, grads)[1] is None
        assert int(idlg(model, grads)) == label


def test_batch_counts_recover_the_label_multiset(mnist):
    torch.manual_seed(3)
    model = create("lenet", in_channels=1, num_classes=10, image_size=28, init="default")
    gen = torch.Generator().manual_seed(4)
    correct = 0
    for _ in range(5):
        index = torch.randint(len(mnist), (8,), generator=gen)
        x, y = mnist.normalize(mnist.images[index]), mnist.labels[index]
        found = recover_labels(model, _gradient(model, x, y), 8, (1, 28, 28), generator=gen)
        assert found.shape == (8,)
        correct += int((torch.bincount(found, minlength=10).minimum(torch.bincount(y, minlength=10))).sum())
    assert correct / 40 >= 0.9


def test_batch_counts_with_the_true_inputs_as_probe_are_exact_for_distinct_labels():
    torch.manual_seed(5)
    model = create("lenet", in_channels=1, num_classes=10, image_size=16, init="default")
    x, y = torch.rand(6, 1, 16, 16), torch.tensor([7, 1, 3, 3, 0, 9])
    found = batch_counts(model, _gradient(model, x, y), 6, probe=x)
    assert torch.equal(found, torch.sort(y).values)
