"""A BatchNorm with its statistics fixed: the map a pretrained network's eval-mode BatchNorm computes, in any mode.

``fix_model(model, batchnorm="frozen")`` puts one in place of each BatchNorm. Fine-tuning a pretrained network is
the case it is for: replacing its BatchNorms by GroupNorms (``batchnorm="groupnorm"``, Opacus' fix) changes what every
layer computes, and the pretrained features with it, while a BatchNorm whose running statistics stay as trained is
an affine map per channel of each sample alone —

    y = (x − μ)·γ/√(σ² + ε) + β,      μ, σ² the running statistics (buffers), γ, β the affine weights,

per sample and deterministic, so the guard certifies it like any other layer; no batch statistics couple the
samples, and no running statistics are updated from the batch (nothing the guard did not measure is sent). γ and β
keep their ``requires_grad``: train them, or freeze them with the rest of a backbone. A BatchNorm without running
statistics (``track_running_stats=False``) has none to freeze: ``fix_model`` refuses it by name.
"""

from __future__ import annotations

import torch
from torch import nn


class FrozenBatchNorm(nn.Module):
    """y = (x − running_mean)·weight/√(running_var + eps) + bias over dim 1 (channels), for inputs of any rank ≥ 2:
    an eval-mode ``BatchNorm1d/2d/3d`` as a per-sample layer whose mode never changes what it computes."""

    def __init__(self, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_features = int(running_mean.numel())
        self.eps = float(eps)
        self.register_buffer("running_mean", running_mean.detach().clone())
        self.register_buffer("running_var", running_var.detach().clone())
        self.weight = None if weight is None else nn.Parameter(weight.detach().clone(), weight.requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), bias.requires_grad)

    @classmethod
    def from_batchnorm(cls, module: nn.modules.batchnorm._BatchNorm, name: str = "") -> FrozenBatchNorm:
        """The BatchNorm ``module``'s eval-mode map with its running statistics and affine weights as they are."""
        if module.running_mean is None or module.running_var is None:
            raise ValueError(f"fix_model(batchnorm='frozen'): {name or '<model>'} ({type(module).__name__}) keeps no "
                             "running statistics (track_running_stats=False), so there are none to freeze; use "
                             "batchnorm='groupnorm'")
        return cls(module.running_mean, module.running_var, module.eps,
                   module.weight if module.affine else None, module.bias if module.affine else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, self.num_features) + (1,) * (x.dim() - 2)
        scale = torch.rsqrt(self.running_var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        out = (x - self.running_mean.view(shape)) * scale.view(shape)
        return out if self.bias is None else out + self.bias.view(shape)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine={self.weight is not None}"


__all__ = ["FrozenBatchNorm"]
