"""Datasets (offline ones that ship inside packages, online torchvision ones) and client partitions."""

from flguard.data.datasets import DATASET_NAMES, OFFLINE_DATASETS, ImageDataset, load
from flguard.data.partition import partition

__all__ = ["ImageDataset", "load", "partition", "DATASET_NAMES", "OFFLINE_DATASETS"]
