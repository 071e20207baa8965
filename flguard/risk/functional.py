"""The model's forward pass as the guard and the attacks differentiate it: a function of the parameters.

``functional_forward`` is ``torch.func.functional_call`` under one function mode (``_TwiceDifferentiable``) that
runs a few layers in plain operators — each the same function, to float rounding — because the guard's products
differentiate the forward pass twice in three compositions (reverse over reverse, vmapped, on the cached path;
vmapped forward-over-reverse, and reverse over forward mode one sample at a time, on the direct path), as do the
attacks' gradient matching, and some of PyTorch's kernels fail there or, worse, give wrong numbers. Measured on small
float64 nets against dense Jacobians from plain double backward (``tests/test_guard_layers.py``, PyTorch 2.14):

* **attention** (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``, torchvision's ViT): the default CPU
  kernel (flash attention) has no derivative of its backward, no forward-mode rule and no ``vmap`` rule — every
  transformer step was withheld. Both run as softmax(QKᵀ·scale + mask)V here (``_attention``,
  ``_multi_head_attention``), a training dropout on the weights replayed through ``F.dropout``
  (``flguard.risk.dropout_draws``); what they leave to PyTorch (grouped-query attention, bias_k) runs on its "math"
  kernel, selected for the whole pass;
* **softmax and log-softmax** (inside attention, or as layers): PyTorch's forward-mode rule leaves an output that
  reverse mode cannot differentiate ("modified by an inplace operation"), so one-sample products failed; they run
  as exp(x − max)/Σ and (x − max) − log Σ exp(x − max), the maximum held constant;
* **LayerNorm** (ViTs, ConvNeXts) **and InstanceNorm** without running statistics: *wrong* numbers — the tangent that
  forward mode carries through PyTorch's kernels has a wrong derivative in the input (on one probe −0.833 against a
  central difference of −0.380), and their derivatives under ``vmap`` are off too: K products off by 2–33% on the
  direct path and 0.1–0.3% on the cached one, certificates on wrong numbers. They run as (x − mean)/√(var + ε)·w + b;
* **Hardsigmoid** (MobileNetV3's gates): no derivative of its backward; runs as relu6(x + 3)/6;
* **global average pooling** (``F.adaptive_avg_pool2d`` to 1×1): the same numbers as a spatial mean, while the
  kernel's double backward on a channels-last gradient (a ConvNeXt's) takes an ``as_strided_`` that ``vmap`` has
  no batching rule for — a per-sample loop and a warning (a small ConvNeXt's cached K product 47 → 43 ms; a ResNet's
  products 1.5–2.5% faster, bit-identical);
* **recurrent layers** (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``) and their cells (``nn.RNNCell``, ``nn.GRUCell``,
  ``nn.LSTMCell``): their kernels write each step's state in place and fail under ``vmap``; they run step by step in
  plain operators (``flguard.risk.recurrent``), a stacked layer's dropout between its layers replayed like any other.

Every other activation, pooling, normalisation (GroupNorm's kernel is right in every composition and keeps its speed),
padding and resampling layer an image model uses runs as PyTorch has it, checked in the same test. The mode sees
every torch function of the forward pass (a few microseconds each, within the noise of the products it feeds). A
function mode does not see the calls inside a composite it lets through, so ``F.multi_head_attention_forward`` is
rewritten as a whole. The user's own training keeps PyTorch's kernels; the guard's check that its recomputed
gradient is the one in ``.grad`` (``flguard.guard.training``) compares the two to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from flguard.risk.dropout_draws import DROPOUT_FUNCTIONS, DropoutDraws
from flguard.risk.recurrent import CELLS as RECURRENT_CELLS
from flguard.risk.recurrent import PACKED, STEP_CELLS, packed, recurrent, recurrent_step


def _normalised(x: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """(x − mean) / √(var + eps) over ``dims`` (the biased variance, as PyTorch's norms), in plain operators."""
    centred = x - x.mean(dims, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(dims, keepdim=True) + eps)


def _layer_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, eps: float = 1e-5, *_: Any) -> torch.Tensor:
    out = _normalised(input, tuple(range(input.dim() - len(tuple(normalized_shape)), input.dim())), eps)
    out = out * weight if weight is not None else out
    return out + bias if bias is not None else out


