"""Weight initialisations compared in I2F §5.3 (uniform is the attack-study setting)."""

from __future__ import annotations

import math

import torch
from torch import nn

INIT_NAMES = ("default", "uniform", "normal", "kaiming", "xavier")

_PARAMETRIC = (nn.Conv2d, nn.Linear)


@torch.no_grad()
def initialize(model: nn.Module, init: str = "default") -> nn.Module:
    """Re-initialise the conv and linear layers of ``model`` in place and return it.

    - ``default``: PyTorch's own layer initialisation (left untouched).
    - ``uniform``: every weight and bias ~ U(-0.5, 0.5) (Sun et al. 2020; I2F's attack setting).
    - ``normal``: every weight and bias ~ N(0, 0.5) (variance 0.5, as in I2F Fig. 8).
    - ``kaiming``: He-normal weights (fan-in), zero biases.
    - ``xavier``: Glorot-normal weights, zero biases.
    Normalisation layers keep their defaults (weight 1, bias 0).
    """
    if init not in INIT_NAMES:
        raise ValueError(f"init={init!r} is not supported; choose one of {', '.join(INIT_NAMES)}")
    if init == "default":
        return model
    for module in model.modules():
        if not isinstance(module, _PARAMETRIC):
            continue
        if init == "uniform":
            module.weight.uniform_(-0.5, 0.5)
            if module.bias is not None:
                module.bias.uniform_(-0.5, 0.5)
            continue
        if init == "normal":
            module.weight.normal_(0.0, math.sqrt(0.5))
            if module.bias is not None:
                module.bias.normal_(0.0, math.sqrt(0.5))
            continue
        if init == "kaiming":
            nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
        else:
            nn.init.xavier_normal_(module.weight)
        if module.bias is not None:
            module.bias.zero_()
    return model
