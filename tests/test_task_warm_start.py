"""The server's public split and warm start: no client example is public, and the initial model is
trained on the public examples only."""

from __future__ import annotations

import numpy as np
import torch

from flguard.simulation import task


def test_public_examples_are_in_no_partition_and_the_rest_is_covered():
    settings = task.TaskSettings(dataset="digits", num_partitions=3, partitioning="dirichlet", public_examples=300)
    public = task.public_indices("digits", 300, settings.seed)
    parts = task._partitions("digits", 3, "dirichlet", 0.5, settings.seed, 300)
    private = np.concatenate(parts)
    assert len(public) == 300 and len(np.unique(public)) == 300
    assert len(np.intersect1d(public, private)) == 0
    assert len(private) == len(np.unique(private)) == len(task.load_dataset("digits")) - 300
    for pid in range(3):  # what a client loads is its partition, split into train and test
        train, test = task.load_partition(settings, pid, 3)
        assert len(train) + len(test) == len(parts[pid])


def test_initial_model_is_pretrained_on_public_data_only_and_reproducibly():
    base = dict(dataset="digits", model="mlp", num_partitions=2, public_examples=400)
    cold = task.initial_model(task.TaskSettings(**base))
    warm = task.initial_model(task.TaskSettings(**base, pretrain_epochs=3))
    again = task.initial_model(task.TaskSettings(**base, pretrain_epochs=3))
    for a, b in zip(warm.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(cold.state_dict().values(), warm.state_dict().values()))
    _, test = task.load_partition(task.TaskSettings(**base), 0, 2)  # a client's held-out data
    assert task.evaluate_model(warm, test)[1] > task.evaluate_model(cold, test)[1] + 0.3


def test_fine_tuning_freezes_the_pretrained_backbone_and_trains_a_fresh_head():
    """train_layers="head": the server pre-trains the whole BatchNorm ResNet-18, then the federation's model keeps
    its backbone and BatchNorm statistics as pre-trained (FrozenBatchNorm), frozen, with a fresh last linear layer
    — the only parameters local SGD moves; every client builds the same architecture."""
    from flguard.guard import FrozenBatchNorm

    base = dict(dataset="digits", model="resnet18", num_partitions=2, public_examples=64, pretrain_epochs=1)
    pretrained = task.initial_model(task.TaskSettings(**base))
    settings = task.TaskSettings(**base, train_layers="head")
    model = task.initial_model(settings)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
    assert isinstance(model.bn1, FrozenBatchNorm) and float(model.bn1.running_mean.abs().max()) > 0
    torch.testing.assert_close(model.bn1.running_var, pretrained.bn1.running_var)  # the pre-trained statistics
    assert torch.equal(model.conv1.weight, pretrained.conv1.weight) and not torch.equal(model.fc.weight,
                                                                                       pretrained.fc.weight)
    client = task.make_model(settings)
    client.load_state_dict(model.state_dict(), strict=True)
    before = {n: p.detach().clone() for n, p in client.named_parameters()}
    train, _ = task.load_partition(settings, 0, 2)
    task.local_sgd(client, train, lr=0.1, steps=2, batch_size=8, generator=torch.Generator().manual_seed(0))
    moved = {n for n, p in client.named_parameters() if not torch.equal(before[n], p)}
    assert moved == {"fc.weight", "fc.bias"}
