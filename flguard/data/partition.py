"""Client partitions by flwr-datasets' partitioners (IID and Dirichlet-by-label)."""

from __future__ import annotations

import numpy as np


def partition(labels, num_partitions: int, *, method: str = "iid", alpha: float = 0.5,
              seed: int = 0, min_partition_size: int = 1) -> list[np.ndarray]:
    """Split sample indices into ``num_partitions`` disjoint, covering client partitions.

    ``method="iid"`` shuffles uniformly; ``method="dirichlet"`` draws each class's shares from
    Dirichlet(``alpha``) (smaller alpha, more label skew). Deterministic for a given ``seed``.
    """
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    labels = np.asarray(labels)
    if num_partitions < 1 or num_partitions > len(labels):
        raise ValueError(f"num_partitions={num_partitions} must be between 1 and the {len(labels)} samples")
    if method == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
        # IidPartitioner splits in order; shuffle first so the split is random but seeded.
        order = np.random.default_rng(seed).permutation(len(labels))
    elif method == "dirichlet":
        if not alpha > 0:
            raise ValueError(f"alpha={alpha} must be positive for a Dirichlet partition")
        partitioner = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                           min_partition_size=min_partition_size, self_balancing=False,
                                           shuffle=True, seed=seed)
        order = np.arange(len(labels))
    else:
        raise ValueError(f"method={method!r} is unknown; choose 'iid' or 'dirichlet'")
    partitioner.dataset = Dataset.from_dict({"label": labels[order].tolist(), "index": order.tolist()})
    return [np.asarray(partitioner.load_partition(k)["index"], dtype=np.int64) for k in range(num_partitions)]
