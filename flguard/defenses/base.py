"""What every defense sees (``DefenseContext``) and returns (``Direction`` or a new gradient).

The defenses sit between risk/ (which they use) and the guard (which calls them), so nothing here
imports the guard's configuration: ``DefenseContext.config`` is typed structurally by the fields
each defense reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from flguard.risk.lanczos import LanczosResult
from flguard.risk.clipped import Jacobian


def draw_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded from ``seed`` or, when None, from 64 bits of OS entropy.

    The seed never leaves the client: with it, the server could regenerate and cancel the noise.
    """
    value = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(value)


@dataclass
class DefenseContext:
    """What the guard measured on one batch, handed to the defense it applies.

    - ``op``: the batch's Jacobian operator (per-sample clipped when the guard clips);
    - ``gradient``: the flat update to protect [dθ];
    - ``eps``, ``lambda_max``: the Tikhonov ε_i and λmax(K_i) per sample [B];
    - ``generator``: the only source of randomness a defense may use (the guard's stream);
    - ``config``: the guard's configuration; a defense reads only its own fields (``sigma``,
      ``keep_ratio``, ``subspace_size``, …). Typed ``Any`` because the defense layer must not
      import the guard's configuration module, which sits above it;
    - ``spectrum``: the guard's Lanczos run on K_i — Ritz values [B, m] ascending and, when the
      defense needs them (``eigen``), Ritz vectors [B, m, dx]; None if the guard did not pass one;
    - ``info``: what the defense reports back (floats or per-sample tensors), merged into the
      guard's report details.
    """

    op: Jacobian
    gradient: torch.Tensor
    eps: torch.Tensor
    lambda_max: torch.Tensor
    generator: torch.Generator
    config: Any
    spectrum: LanczosResult | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Direction:
    """A noise direction (any norm) for the guard to scale, with what the defense learned."""

    vector: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)
