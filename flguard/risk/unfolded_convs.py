"""Few-channel convolutions under ``vmap`` as unfold + batched matmul: the form of the operator's cached pullbacks on
the CPU.

The operator's cached Jᵀ product (``JacobianOperator._transpose_pullback``) differentiates every sample's input
gradient with respect to its own copy of the parameters, so under ``vmap`` each 2-D convolution carries a weight per
sample, which ``torch.func`` runs as one grouped convolution (groups = B) and its gradients as grouped ones too. On
the CPU, oneDNN's grouped kernels are slow where a group has few channels (below its 16-channel blocks): the
quickstart CNN's 1→6 and 6→16 layers at B = 32 ran at a few GFLOP/s. Written as what it is — the input unfolded into
its patches, [C_in·k_h·k_w, L] per sample, times the sample's weight matrix [C_out, C_in·k_h·k_w] — the same
convolution is one batched matmul under ``vmap``, and its derivatives are matmuls and folds. The cached J pullback
(one weight for the batch, per-sample inputs inside ``grad``) gains the same on an image's first layer, whose backward
to 1–3 input channels oneDNN runs slowly (the CNN's: 2.2 of a J product's 7.3 ms, profiled). Measured on one CPU
thread (docs/results.md, "Few-channel convolutions as batched matmuls"; ``benchmarks/bench_unfolded_convs.py``): the
trained quickstart CNN's cached K product at B = 32 0.72× (Jᵀ 0.65×, J 0.83×), ResNet-8-GN's (4–16 channels) 0.91×,
ResNet-20-GN's, whose stem alone has fewer than 16 channels, 1.01×. Layers of 16 channels or more stay PyTorch's:
there the grouped kernel is the faster one (ResNet-20-GN with every layer unfolded: its K product 145 → 177 ms), as
are the shared-weight layers after the first (ResNet-8-GN's J product with all of them unfolded: 26 → 35 ms).

Rewritten: ``F.conv2d`` with groups = 1 and numeric padding whose weight ``vmap`` batches (one per sample) with fewer
than ``UNFOLD_BELOW_CHANNELS`` input or output channels, or whose weight is shared and whose per-sample input has at
most ``UNFOLD_IMAGE_CHANNELS`` channels, where its patches take at most ``UNFOLD_MAX_PATCH_FLOATS`` per sample — only
on the CPU (a GPU's grouped kernels were not measured); the result equals PyTorch's convolution to float rounding
(float64: 1e-15).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair
from torch.overrides import TorchFunctionMode

from flguard.risk.transposed_input_grads import conv2d_arguments

#: Rewrite the cached pullbacks' few-channel convolutions (module doc). False: PyTorch's convolutions.
UNFOLD_PER_SAMPLE_CONVS = True

#: A convolution with fewer input or output channels than this is unfolded (oneDNN's blocks are 16 channels wide).
UNFOLD_BELOW_CHANNELS = 16

#: A convolution with one weight for the batch and per-sample inputs (the cached J pullback's) is unfolded where its
#: input has at most this many channels: an image's first layer.
UNFOLD_IMAGE_CHANNELS = 3

#: Per sample, at most this many floats of patches (C_in·k_h·k_w·L, kept for the backward pass: k_h·k_w times the
#: input): 4 MB, 128 MB at B = 32. The CNN's first layer has 14 k, a CIFAR ResNet stem 28 k; an ImageNet stem (7×7,
#: stride 2 on 224×224: 1.8 M) stays PyTorch's.
UNFOLD_MAX_PATCH_FLOATS = 2 ** 20


def _output_size(x: torch.Tensor, weight: torch.Tensor, stride: Any, padding: Any,
                 dilation: Any) -> tuple[int, int]:
    """(H', W') of the convolution of x [N, C_in, H, W] by ``weight`` [C_out, C_in, k_h, k_w]."""
    return tuple((x.shape[2 + d] + 2 * _pair(padding)[d] - _pair(dilation)[d] * (weight.shape[2 + d] - 1) - 1)
                 // _pair(stride)[d] + 1 for d in range(2))


def unfolded_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any = 1,
                    padding: Any = 0, dilation: Any = 1) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, dilation)`` (groups = 1, numeric padding) as the unfolded input
    times the weight matrix: x [N, C_in, H, W] → [N, C_out, H', W']."""
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    out_channels, _, kh, kw = weight.shape
    height, width = _output_size(x, weight, stride, padding, dilation)
    patches = F.unfold(x, (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))  # [N, C_in·kh·kw, L]
    out = torch.matmul(weight.reshape(out_channels, -1), patches).reshape(x.shape[0], out_channels, height, width)
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)


def _per_sample_weight(weight: torch.Tensor) -> bool:
    """Whether ``vmap`` batches ``weight`` (a weight per sample) at the outermost transform level."""
    return bool(torch._C._functorch.is_batchedtensor(weight))


def _batched_below(t: torch.Tensor) -> bool:
    """Whether ``vmap`` batches ``t`` at some level under the gradient transforms that wrap it (a per-sample input
    inside ``grad``: the cached J pullback's ``vmap(grad(…))``)."""
    functorch = torch._C._functorch
    while not functorch.is_batchedtensor(t):
        if not functorch.is_gradtrackingtensor(t):
            return False
        t = functorch.get_unwrapped(t)
    return True


def _unfolds(x: torch.Tensor, weight: torch.Tensor, stride: Any, padding: Any, dilation: Any) -> bool:
    """Whether the rule (module doc) unfolds a convolution of ``x`` by ``weight`` [C_out, C_in, k_h, k_w]."""
    height, width = _output_size(x, weight, stride, padding, dilation)
    if weight[0].numel() * height * width > UNFOLD_MAX_PATCH_FLOATS:
        return False
    if _per_sample_weight(weight):
        return min(weight.shape[0], weight.shape[1]) < UNFOLD_BELOW_CHANNELS
    return weight.shape[1] <= UNFOLD_IMAGE_CHANNELS and _batched_below(x)


class _UnfoldPerSampleConvs(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.conv2d:
            given = conv2d_arguments(args, kwargs)
            x, weight, stride, padding, dilation = (given[k] for k in ("input", "weight", "stride", "padding",
                                                                       "dilation"))
            if (x.dim() == 4 and given["groups"] == 1 and not isinstance(padding, str)
                    and _unfolds(x, weight, stride, padding, dilation)):
                return unfolded_conv2d(x, weight, given["bias"], stride, padding, dilation)
        return func(*args, **kwargs)


@contextlib.contextmanager
def unfolded_per_sample_convs(device: torch.device) -> Iterator[None]:
    """Record the passes run inside with the rule's convolutions unfolded (module doc) — on the CPU and while
    ``UNFOLD_PER_SAMPLE_CONVS``; elsewhere as PyTorch records them."""
    if UNFOLD_PER_SAMPLE_CONVS and torch.device(device).type == "cpu":
        with _UnfoldPerSampleConvs():
            yield
    else:
        yield
