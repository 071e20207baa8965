"""quickstart_app: the model, the data and the ordinary PyTorch train / test loops.

The shape of Flower's quickstart-pytorch ``task.py``, with code of our own: its CNN (from flguard's
model zoo, ``cnn``), a standard ``train(net, trainloader, epochs, lr, device)`` loop with
``SGD(momentum=0.9)`` and ``CrossEntropyLoss``, and ``test``. The quickstart downloads CIFAR-10;
this app reads MNIST-5k (or the LFW faces) from installed packages, so it runs offline.
"""

from functools import lru_cache

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flguard import make_guarded
from flguard.data import load, partition
from flguard.models import create


@lru_cache(maxsize=2)
def _dataset(name: str):
    return load(name)


def Net(dataset: str = "mnist5k") -> nn.Module:
    """The quickstart CNN for ``dataset``'s image shape and classes."""
    data = _dataset(dataset)
    channels, size, _ = data.shape
    return create("cnn", in_channels=channels, image_size=size, num_classes=data.num_classes)


def load_data(partition_id: int, num_partitions: int, batch_size: int = 32, dataset: str = "mnist5k"):
    """This client's IID partition, normalised, split 80/20 into train and test loaders."""
    data = _dataset(dataset)
    part = partition(data.labels.numpy(), num_partitions, method="iid", seed=0)[partition_id]
    train, test = data.subset(part).split(0.2, seed=0)
    loader = torch.Generator().manual_seed(partition_id)
    trainloader = DataLoader(TensorDataset(train.normalize(train.images), train.labels), batch_size=batch_size,
                             shuffle=True, generator=loader)
    testloader = DataLoader(TensorDataset(test.normalize(test.images), test.labels), batch_size=batch_size)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net, optimizer, criterion = make_guarded(net, optimizer, criterion)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    net.eval()
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
