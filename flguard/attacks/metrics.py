"""Image-quality scores of reconstructions against the originals, one value per sample.

``mse``, ``psnr`` and ``ssim`` take two batches [N, C, H, W] (or [N, H, W]) in the same units,
normally pixels in [0, 1], and return tensors [N]. SSIM is the standard one of Wang et al. (2004)
as torchmetrics implements it (Gaussian window σ = 1.5, 11×11, K1 = 0.01, K2 = 0.03), not
CW-SSIM. LPIPS (Zhang et al. 2018, AlexNet backbone) needs ImageNet weights that cannot be
downloaded here: it is computed only when they are already in torch's hub cache, and
``lpips_status()`` says why it is absent otherwise.

For a batch, an attack's i-th reconstruction need not correspond to the i-th original (sample
order is not identifiable from a gradient), so ``match`` pairs them by minimum total MSE (the
Hungarian algorithm) and ``score`` scores the matched pairs.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torchmetrics.functional.image import structural_similarity_index_measure


def _as_images(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.ndim == 3:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    if a.ndim != 4:
        raise ValueError(f"expected images [N, C, H, W] or [N, H, W]; got {tuple(a.shape)}")
    return a.float(), b.float()


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample, [N]."""
    a, b = _as_images(a, b)
    return ((a - b) ** 2).flatten(1).mean(dim=1)


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per sample, [N]: 10·log10(range² / MSE); +inf if equal."""
    return 10.0 * torch.log10(data_range**2 / mse(a, b))


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Standard SSIM per sample, [N] (mean over the valid window positions and channels).

    Images smaller than the 11×11 window get a proportionally smaller Gaussian window.
    """
    a, b = _as_images(a, b)
    side = min(a.shape[-2:])
    sigma = 1.5 if side >= 11 else max(0.5, (side - 1) / 7.0)
    return structural_similarity_index_measure(a, b, data_range=data_range, sigma=sigma, reduction="none")


# -- LPIPS (optional) --------------------------------------------------------------------------


def _alexnet_checkpoint() -> str:
    from torchvision.models import AlexNet_Weights

    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(AlexNet_Weights.IMAGENET1K_V1.url))


def lpips_status() -> str:
    """'available', or the reason LPIPS cannot be computed here."""
    try:
        path = _alexnet_checkpoint()
        from torchmetrics.functional.image.lpips import _LPIPS  # noqa: F401
    except Exception as error:  # torchvision/torchmetrics layout differs
        return f"absent: LPIPS support could not be imported ({type(error).__name__}: {error})"
    if not os.path.exists(path):
        return f"absent: AlexNet ImageNet weights are not in the local cache ({path}); flguard never downloads them"
    return "available"


@lru_cache(maxsize=2)
def _lpips_net(device: str) -> torch.nn.Module:
    from torchmetrics.functional.image.lpips import _LPIPS

    return _LPIPS(pretrained=True, net="alex").to(device).eval()


def lpips(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """LPIPS (AlexNet) per sample, [N]; raises ``RuntimeError`` if the weights are not local."""
    status = lpips_status()
    if status != "available":
        raise RuntimeError(f"LPIPS {status}")
    a, b = _as_images(a, b)
    if a.shape[1] == 1:
        a, b = a.expand(-1, 3, -1, -1), b.expand(-1, 3, -1, -1)
    scale = 2.0 / data_range  # the network expects [-1, 1]
    with torch.no_grad():
        out = _lpips_net(str(a.device))(a * scale - 1.0, b * scale - 1.0)
    return out.reshape(-1)


# -- batches: Hungarian matching ----------------------------------------------------------------


def match(reconstructions: torch.Tensor, originals: torch.Tensor) -> torch.Tensor:
    """Permutation p [N] minimising Σ_i MSE(reconstructions[p[i]], originals[i]).

    ``reconstructions[p]`` is then aligned with ``originals``.
    """
    r, o = _as_images(reconstructions, originals)
    cost = torch.cdist(o.flatten(1).double(), r.flatten(1).double()) ** 2 / o[0].numel()
    rows, cols = linear_sum_assignment(cost.cpu().numpy())
    permutation = np.empty(len(rows), dtype=np.int64)
    permutation[rows] = cols
    return torch.from_numpy(permutation).to(reconstructions.device)


def score(reconstructions: torch.Tensor, originals: torch.Tensor, data_range: float = 1.0, *,
          matched: bool = True, with_lpips: bool | None = None) -> dict[str, torch.Tensor]:
    """Per-sample scores after Hungarian matching: 'mse', 'psnr', 'ssim', 'permutation' (and
    'lpips' when ``with_lpips`` is True, or None and the weights are local). Sample i of every
    entry refers to ``originals[i]``.
    """
    permutation = match(reconstructions, originals) if matched else torch.arange(
        reconstructions.shape[0], device=reconstructions.device)
    aligned = reconstructions[permutation]
    result = {
        "mse": mse(aligned, originals),
        "psnr": psnr(aligned, originals, data_range),
        "ssim": ssim(aligned, originals, data_range),
        "permutation": permutation,
    }
    if with_lpips or (with_lpips is None and lpips_status() == "available"):
        result["lpips"] = lpips(aligned, originals, data_range)
    return result


def summary(scores: dict[str, torch.Tensor]) -> dict[str, float]:
    """Means over the batch (PSNR averaged in dB; infinities kept as inf)."""
    out = {}
    for key, value in scores.items():
        if key == "permutation":
            continue
        mean = float(value.double().mean())
        out[key] = mean if not math.isnan(mean) else float("nan")
    return out
