"""Image metrics against hand-computed values and an independent SSIM (scikit-image)."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flguard.attacks import metrics


def test_mse_and_psnr_closed_form():
    a = torch.zeros(2, 1, 4, 4)
    b = torch.zeros(2, 1, 4, 4)
    b[0] += 0.1                     # every pixel off by 0.1: MSE 0.01, PSNR 20 dB
    b[1, 0, 0, 0] = 1.0             # one pixel of 16 off by 1: MSE 1/16
    assert torch.allclose(metrics.mse(a, b), torch.tensor([0.01, 1 / 16]), atol=1e-7)
    expected = torch.tensor([20.0, 10 * math.log10(16)])
    assert torch.allclose(metrics.psnr(a, b), expected, atol=1e-4)
    # data_range 255: PSNR grows by 20·log10(255) for the same MSE.
    assert torch.allclose(metrics.psnr(a, b, data_range=255.0), expected + 20 * math.log10(255), atol=1e-3)
    assert torch.isinf(metrics.psnr(a, a)).all()


def test_ssim_identical_is_one_and_per_sample():
    images = torch.rand(3, 1, 25, 25, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(metrics.ssim(images, images), torch.ones(3), atol=1e-6)
    noisy = (images + 0.2 * torch.randn(3, 1, 25, 25)).clamp(0, 1)
    values = metrics.ssim(noisy, images)
    assert values.shape == (3,) and bool((values < 0.9).all())


def test_ssim_matches_scikit_image():
    structural_similarity = pytest.importorskip("skimage.metrics").structural_similarity
    gen = torch.Generator().manual_seed(2)
    clean = torch.rand(2, 1, 28, 28, generator=gen)
    noisy = (clean + 0.1 * torch.randn(2, 1, 28, 28, generator=gen)).clamp(0, 1)
    ours = metrics.ssim(noisy, clean)
    reference = [structural_similarity(n[0].numpy().astype(np.float64), c[0].numpy().astype(np.float64),
                                       data_range=1.0, gaussian_weights=True, sigma=1.5,
                                       use_sample_covariance=False)
                 for n, c in zip(noisy, clean)]
    assert torch.allclose(ours.double(), torch.tensor(reference, dtype=torch.float64), atol=2e-3)


def test_ssim_constant_images_hand_checked():
    # Two constant images with means μa, μb: σ = 0, so SSIM = (2μaμb + C1) / (μa² + μb² + C1).
    a = torch.full((1, 1, 16, 16), 0.5)
    b = torch.full((1, 1, 16, 16), 0.25)
    c1 = (0.01 * 1.0) ** 2
    expected = (2 * 0.5 * 0.25 + c1) / (0.5**2 + 0.25**2 + c1)
    assert torch.allclose(metrics.ssim(a, b), torch.tensor([expected]), atol=1e-5)


def test_hungarian_recovers_permutation_and_scores_matched():
    gen = torch.Generator().manual_seed(3)
    originals = torch.rand(6, 1, 8, 8, generator=gen)
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    reconstructions = originals[order] + 0.01 * torch.randn(6, 1, 8, 8, generator=gen)
    permutation = metrics.match(reconstructions, originals)
    assert torch.equal(reconstructions[permutation], reconstructions[torch.argsort(order)])
    assert torch.equal(order[permutation], torch.arange(6))
    scores = metrics.score(reconstructions, originals, with_lpips=False)
    assert set(scores) >= {"mse", "psnr", "ssim", "permutation"}
    assert bool((scores["psnr"] > 35).all())       # noise σ 0.01 → about 40 dB once matched
    unmatched = metrics.score(reconstructions, originals, matched=False, with_lpips=False)
    assert float(unmatched["psnr"].mean()) < 15


def test_lpips_without_local_weights_says_why_and_is_never_scored(tmp_path, monkeypatch):
    """An empty hub cache (whatever this machine holds): the status names the missing file, LPIPS
    raises instead of scoring, and ``score`` leaves it out unless it is asked for."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path))
    status = metrics.lpips_status()
    assert status.startswith("absent:") and str(tmp_path) in status and "never downloads" in status
    a, b = torch.rand(2, 1, 8, 8), torch.rand(2, 1, 8, 8)
    with pytest.raises(RuntimeError, match="absent"):
        metrics.lpips(a, b)
    assert "lpips" not in metrics.score(a, b)
    with pytest.raises(RuntimeError, match="absent"):
        metrics.score(a, b, with_lpips=True)


def test_lpips_with_local_weights_feeds_the_network_and_scores_matched_pairs(tmp_path, monkeypatch):
    """Weights in the cache: ``score`` includes LPIPS by default, on the Hungarian-matched pairs, and
    the network sees what it expects — 3 channels in [−1, 1] whatever ``data_range``. AlexNet's
    weights cannot be downloaded here, so the network is a stand-in that records its inputs."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path))
    checkpoint = Path(metrics._alexnet_checkpoint())
    assert checkpoint.is_relative_to(tmp_path)
    checkpoint.parent.mkdir(parents=True)
    checkpoint.touch()
    assert metrics.lpips_status() == "available"
    seen = []

    def network(x, y):  # LPIPS's call: (images, images) in [−1, 1] -> distances [N, 1, 1, 1]
        seen.append((x, y))
        return (x - y).abs().flatten(1).mean(1).view(-1, 1, 1, 1)

    monkeypatch.setattr(metrics, "_lpips_net", lambda device: network)
    gen = torch.Generator().manual_seed(0)
    originals = torch.rand(3, 1, 8, 8, generator=gen) * 255
    distances = metrics.lpips(originals.flip(0), originals, data_range=255.0)
    x, y = seen[-1]
    assert x.shape == (3, 3, 8, 8) and float(x.min()) >= -1 and float(x.max()) <= 1
    torch.testing.assert_close(y[:, :1], originals / 127.5 - 1)
    assert distances.shape == (3,) and float(distances[1]) == 0.0 and float(distances[0]) > 0  # middle one is equal

    shuffled = originals[torch.tensor([2, 0, 1])]
    scores = metrics.score(shuffled, originals, data_range=255.0)
    assert "lpips" in scores and torch.equal(scores["lpips"], torch.zeros(3))  # matched: identical pairs


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.mse(torch.zeros(2, 1, 4, 4), torch.zeros(2, 1, 4, 5))
