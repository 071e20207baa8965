"""The malicious server's attacks: DLG, GS (inverting gradients), R-GAP, hybrid; labels; image metrics."""

from flguard.attacks.base import Reconstruction, register, split_gradient

__all__ = ["Reconstruction", "register", "split_gradient"]
