"""Datasets (offline, and the torchvision path on files the test makes) and client partitions."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from flguard.data import load, partition


@pytest.mark.parametrize("name,shape,counts", [
    ("mnist5k", (5000, 1, 28, 28), [500] * 10),
    ("lfw-faces", (200, 1, 25, 25), [100, 100]),
    ("digits", (1797, 1, 8, 8), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]),
])
def test_offline_datasets(name, shape, counts):
    data = load(name)
    assert tuple(data.images.shape) == shape and data.images.dtype == torch.float32
    assert float(data.images.min()) >= 0.0 and float(data.images.max()) <= 1.0
    assert data.labels.bincount().tolist() == counts and len(data.classes) == len(counts)
    normalised = data.normalize(data.images)
    assert abs(float(normalised.mean())) < 1e-2 and abs(float(normalised.std()) - 1) < 1e-2
    torch.testing.assert_close(data.denormalize(normalised), data.images, atol=1e-5, rtol=0)


def _write_idx(path, array: np.ndarray) -> None:
    magic = {1: 0x0801, 3: 0x0803}[array.ndim]
    path.write_bytes(struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes())


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST")])
def test_torchvision_loaders_read_files_the_test_makes(tmp_path, name, folder):
    raw = tmp_path / folder / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("t10k", 5)):
        _write_idx(raw / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        _write_idx(raw / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, count, dtype=np.uint8))
    data = load(name, root=tmp_path, train=True, download=False)
    assert tuple(data.images.shape) == (12, 1, 28, 28) and float(data.images.max()) <= 1.0
    test = load(name, root=tmp_path, train=False, download=False)
    assert len(test) == 5 and len(test.classes) == 10


def test_online_dataset_offline_gives_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="offline datasets: mnist5k, lfw-faces, digits"):
        load("cifar10", root=tmp_path, download=False)
    with pytest.raises(ValueError, match="unknown"):
        load("imagenet")


def _check_partition(parts, n):
    joined = np.concatenate(parts)
    assert len(joined) == n and len(np.unique(joined)) == n  # disjoint and covering


def test_partitions_are_deterministic_disjoint_and_covering():
    labels = load("digits").labels.numpy()
    for method in ("iid", "dirichlet"):
        a = partition(labels, 5, method=method, alpha=0.5, seed=3)
        b = partition(labels, 5, method=method, alpha=0.5, seed=3)
        c = partition(labels, 5, method=method, alpha=0.5, seed=4)
        _check_partition(a, len(labels))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert not all(np.array_equal(np.sort(x), np.sort(y)) for x, y in zip(a, c))
    iid = partition(labels, 5, method="iid", seed=0)
    assert max(len(p) for p in iid) - min(len(p) for p in iid) <= 1


def _label_skew(parts, labels) -> float:
    """Mean total-variation distance between each client's label histogram and the global one."""
    overall = np.bincount(labels, minlength=10) / len(labels)
    return float(np.mean([0.5 * np.abs(np.bincount(labels[p], minlength=10) / len(p) - overall).sum() for p in parts]))


def test_dirichlet_skew_grows_as_alpha_shrinks():
    labels = load("mnist5k").labels.numpy()
    skews = [np.mean([_label_skew(partition(labels, 4, method="dirichlet", alpha=a, seed=s), labels) for s in range(3)])
             for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2], skews
    assert skews[0] < 0.1 and skews[2] > 0.4


def test_partition_errors():
    with pytest.raises(ValueError, match="method='random'"):
        partition(np.arange(10) % 2, 2, method="random")
    with pytest.raises(ValueError, match="num_partitions=11"):
        partition(np.arange(10) % 2, 11)