def _instance_norm(input: torch.Tensor, running_mean: torch.Tensor | None = None,
                   running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, use_input_stats: bool = True, momentum: float = 0.1,
                   eps: float = 1e-5) -> torch.Tensor | None:
    if not use_input_stats or running_mean is not None:  # running statistics: the model check refuses those
        return None
    out = _normalised(input, tuple(range(2, input.dim())), eps)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    out = out * weight.view(shape) if weight is not None else out
    return out + bias.view(shape) if bias is not None else out


def _shifted(input: torch.Tensor, dim: int, dtype: torch.dtype | None) -> torch.Tensor:
    """``input`` less its (constant) maximum along ``dim``: the stable form of the softmaxes, whose value and every
    derivative the shift does not change."""
    x = input if dtype is None else input.to(dtype)
    return x - x.amax(dim, keepdim=True).detach()


def _softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    exp = _shifted(input, dim, dtype).exp()
    return exp / exp.sum(dim, keepdim=True)


def _log_softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    shifted = _shifted(input, dim, dtype)
    return shifted - shifted.exp().sum(dim, keepdim=True).log()


#: The softmaxes — ``torch.nn.functional``'s, torch's and the Tensor methods — and their plain forms.
_SOFTMAXES = {F.softmax: _softmax, torch.softmax: _softmax, torch.Tensor.softmax: _softmax,
              F.log_softmax: _log_softmax, torch.log_softmax: _log_softmax, torch.Tensor.log_softmax: _log_softmax}


#: A dropout on attention weights: (weights, p) ↦ the dropped weights (``flguard.risk.dropout_draws``'s, which draws or
#: replays the mask; None: PyTorch's own, which this module leaves to PyTorch).
AttentionDropout = Callable[[torch.Tensor, float], torch.Tensor]


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False, *, drop: AttentionDropout | None = None) -> torch.Tensor | None:
    """softmax(QKᵀ·scale + mask)V in plain operators, the weights dropped by ``drop`` (None where dropout without
    ``drop``, or grouped-query attention, asks for PyTorch's own)."""
    if (dropout_p > 0 and drop is None) or enable_gqa:
        return None
    scores = query @ key.transpose(-2, -1) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = _softmax(scores, -1)
    return (drop(weights, dropout_p) if dropout_p > 0 else weights) @ value


