"""The malicious server's attacks: DLG, GS (inverting gradients), R-GAP, hybrid, adaptive; labels; metrics.

``reconstruct(model, gradient, input_shape, method=...)`` is the entry point; ``metrics`` scores
reconstructions (MSE, PSNR, SSIM, optional LPIPS, Hungarian matching for batches).
"""

from flguard.attacks import metrics
from flguard.attacks.api import hyperparameters_of, reconstruct
from flguard.attacks.base import Reconstruction, methods, register, split_gradient
from flguard.attacks.labels import idlg, recover_labels

__all__ = ["Reconstruction", "hyperparameters_of", "idlg", "methods", "metrics", "reconstruct",
           "recover_labels", "register", "split_gradient"]
