"""The result writer: where the malicious server's findings land on disk.

``ResultWriter(out_dir)`` appends one row per attack to ``attacks.jsonl`` and ``attacks.csv``
(columns ``ROW_FIELDS``, a header when the CSV is new) and keeps the rows in memory
(``results``); with ``save_images`` it also writes, per attack, a PNG grid (true batch over
reconstruction, in simulation) and the tensors behind it under ``images/``. Rows come from the
attack runner's background thread: appending is serialised by a lock, and ``on_row`` (a progress
display, say) sees each row once it is on disk.

Kept apart from the runner so that file formats — what ``flguard compare`` and the reports read —
are one module's concern.
"""

from __future__ import annotations

import csv
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flguard.server.truth import TrueBatch

# Columns of attacks.csv (attacks.jsonl rows carry the same keys).
# ``attack_target``: "fishing" (a one-step upload of a model the server fished: ``fished_class``, the
# ``targets`` it counted, the ``true_targets`` in the batch), "probe" (an upload the server asked its victim for, e.g. one-sample FedSGD) or
# "fedavg-upload" (an honest client's real upload under the task's own train config).
# ``rmse_input_samples``: every sample's RMSE in input units (space-separated), for the promise.
ROW_FIELDS = ("round", "node_id", "partition_id", "attack", "method", "attack_target", "batch_size", "local_steps",
              "lr", "iterations", "restarts", "labels_from", "scored", "psnr", "ssim", "mse", "rmse", "rmse_input",
              "rmse_input_samples", "lpips", "label_accuracy", "loss", "seconds", "status", "error", "image", "tensors",
              "true_labels", "fished_class", "targets", "true_targets")


def save_grid(rows: Sequence[torch.Tensor], path: str | Path, min_side: int = 96) -> Path:
    """Save image rows (pixels in [0, 1], [N, C, H, W] each) as one PNG grid, one row each.

    Small images (MNIST 28 px, LFW 25 px) are enlarged by an integer factor (nearest neighbour)
    so that each is at least ``min_side`` pixels: the grid stays faithful but readable.
    """
    from torchvision.utils import save_image

    images = torch.cat([r.detach().cpu().float() for r in rows]).clamp(0, 1)
    factor = max(1, -(-min_side // max(images.shape[-2:])))
    if factor > 1:
        images = torch.nn.functional.interpolate(images, scale_factor=factor, mode="nearest")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(images, path, nrow=rows[0].shape[0], padding=2, pad_value=1.0)
    return path


class ResultWriter:
    """Appends attack rows and saves reconstructions under ``out_dir`` (see module docstring).

    ``to_pixels`` maps model inputs to pixels in [0, 1] for the saved images.
    """

    def __init__(self, out_dir: str | Path, *, to_pixels: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                 save_images: bool = True, on_row: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.to_pixels = to_pixels
        self.save_images = save_images
        self.on_row = on_row
        self.results: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def save(self, server_round: int, node_id: int, label: str, images: torch.Tensor,
             truth: TrueBatch | None) -> dict[str, str]:
        """The PNG grid and the tensors of one attack's reconstruction; their paths (relative to
        ``out_dir``) as the row's ``image`` and ``tensors``, or nothing without ``save_images``."""
        if not self.save_images:
            return {}
        stem = f"round-{server_round:04d}_node-{node_id}_{label}"  # a label may hold dots: no with_suffix
        originals = truth.inputs if truth is not None and truth.inputs.shape == images.shape else None
        rows = [self.to_pixels(images)] if originals is None else [self.to_pixels(originals), self.to_pixels(images)]
        grid = save_grid(rows, self.out_dir / "images" / f"{stem}.png")
        # The reconstruction (and the true batch, in simulation) in pixels, for reports to lay out.
        payload = {"reconstruction": self.to_pixels(images).clamp(0, 1).half()}
        if originals is not None:
            payload["original"] = self.to_pixels(originals).clamp(0, 1).half()
        tensors = self.out_dir / "images" / f"{stem}.pt"
        tensors.parent.mkdir(parents=True, exist_ok=True)
        torch.save(payload, tensors)
        return {"image": str(grid.relative_to(self.out_dir)), "tensors": str(tensors.relative_to(self.out_dir))}

    def append(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append one row (projected on ``ROW_FIELDS``) to attacks.jsonl and attacks.csv; returns it."""
        row = {key: row.get(key) for key in ROW_FIELDS}
        with self._lock:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "attacks.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
            csv_path = self.out_dir / "attacks.csv"
            new = not csv_path.exists() or csv_path.stat().st_size == 0
            with open(csv_path, "a", encoding="utf-8", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=ROW_FIELDS)
                if new:
                    writer.writeheader()
                writer.writerow({k: "" if v is None else v for k, v in row.items()})
            self.results.append(row)
        if self.on_row is not None:
            self.on_row(row)
        return row