def _additive(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A mask in ``nn.MultiheadAttention``'s sense (bool: True where not to attend; float: added) as a float mask."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(mask, float("-inf"))


def _multi_head_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim_to_check: int,
                          num_heads: int, in_proj_weight: torch.Tensor | None, in_proj_bias: torch.Tensor | None,
                          bias_k: torch.Tensor | None, bias_v: torch.Tensor | None, add_zero_attn: bool,
                          dropout_p: float, out_proj_weight: torch.Tensor, out_proj_bias: torch.Tensor | None,
                          training: bool = True, key_padding_mask: torch.Tensor | None = None,
                          need_weights: bool = True, attn_mask: torch.Tensor | None = None,
                          use_separate_proj_weight: bool = False, q_proj_weight: torch.Tensor | None = None,
                          k_proj_weight: torch.Tensor | None = None, v_proj_weight: torch.Tensor | None = None,
                          static_k: torch.Tensor | None = None, static_v: torch.Tensor | None = None,
                          average_attn_weights: bool = True, is_causal: bool = False, *,
                          drop: AttentionDropout | None = None) -> tuple | None:
    """``F.multi_head_attention_forward`` on batched (L, N, E) inputs with ``_softmax`` (module doc), the attention
    weights dropped by ``drop`` while training (as PyTorch drops them: after the softmax, the weights returned too).
    The projections run batch first, self-attention's as one product with the packed weight, cross-attention's with
    every parameter whole (``_cross_projections``): the batched K product's fully connected layers
    (``flguard.risk.ghost_forward``);
    None (PyTorch's own) for what ``nn.MultiheadAttention`` seldom uses: dropout while training without ``drop``,
    bias_k/bias_v, zero attention, static keys, or a causal hint without its mask."""
    dropped = dropout_p > 0 and training
    if (query.dim() != 3 or (dropped and drop is None) or bias_k is not None or bias_v is not None or add_zero_attn
            or static_k is not None or static_v is not None or (is_causal and attn_mask is None)):
        return None
    (length, batch, embed), source, heads = query.shape, key.shape[0], num_heads
    if not use_separate_proj_weight and query is key and key is value:  # self-attention: one packed projection
        packed = F.linear(query.transpose(0, 1), in_proj_weight, in_proj_bias)  # (N, L, 3E), batch first
        q, k, v = (t.reshape(batch, length, heads, embed // heads).transpose(1, 2) for t in packed.chunk(3, -1))
    else:  # each of q, k, v from its own input, batch first; no slice of a parameter (``_cross_projections``)
        q, k, v = (t.reshape(batch, t.shape[1], heads, embed // heads).transpose(1, 2) for t in _cross_projections(
            (query, key, value), embed, in_proj_weight, in_proj_bias, use_separate_proj_weight,
            (q_proj_weight, k_proj_weight, v_proj_weight)))
    scores = q @ k.transpose(-2, -1) * (embed // heads) ** -0.5  # (N, H, L, S)
    if attn_mask is not None:
        mask = _additive(attn_mask, scores)
        scores = scores + (mask.view(batch, heads, length, source) if mask.dim() == 3 else mask)
    if key_padding_mask is not None:
        scores = scores + _additive(key_padding_mask, scores).view(batch, 1, 1, source)
    attention = _softmax(scores, -1)
    attention = drop(attention, dropout_p) if dropped else attention
    out = (attention @ v).transpose(1, 2).reshape(batch, length, embed)
    out = F.linear(out, out_proj_weight, out_proj_bias).transpose(0, 1).contiguous()  # (L, N, E), as PyTorch's
    if not need_weights:
        return out, None
    return out, attention.mean(1) if average_attn_weights else attention


def _cross_projections(inputs: tuple, embed: int, in_proj_weight: torch.Tensor | None,
                       in_proj_bias: torch.Tensor | None, separate: bool, weights: tuple) -> list[torch.Tensor]:
    """q, k and v [N, ·, E] of cross-attention's (L, N, ·) inputs: the packed weight applied whole to each input and its
    third of the output kept, or the three weights of their own (``kdim``/``vdim``) with each its third of the packed
    bias added to its output padded to 3E and cut back — the same numbers as PyTorch's chunks of the parameters, with
    every parameter used whole, so that the batched K product (``flguard.risk.ghost_forward``) takes the packed weight
    as three uses of one fully connected layer and the bias as a per-sample one (at three times the packed projection's
    cost, an E-wide input's)."""
    thirds = [slice(j * embed, (j + 1) * embed) for j in range(3)]
    batch_first = [t.transpose(0, 1) for t in inputs]
    if not separate:
        return [F.linear(t, in_proj_weight, in_proj_bias)[..., third] for t, third in zip(batch_first, thirds)]
    projected = [F.linear(t, w) for t, w in zip(batch_first, weights)]
    if in_proj_bias is None:
        return projected
    return [(F.pad(p, (j * embed, (2 - j) * embed)) + in_proj_bias)[..., third]
            for j, (p, third) in enumerate(zip(projected, thirds))]


class _TwiceDifferentiable(TorchFunctionMode):
    """The module doc's layers — norms, softmaxes, attention, Hardsigmoid, global average pooling — in plain
    operators, train-mode dropout (attention's too) with its recorded multipliers (``replay``); every other function
    as it is."""

    def __init__(self, replay: DropoutDraws | None = None) -> None:
        super().__init__()
        self.replay = replay
        self.drop = replay.attention_dropout if replay is not None else None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.replay is not None and func in DROPOUT_FUNCTIONS:
            return self.replay.__torch_function__(func, types, args, kwargs)
        if func is F.hardsigmoid:
            given = {**dict(zip(("input", "inplace"), args)), **kwargs}
            value = F.relu6(given["input"] + 3) / 6
            return given["input"].copy_(value) if given.get("inplace", False) else value
        if func is F.layer_norm or func is torch.layer_norm:
            return _layer_norm(*args, **kwargs)
        if func is F.instance_norm:
            value = _instance_norm(*args, **kwargs)
            if value is not None:
                return value
        if func in _SOFTMAXES:
            given = {**dict(zip(("input", "dim"), args)), **kwargs}
            if isinstance(given.get("dim"), int):  # F.softmax's implicit dim (None) is left to PyTorch
                return _SOFTMAXES[func](given["input"], given["dim"], given.get("dtype"))
        if func is F.multi_head_attention_forward:  # a composite: the calls inside it would not come through here
            value = _multi_head_attention(*args, **kwargs, drop=self.drop)
            if value is not None:
                return value
        if func is F.scaled_dot_product_attention:
            value = _attention(*args, **kwargs, drop=self.drop)
            if value is not None:
                return value
        if func in RECURRENT_CELLS:  # PyTorch's kernels write each step's state in place: they fail under vmap
            value = recurrent(func, args, kwargs, self.drop)
            if value is None and packed(args):
                raise ValueError(PACKED)
            if value is not None:
                return value
        if func in STEP_CELLS:  # a cell module's step (nn.LSTMCell …): its kernel fails under vmap as the layers' do
            return recurrent_step(func, args, kwargs)
        if func is F.adaptive_avg_pool2d:
            given = {**dict(zip(("input", "output_size"), args)), **kwargs}
            if given["output_size"] in (1, (1, 1), [1, 1]):  # global average pooling
                return given["input"].mean((-2, -1), keepdim=True)
        return func(*args, **kwargs)


def functional_forward(model: nn.Module, tensors: Any, inputs: torch.Tensor,
                       draws: Sequence[torch.Tensor] | DropoutDraws | None = None) -> torch.Tensor:
    """``model(inputs)`` with its parameters and buffers taken from ``tensors`` (a dict, or a tuple of dicts, as
    ``functional_call`` takes them), every layer in a twice-differentiable, vmappable form (module doc). ``draws``:
    the multipliers of the train-mode dropouts to replay, in call order, with ``inputs``' batch first
    (``dropout_draws.check_batch``'s layout, or as drawn), or a recording ``DropoutDraws``
    (``flguard.risk.dropout_draws``); None: dropout as PyTorch runs it. A replayed pass that calls another number of
    dropouts than were recorded is refused (``ValueError``)."""
    replay = draws if isinstance(draws, DropoutDraws) or draws is None else DropoutDraws(draws)
    with sdpa_kernel(SDPBackend.MATH), _TwiceDifferentiable(replay):
        out = functional_call(model, tensors, (inputs,))
    if replay is not None:
        replay.finish()
    return out


def uncompiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile`` wrapped, or ``model`` itself where it is not a compiled one: the same
    parameters and buffers, run by PyTorch's own operators. The guard differentiates the forward pass twice and in
    forward mode inside ``torch.func``'s transforms, where a compiled graph fails (TorchDynamo's assertion on a
    GroupNorm ResNet-8, PyTorch 2.14); the user's training keeps the compiled model."""
    inner = model.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if inner is not None and type(model).__name__ == "OptimizedModule" else model


#: The attention functions that ``flguard.risk.dropout_draws`` runs in plain operators while their weights are dropped,
#: so that it records the masks: each takes ``drop`` (``AttentionDropout``).
DROPPED_ATTENTION = {F.multi_head_attention_forward: _multi_head_attention, F.scaled_dot_product_attention: _attention}

__all__ = ["functional_forward", "uncompiled", "DROPPED_ATTENTION"]
