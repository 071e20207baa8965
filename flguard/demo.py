"""The end-to-end demonstration behind ``flguard demo``: measure → guard → attack, on real digits.

For a few MNIST-5k digits under the attack-study LeNet (uniform init), it measures each sample's
risk, uploads the gradient unguarded and through the guard (calibrated Gaussian and eigen-aware
noise at one shared floor τ), lets a malicious server run DLG on every upload, and compares the
predicted floor with the measured reconstruction error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from flguard.attacks import reconstruct
from flguard.attacks.metrics import mse, psnr
from flguard.data import load
from flguard.guard import Guard
from flguard.guard_config import GuardConfig
from flguard.models import create


@dataclass
class DemoRow:
    sample: int
    label: int
    defense: str
    noise_norm: float
    rel_noise: float
    predicted_rmse: float
    measured_rmse: float
    psnr: float
    met: bool


def run_demo(*, samples: int = 3, min_rmse: float = 0.3, attack_steps: int = 30, seed: int = 0,
             defenses: tuple[str, ...] = ("none", "gaussian", "eigen"),
             progress: Callable[[str], None] = lambda _: None) -> tuple[list[DemoRow], torch.Tensor]:
    """Rows per (sample, defense) and an image grid [samples × (1 + defenses), 1, 28, 28] in pixels."""
    data = load("mnist5k")
    torch.manual_seed(seed)
    model = create("lenet", in_channels=1, image_size=28, init="uniform")
    picks = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:samples]
    params = [p for p in model.parameters() if p.requires_grad]
    rows, tiles = [], []
    for index in picks.tolist():
        x = data.normalize(data.images[index:index + 1])
        y = data.labels[index:index + 1]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
        tiles.append(data.images[index])
        for defense in defenses:
            progress(f"sample {index}: {defense}")
            cfg = GuardConfig(defense=defense, min_rmse=min_rmse, seed=seed)
            out = Guard(cfg).protect(model, x, y, gradient)
            upload = out.gradient if out.gradient is not None else gradient
            rec = reconstruct(model, upload, x.shape[1:], method="dlg", labels=y, iterations=attack_steps, seed=seed)
            pixels = data.denormalize(rec.images.detach()).clamp(0, 1)
            measured = float(mse(rec.images.detach(), x).sqrt())
            rows.append(DemoRow(index, int(y), defense, out.report.noise_norm, out.report.rel_noise,
                                float(out.report.rmse_after.min()), measured,
                                float(psnr(pixels, data.images[index:index + 1])), out.report.met))
            tiles.append(pixels[0])
    return rows, torch.stack(tiles)


def save_grid(tiles: torch.Tensor, columns: int, path: Path) -> None:
    """Originals in the first column, each defense's reconstruction beside it."""
    from torchvision.utils import save_image

    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(tiles, str(path), nrow=columns, padding=2, pad_value=1.0)
