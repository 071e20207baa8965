"""Shared set-up for the benchmark scripts: a model and a normalised batch from an offline dataset."""

from __future__ import annotations

import torch

from flguard.data import load
from flguard.models import create


def model_and_batch(model_name: str, dataset: str, batch: int, *, init: str = "uniform", seed: int = 0,
                    device: str = "cpu", offset: int = 0):
    """(model, x, y, dataset) with x normalised for the model, on ``device``."""
    data = load(dataset)
    torch.manual_seed(seed)
    channels, size, _ = data.shape
    model = create(model_name, in_channels=channels, num_classes=data.num_classes, image_size=size, init=init)
    index = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[offset:offset + batch]
    x = data.normalize(data.images[index])
    return model.to(device), x.to(device), data.labels[index].to(device), data
