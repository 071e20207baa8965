"""The forward pass of the batched K product (``flguard.risk.ghost_products``) with per-sample parameters.

Every parameter other than a convolution's or a fully connected layer's weight enters as a per-sample leaf (an expanded
[B, …] view of it), so that its gradient comes out per sample; 2-D convolutions and fully connected layers run through
``GhostConv2d`` with their weights shared, recording what pass 3 needs. Any other use of a parameter — by a function
this mode does not rewrite, or elementwise where a per-sample view would broadcast wrongly — raises ``Unsupported``, and
the operator keeps its one-at-a-time products.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair, _single
from torch.overrides import TorchFunctionMode

from flguard.risk.ghost_convolutions import (GROUPED_FROM_CHANNELS, Convolution, Dense, GhostConv2d, Patched,
                                             output_positions, unfold)
from flguard.risk.ghost_activations import closed_form_activation
from flguard.risk.ghost_group_norm import group_normalize


#: The elementwise products and sums a per-sample parameter may enter beside a batched activation
#: (``PerSampleParameters._broadcast``): LayerNorm's affine map in plain operators, a layer scale, an added embedding.
_ELEMENTWISE = {torch.mul, torch.add, torch.sub, torch.Tensor.mul, torch.Tensor.add, torch.Tensor.sub,
                torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__add__, torch.Tensor.__radd__,
                torch.Tensor.__sub__, torch.Tensor.__rsub__}
#: The tensor functions a parameter may pass through outside the rewritten layers: reading its shape or type (an
#: attribute that is a tensor — ``.T``, ``.data`` — or a comparison's result is refused: ``PerSampleParameters``).
_METADATA = {"__get__", "dim", "size", "numel", "stride", "is_contiguous", "is_floating_point", "is_complex",
             "element_size", "__len__", "__hash__", "__eq__"}


#: A convolution without groups on fewer input channels than this is taken on its input's patches (``Patched``): there
#: the product reads the patches anyway (below ``GROUPED_FROM_CHANNELS`` the formed weight is never taken by grouped
#: convolutions), so pass 2's vector is unfolded once for its pair and its convolution and pass 3's two input gradients
#: are folded back once. 0: every convolution as PyTorch's.
PATCHED_BELOW_CHANNELS = GROUPED_FROM_CHANNELS

#: GroupNorm's normalisation by ``flguard.risk.ghost_group_norm`` (its second derivative in closed form) instead of
#: ``F.group_norm``, whose recorded backward passes 2 and 3 differentiate op by op. Measured (docs/results.md,
#: "GroupNorm's and GELU's second derivatives in closed form"): ResNet-18-GN's K product at B = 8 in 4,101 operations
#: instead of 4,711 and 0.95× the time on a CPU. False: PyTorch's composite, for comparison.
CLOSED_FORM_GROUP_NORM = True
#: GELU and out-of-place SiLU by ``flguard.risk.ghost_activations`` (their second derivatives in closed form, taken
#: once in pass 1) instead of PyTorch's kernels, whose double backward evaluates them again at every pass. Measured
#: (docs/results.md, same section): a guarded step of torchvision's ViT (``vit_tiny32``) at B = 8 0.95× the time on a
#: CPU. False: PyTorch's kernels, for comparison.
CLOSED_FORM_ACTIVATIONS = True


class Unsupported(Exception):
    """The model uses a parameter in a way the batched product does not rewrite; the message says where."""


def ghost_support(model: nn.Module) -> str | None:
    """Why the batched product cannot take ``model`` (None: it can, subject to ``GhostKmv``'s check of its forward
    pass): each trainable parameter must belong to an ``nn.Conv1d`` or ``nn.Conv2d`` with numeric padding, an
    ``nn.GroupNorm``, an ``nn.LayerNorm``, an ``nn.Linear``, an ``nn.MultiheadAttention``, a recurrent layer
    (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``) or cell (``nn.RNNCell``, ``nn.GRUCell``, ``nn.LSTMCell``) — or to a module of
    the user's or a library's own (a layer scale, an embedding added to the activations), which the forward pass's
    check then judges."""
    for path, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if isinstance(module, (nn.Conv1d, nn.Conv2d)) and type(module).forward in _CONVOLUTION_FORWARDS:
            if isinstance(module.padding, str):
                return f"{path or 'the model'}: a 'same'-padded convolution"
        elif type(module).__module__.startswith("torch.") and type(module).forward not in _REWRITTEN_FORWARDS:
            return f"{path or 'the model'}: a {type(module).__name__} with trainable parameters"
    return None


#: The convolutions the batched product takes, by their own forward (a subclass's may do anything with the weight).
_CONVOLUTION_FORWARDS = (nn.Conv1d.forward, nn.Conv2d.forward)
#: PyTorch's layers whose parameters the batched product takes (besides the convolutions): attention's, self- or
#: cross-attention, its projections packed or not (``flguard.risk.functional``'s plain-operator attention; anything
#: else that attention hands a parameter to is refused by the forward pass's check); the recurrent layers' in plain
#: operators (``flguard.risk.recurrent``: each step's W_hh a use of one fully connected layer, its biases per-sample
#: leaves), and their cell modules' (each call of the cell one more use of its weights).
_REWRITTEN_FORWARDS = (nn.GroupNorm.forward, nn.LayerNorm.forward, nn.Linear.forward, nn.MultiheadAttention.forward,
                       nn.RNN.forward, nn.GRU.forward, nn.LSTM.forward, nn.RNNCell.forward, nn.GRUCell.forward,
                       nn.LSTMCell.forward)


class PerSampleParameters(TorchFunctionMode):
    """The forward pass with per-sample parameters: 2-D convolutions and fully connected layers through
    ``GhostConv2d`` (their weights shared), GroupNorm's affine parameters and every bias as batched products; any other
    function handed a parameter raises ``Unsupported`` (its per-sample view would broadcast wrongly)."""

    def __init__(self, batch: int, weights: dict[int, str], dense: set[int], per_sample: dict[int, str],
                 model_input: torch.Tensor) -> None:
        super().__init__()
        self.batch, self.weights, self.dense, self.per_sample = batch, weights, dense, per_sample
        self.model_input = model_input
        self.layers: list[Convolution] = []
        self.collecting = [False]

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.conv2d:
            return self._conv2d(*args, **kwargs)
        if func is F.conv1d:
            return self._conv1d(*args, **kwargs)
        if func is F.group_norm:
            return self._group_norm(*args, **kwargs)
        if func is F.linear:
            return self._linear(*args, **kwargs)
        if func is torch.Tensor.expand and self._leaf(args[0]):  # a class token [1, 1, D] to [B, 1, D]
            return self._expanded(args[0], *args[1:], **kwargs)
        if func in _ELEMENTWISE and len(args) == 2 and not kwargs:
            a, b = args
            if self._leaf(a) or self._leaf(b):
                return func(self._broadcast(a, b), self._broadcast(b, a))
        tracked = [t for t in _tensors((args, kwargs)) if id(t) in self.weights or id(t) in self.per_sample]
        if tracked and getattr(func, "__name__", "") not in _METADATA:
            raise Unsupported(f"{getattr(func, '__name__', func)} takes the parameter {self._name(tracked[0])}")
        if CLOSED_FORM_ACTIVATIONS and (func is F.gelu or func is F.silu):  # on activations, never on a parameter
            out = closed_form_activation(func, args, kwargs)
            if out is not None:
                return out
        result = func(*args, **kwargs)
        if tracked and isinstance(result, torch.Tensor):  # ``.T``, ``.data``, a comparison: a per-sample view reshaped
            raise Unsupported(f"a tensor attribute or comparison of the parameter {self._name(tracked[0])}")
        return result

    def _name(self, t: torch.Tensor) -> str:
        return self.per_sample.get(id(t)) or self.weights[id(t)]

    def _leaf(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.per_sample

    def _broadcast(self, t: Any, other: Any) -> Any:
        """A per-sample leaf [B, *shape] viewed to meet ``other`` (a batched activation, [B, …]) as the parameter of
        ``shape`` met it: its missing leading dimensions as ones after the batch (a LayerNorm's [C] on [B, H, W, C],
        a layer scale's [C, 1, 1] on [B, C, H, W]), or a leading one as the batch (a [1, N, D] embedding on
        [B, N, D]). Anything else — a parameter met by a scalar, another parameter or a tensor of other rows — raises
        ``Unsupported``: there a per-sample view would broadcast wrongly."""
        if not self._leaf(t):
            return t
        shape = t.shape[1:]
        if not (isinstance(other, torch.Tensor) and other.dim() >= len(shape) and not self._leaf(other)
                and id(other) not in self.weights):
            raise Unsupported(f"an elementwise product or sum takes the parameter {self._name(t)} beside no batch")
        self._batched(other, f"the parameter {self._name(t)}'s elementwise product or sum")
        if other.dim() > len(shape):
            return t.reshape(self.batch, *([1] * (other.dim() - 1 - len(shape))), *shape)
        if shape[0] == 1:
            return t.reshape(self.batch, *shape[1:])
        raise Unsupported(f"the parameter {self._name(t)} meets a tensor of its own rank across the batch")

    def _expanded(self, t: torch.Tensor, *sizes: Any, **kwargs: Any) -> torch.Tensor:
        """A per-sample leaf [B, 1, …] of a parameter with a leading one, expanded as the parameter was: to the batch
        along dimension 0 (a class token's ``expand(n, -1, -1)``), each sample its own copy. Any other expansion raises
        ``Unsupported``."""
        size = tuple(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) else sizes
        shape = t.shape[1:]
        if kwargs or len(size) != len(shape) or shape[0] != 1 or size[0] != self.batch:
            raise Unsupported(f"the parameter {self._name(t)} is expanded otherwise than along a leading one to the "
                              "batch")
        return t.reshape(self.batch, *shape[1:]).expand(self.batch, *size[1:])

    def _batched(self, x: torch.Tensor, where: str) -> None:
        if x.shape[0] != self.batch:
            raise Unsupported(f"{where} sees {x.shape[0]} rows where the batch has {self.batch}")

    def _shaped(self, p: torch.Tensor | None, dims: int) -> torch.Tensor | None:
        """A per-sample parameter [B, C] viewed to broadcast along dim 1 of a ``dims``-dimensional input."""
        if p is None or id(p) not in self.per_sample:
            return None if p is None else p.reshape(1, -1, *([1] * (dims - 2)))
        return p.reshape(self.batch, -1, *([1] * (dims - 2)))

    def _ghost(self, layer: Convolution, input: torch.Tensor, where: str,
               source: torch.Tensor | None = None) -> torch.Tensor:
        """``layer``'s output through ``GhostConv2d``, the layer recorded: one use of its shared weight, which may be
        used again — a recurrent weight at every step, a layer applied twice (``weight_dot`` takes its uses as one
        layer) — by the same kind of layer with the same groups. ``source``: the tensor the model handed the layer where
        ``input`` is a view of it (a 1-D convolution's input as a map one row high)."""
        for seen in self.layers:
            if seen.name == layer.name and (type(seen) is not type(layer) or seen.groups != layer.groups
                                            or seen.weight.shape != layer.weight.shape):
                raise Unsupported(f"{layer.name} is used by two kinds of layers")
        self._batched(input, where)
        layer.reads_input = (source if source is not None else input) is self.model_input  # pass 2 skips its gradient
        self.layers.append(layer)
        return GhostConv2d.apply(input, layer.token, layer)

    def _token(self, input: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=input.dtype, device=input.device, requires_grad=True)

    def _shared_convolution(self, weight: torch.Tensor, input: torch.Tensor, padding: Any, dims: int) -> bool:
        """Whether a convolution's weight is one the product keeps shared (else a buffer or a frozen tensor: run as it
        is); a parameter taken per sample or as a fully connected weight, 'same' padding or an input of another rank
        raise ``Unsupported``."""
        if id(weight) in self.per_sample or id(weight) in self.dense:
            raise Unsupported(f"a convolution takes {self._name(weight)} as its weight")
        if id(weight) in self.weights and (isinstance(padding, str) or input.dim() != dims):
            raise Unsupported(f"the convolution of {self.weights[id(weight)]}: 'same' padding or no batch")
        return id(weight) in self.weights

    def _conv2d(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: Any = 1,
                padding: Any = 0, dilation: Any = 1, groups: int = 1) -> torch.Tensor:
        if not self._shared_convolution(weight, input, padding, 4):
            return F.conv2d(input, weight, None, stride, padding, dilation, groups) + self._bias(bias, 4)
        settings = (_pair(stride), _pair(padding), _pair(dilation))
        return self._convolution(input, weight, self.weights[id(weight)], settings, groups) + self._bias(bias, 4)

    def _convolution(self, input: torch.Tensor, weight: torch.Tensor, name: str, settings: tuple, groups: int,
                     source: torch.Tensor | None = None) -> torch.Tensor:
        """A 2-D convolution [B, I, H, W] → [B, O, H', W'] with the layer's shared weight, through ``GhostConv2d``: on
        the input's patches where it has fewer than ``PATCHED_BELOW_CHANNELS`` channels and no groups (``Patched``,
        its weight the [O, I·k²] view of the [O, I, k, k] one, the same numbers), else as a ``Convolution``."""
        token = self._token(input)
        if groups != 1 or weight.shape[1] >= PATCHED_BELOW_CHANNELS:
            layer = Convolution(weight, name, settings, token, collecting=self.collecting, groups=groups)
            return self._ghost(layer, input, "a convolution", source)
        kernel = tuple(weight.shape[2:])
        layer = Patched(weight.reshape(weight.shape[0], -1), name, settings, token, collecting=self.collecting)
        out = self._ghost(layer, unfold(input, kernel, *settings), "a convolution",
                          input if source is None else source)  # [B, O, P]
        return out.reshape(*out.shape[:2], *output_positions(input, kernel, *settings))

    def _conv1d(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: Any = 1,
                padding: Any = 0, dilation: Any = 1, groups: int = 1) -> torch.Tensor:
        """A 1-D convolution (a time series' [B, C, L]) as the 2-D one of a map one row high: its weight [O, I/G, k]
        viewed as [O, I/G, 1, k], the same numbers in the same order, so its per-sample gradient is the 2-D one's."""
        if not self._shared_convolution(weight, input, padding, 3):
            return F.conv1d(input, weight, None, stride, padding, dilation, groups) + self._bias(bias, 3)
        settings = ((1, _single(stride)[0]), (0, _single(padding)[0]), (1, _single(dilation)[0]))
        out = self._convolution(input.unsqueeze(2), weight.unsqueeze(2), self.weights[id(weight)], settings, groups,
                                source=input)
        return out.squeeze(2) + self._bias(bias, 3)

    def _bias(self, bias: torch.Tensor | None, dims: int) -> torch.Tensor | float:
        shaped = self._shaped(bias, dims)
        return 0.0 if shaped is None else shaped

    def _group_norm(self, input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
        self._batched(input, "a GroupNorm")
        out = (group_normalize(input, num_groups, eps) if CLOSED_FORM_GROUP_NORM
               else F.group_norm(input, num_groups, None, None, eps))
        scale = self._shaped(weight, input.dim())
        return (out if scale is None else out * scale) + self._bias(bias, input.dim())

    def _linear(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if id(weight) in self.dense:
            layer = Dense(weight, self.weights[id(weight)], (), self._token(input), collecting=self.collecting)
            out = self._ghost(layer, input, "a Linear layer")
        elif id(weight) in self.weights or id(weight) in self.per_sample:
            raise Unsupported(f"linear takes {self._name(weight)} as its weight")
        else:
            out = F.linear(input, weight)
        if bias is None:
            return out
        if id(bias) not in self.per_sample:
            return out + bias
        self._batched(input, "a Linear layer")
        return out + bias.reshape(self.batch, *([1] * (input.dim() - 2)), -1)


def _tensors(value: Any):
    """The tensors in a function's arguments, through lists, tuples (named ones too) and dicts: what ``tree_leaves``
    finds there, at a fraction of its cost on the forward pass's thousands of calls (a recurrent layer's steps)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
