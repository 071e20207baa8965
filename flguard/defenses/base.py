"""What every defense sees (``DefenseContext``) and returns (``Direction`` or a new gradient)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from flguard.risk.operator import JacobianOperator


def draw_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded from ``seed`` or, when None, from 64 bits of OS entropy.

    The seed never leaves the client: with it, the server could regenerate and cancel the noise.
    """
    value = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(value)


@dataclass
class DefenseContext:
    """The batch's operator, its gradient and λmax/ε per sample, plus the noise generator."""

    op: JacobianOperator
    gradient: torch.Tensor
    eps: torch.Tensor
    lambda_max: torch.Tensor
    generator: torch.Generator
    config: object
    info: dict = field(default_factory=dict)


@dataclass
class Direction:
    """A noise direction (any norm) for the guard to scale, with what the defense learned."""

    vector: torch.Tensor
    info: dict = field(default_factory=dict)
