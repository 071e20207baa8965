"""A convolution's part in the ghost K product (``flguard.risk.ghost_products``): the autograd functions that record
its input gradient as a transposed convolution and leave pass 2's weight gradient as pairs (a, b), w = Σ wgrad(a, b),
and the inner product of such a w with the sample's own weight gradient wgrad(δ, x) — by two P×P Gram matrices per
sample, or by the formed weight where that is cheaper. A fully connected layer takes the same route as a 1×1
convolution over its input's inner positions (``Dense``: one position on a [B, I] input, where the Gram matrices are
two dot products per pair instead of an O×I weight per sample); a convolution of few input channels runs on its
input's patches (``Patched``: the patches unfolded and folded back once a pass, where its products read them anyway).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from flguard.risk.transposed_input_grads import input_gradient


@dataclass(eq=False)
class Convolution:
    """One convolution call of the forward pass: its weight and settings, the scalar leaf that makes pass 2 run its
    backward, pass 1's (δ, x) with their graphs, and pass 2's pairs."""
    weight: torch.Tensor
    name: str
    settings: tuple
    token: torch.Tensor
    first: tuple[torch.Tensor, torch.Tensor] | None = None
    pairs: list = field(default_factory=list)
    collecting: list = field(default_factory=lambda: [False])  # shared by one graph's convolutions
    reads_input: bool = False  # whether the layer's input is the model's input itself (pass 1's leaf x)
    groups: int = 1  # G: input and output channels in G groups, each group's outputs reading its own inputs
    kept_patches: torch.Tensor | None = None  # ``input_patches``: pass 1's patches(x), where kept for the graph

    def convolve(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        stride, padding, dilation = self.settings
        return F.conv2d(x, self.weight if weight is None else weight, None, stride, padding, dilation, self.groups)

    def transposed(self, g: torch.Tensor, shape: torch.Size, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution's input gradient for output gradient ``g`` (input of ``shape``), a transposed convolution
        with the rows and columns a strided convolution never reached as its output padding."""
        return input_gradient(g, self.weight if weight is None else weight, shape, *self.settings, self.groups)

    def weight_gradient(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """wgrad(a, b) summed over the batch: the gradient in the weight of ⟨a, conv(b, W)⟩ (contiguous operands:
        oneDNN's channels-last strided 1×1 weight gradient is wrong on some CPUs, tests/conftest.py)."""
        stride, padding, dilation = self.settings
        return torch.nn.grad.conv2d_weight(b.contiguous(), self.weight.shape, a.contiguous(), stride, padding, dilation,
                                           self.groups)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """[B, I·k², P]: the input's patches in the weight's order (``F.unfold``'s result, ``_Patches``)."""
        return unfold(x, tuple(self.weight.shape[2:]), *self.settings)

    def input_patches(self) -> torch.Tensor:
        """patches(x) of pass 1's input x, with its graph: taken once and kept for the graph's later products where
        they take at most KEPT_PATCHES_BYTES (each product's ``pair_dot`` reads them), else taken afresh."""
        if self.kept_patches is not None:
            return self.kept_patches
        x = self.first[1]
        patches = self.patches(x)
        if patches.numel() * patches.element_size() <= KEPT_PATCHES_BYTES:
            self.kept_patches = patches
        return patches

    def outputs(self, t: torch.Tensor) -> torch.Tensor:
        """[B, O, P]: an output-shaped tensor (δ, a pair's a) by output channel and position."""
        return t.reshape(t.shape[0], t.shape[1], -1)

    def positions(self) -> int:
        """P, the output positions of one sample (pass 1's δ)."""
        return self.first[0][0, 0].numel()

    def per_sample_weights(self, outputs: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """[B, O, I·k²/G]: each sample's Σ_p outputs(p) ⊗ patch(p) (``outputs`` [B, O, P], ``patches`` [B, I·k², P]) —
        the weight gradient of one sample, each group's outputs against its own inputs' patches."""
        return torch.bmm(_by_group(outputs, self.groups), _by_group(patches, self.groups).transpose(1, 2)).reshape(
            outputs.shape[0], outputs.shape[1], -1)

    def folds_batch(self) -> bool:
        """Whether the formed route runs as convolutions with the batch folded into the groups (``sample_weights``,
        ``sample_convolve``) rather than on patches: a kernel wider than one position on an input of at least
        GROUPED_FROM_CHANNELS channels per group, and at least as many output positions as those channels."""
        channels = self.weight.shape[1]
        return channels >= GROUPED_FROM_CHANNELS and self.weight[0, 0].numel() > 1 and self.positions() >= channels

    def sample_weights(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[B·O, I/G, k_h, k_w]: each sample's wgrad(a_i, b_i) (output-shaped ``a``, input-shaped ``b``), the weight
        gradient of one convolution whose groups are the samples' (and each sample's own G), in the weight's layout."""
        stride, padding, dilation = self.settings
        batch, shape = b.shape[0], self.weight.shape
        return torch.nn.grad.conv2d_weight(b.reshape(1, -1, *b.shape[2:]), (batch * shape[0], *shape[1:]),
                                           a.reshape(1, -1, *a.shape[2:]), stride, padding, dilation,
                                           batch * self.groups)

    def sample_convolve(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[B, O, …]: each sample's input convolved with its own weight (``weights`` [B·O, I/G, k_h, k_w])."""
        stride, padding, dilation = self.settings
        out = F.conv2d(x.reshape(1, -1, *x.shape[2:]), weights, None, stride, padding, dilation,
                       x.shape[0] * self.groups)
        return out.reshape(x.shape[0], -1, *out.shape[2:])

    def applied(self, weights: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """[B, O, P]: each sample's weight ``weights`` [B, O, I·k²/G] applied to its ``patches`` [B, I·k², P]."""
        return torch.bmm(_by_group(weights, self.groups), _by_group(patches, self.groups)).reshape(
            weights.shape[0], weights.shape[1], -1)


@dataclass(eq=False)
class Dense(Convolution):
    """One ``F.linear`` call of the forward pass (no bias: the bias stays a per-sample leaf), as a 1×1 convolution
    over the input's inner positions: x [B, …, I] → [B, …, O], P the product of the inner dimensions (1 on [B, I])."""

    def convolve(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight if weight is None else weight)

    def transposed(self, g: torch.Tensor, shape: torch.Size, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The input gradient g·W for output gradient ``g``."""
        return torch.matmul(g, self.weight if weight is None else weight)

    def weight_gradient(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Σ over the batch and positions of a ⊗ b: [O, I]."""
        return a.reshape(-1, a.shape[-1]).t() @ b.reshape(-1, b.shape[-1])

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """[B, I, P]: the input by feature and position."""
        return x.reshape(x.shape[0], -1, x.shape[-1]).transpose(1, 2)

    def outputs(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1, t.shape[-1]).transpose(1, 2)

    def positions(self) -> int:
        return self.first[0][0, ..., 0].numel()

    def folds_batch(self) -> bool:
        return False


@dataclass(eq=False)
class Patched(Convolution):
    """A convolution of few input channels taken on its input's patches (``flguard.risk.ghost_forward``'s
    ``PATCHED_BELOW_CHANNELS``): x [B, I·k², P] (``unfold`` of the layer's input) → W x [B, O, P], W the [O, I·k²] view
    of the weight (the same numbers). Pass 2's vector reaches it as patches, unfolded once for its pair and its
    convolution — a matrix product, not oneDNN's few-channel convolution — and pass 3's two input gradients, through
    the output and through the per-sample weight's patches, meet on the patches and are folded back once."""

    def convolve(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return torch.matmul(self.weight if weight is None else weight, x)

    def transposed(self, g: torch.Tensor, shape: torch.Size, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The patches' gradient Wᵀg for output gradient ``g`` [B, O, P]."""
        return torch.matmul((self.weight if weight is None else weight).t(), g)

    def weight_gradient(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Σ over the batch and positions of a ⊗ b: [O, I·k²]."""
        return self.per_sample_weights(a, b).sum(0)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def folds_batch(self) -> bool:
        return False


#: The formed weight (``pair_dot``, the per-sample gradients) as convolutions with the batch folded into the groups —
#: each sample's weight a grouped weight gradient, applied by one grouped convolution — on inputs of at least this many
#: channels per group and maps of at least as many positions (``Convolution.folds_batch``): there oneDNN's grouped
#: kernels beat copying patches and multiplying them. Measured on one CPU thread (docs/results.md, "The formed weight
#: by grouped convolutions"): a pair's dot product and its input gradient on [8, 64, 32, 32] 3×3 0.58×, [8, 128, 16,
#: 16] 0.83×, [32, 16, 32, 32] 0.42× the patches' time; [8, 256, 8, 8] (fewer positions than channels) 1.58×, few
#: channels ([32, 6, 12, 12] 5×5) 1.37×, 1×1 kernels 1.65×.
GROUPED_FROM_CHANNELS = 16

#: ``Convolution.input_patches`` keeps a layer's patches of pass 1's input for the graph's later products up to this
#: many bytes (the quickstart CNN's two convolutions at B = 32: 1.8 and 1.2 MB; the larger maps of a ResNet's early
#: layers, 2.4 MB a sample at 64 channels and 32×32, are taken afresh, as the graphs kept are already large there).
KEPT_PATCHES_BYTES = 2 ** 22

#: ``_Fold`` (``_Patches``' backward) on a CPU: one ``index_add_`` of every patch entry onto its input position (the
#: positions ``_patch_index`` keeps) on maps of fewer than SLICES_FROM_POSITIONS positions, else k_h·k_w strided slice
#: additions. Measured on one CPU thread against ``F.fold`` (col2im) and the slices (docs/results.md, "Patch gradients
#: folded by one index_add"): [16, 1, 28, 28] and [32, 6, 12, 12] 5×5 (the quickstart CNN's) 0.155 / 0.218 ms against
#: col2im's 0.239 / 0.401; [8, 256, 8, 8] 3×3 0.79 against 1.29 (slices), [8, 128, 16, 16] 3×3 stride 2 0.40 against
#: 0.83; on 32×32 maps the slices, equal or up to 8% faster ([8, 64, 32, 32] 3.25 against 3.53 ms).
SLICES_FROM_POSITIONS = 1024
#: ``_Fold``'s ``index_add_`` only where its index (``_patch_index``: one int64 per patch entry, kept per shape) has at
#: most this many entries (8 MB; [B, 256, 8, 8] 3×3 has 0.15 M), else the slices: the indices kept stay bounded.
INDEX_ADD_UP_TO = 2 ** 20
#: On other devices ``_Fold`` keeps its earlier rule: the slices from this many input channels on, ``F.fold`` below
#: (a CUDA ``index_add_`` adds by atomics, in no fixed order).
SLICES_FROM_CHANNELS = 16


class _Patches(torch.autograd.Function):
    """``F.unfold`` of a 4-D input as a strided view copied once (on one CPU thread 3–9× faster than its im2col), its
    backward ``_Fold`` — differentiable again, so that pass 1 may record it (a convolution taken on its input's
    patches, ``Patched``). The ghost K product against ``F.unfold``'s (docs/results.md, "Ghost products on small
    models"): 0.88× on the quickstart CNN at B = 32, 0.85× on ResNet-18-GN at B = 8."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: tuple, stride: tuple, padding: tuple,
                dilation: tuple) -> torch.Tensor:
        ctx.shape, ctx.settings = x.shape, (kernel, stride, padding, dilation)
        padded = F.pad(x, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else x
        view = _patch_view(padded, kernel, stride, dilation)  # [B, C, k_h, k_w, rows, columns]
        return view.reshape(view.shape[0], view.shape[1] * kernel[0] * kernel[1], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _Fold.apply(grad, ctx.shape, ctx.settings), None, None, None, None


class _Fold(torch.autograd.Function):
    """``_Patches``' adjoint: [B, C·k_h·k_w, P] summed back onto the input's [B, C, H, W] — on a CPU one ``index_add_``
    on maps of fewer than ``SLICES_FROM_POSITIONS`` positions and k_h·k_w strided slice additions on larger ones (both
    faster than col2im); elsewhere the slices from ``SLICES_FROM_CHANNELS`` channels on and ``F.fold`` below. Its own
    backward ``_Patches``."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, shape: torch.Size, settings: tuple) -> torch.Tensor:
        ctx.settings = settings
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = settings
        batch, channels, height, width = shape
        if grad.device.type == "cpu" and height * width < SLICES_FROM_POSITIONS and grad[0].numel() <= INDEX_ADD_UP_TO:
            index = _patch_index(channels, height + 2 * ph, width + 2 * pw, (kh, kw), (sh, sw), (dh, dw), grad.device)
            out = grad.new_zeros(batch, channels * (height + 2 * ph) * (width + 2 * pw))
            out.index_add_(1, index, grad.reshape(batch, -1))
            return out.view(batch, channels, height + 2 * ph, width + 2 * pw)[:, :, ph:ph + height, pw:pw + width]
        if grad.device.type != "cpu" and channels < SLICES_FROM_CHANNELS:
            return F.fold(grad, (height, width), (kh, kw), (dh, dw), (ph, pw), (sh, sw))
        out = grad.new_zeros(batch, channels, height + 2 * ph, width + 2 * pw)
        patches = _patch_view(out, (kh, kw), (sh, sw), (dh, dw))  # each kernel offset's positions, a strided slice
        grad = grad.reshape(patches.shape)
        for i in range(kh):
            for j in range(kw):
                patches[:, :, i, j].add_(grad[:, :, i, j])  # in place on the view: no copy back
        return out[:, :, ph:ph + height, pw:pw + width]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _Patches.apply(grad, *ctx.settings), None, None


def _patch_view(padded: torch.Tensor, kernel: tuple, stride: tuple, dilation: tuple) -> torch.Tensor:
    """[B, C, k_h, k_w, rows, columns]: a padded input's patches as a strided view of it (no copy)."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    rows, cols = _positions(padded.shape, kernel, stride, dilation)
    sb, sc, sy, sx = padded.stride()
    return padded.as_strided((*padded.shape[:2], kh, kw, rows, cols), (sb, sc, dh * sy, dw * sx, sh * sy, sw * sx),
                             padded.storage_offset())


@functools.lru_cache(maxsize=16)
def _patch_index(channels: int, height: int, width: int, kernel: tuple, stride: tuple, dilation: tuple,
                 device: torch.device) -> torch.Tensor:
    """[C·k_h·k_w·P] int64: each patch entry's position in a padded input [C, height, width] (the padding already in
    its size), flattened, in ``unfold``'s order — ``_Fold``'s ``index_add_`` targets (kept per shape: a guard folds
    the same layers every product)."""
    positions = torch.arange(channels * height * width, device=device).view(1, channels, height, width)
    return _patch_view(positions, kernel, stride, dilation).reshape(-1)


def unfold(x: torch.Tensor, kernel: tuple, stride: tuple, padding: tuple, dilation: tuple) -> torch.Tensor:
    """[B, C·k_h·k_w, P]: the patches of x [B, C, H, W] in a convolution's weight order (``F.unfold``'s result),
    differentiable to any order (``_Patches``, ``_Fold``)."""
    return _Patches.apply(x, tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))


def output_positions(x: torch.Tensor, kernel: tuple, stride: tuple, padding: tuple,
                     dilation: tuple) -> tuple[int, int]:
    """(rows, columns) of a convolution's output on x [B, C, H, W] (numeric padding)."""
    padded = (*x.shape[:2], x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1])
    return _positions(padded, kernel, stride, dilation)


def _positions(shape: torch.Size, kernel: tuple, stride: tuple, dilation: tuple) -> tuple[int, int]:
    """(rows, columns) of a convolution's output on a padded input of ``shape``."""
    return tuple((shape[2 + d] - dilation[d] * (kernel[d] - 1) - 1) // stride[d] + 1 for d in range(2))


class GhostConv2d(torch.autograd.Function):
    """y = conv2d(x, W) with W the layer's shared weight; its backward keeps pass 1's (δ, x) and records the input
    gradient as ``GhostConvTranspose2d``, and in pass 2 hands the weight's gradient over as the pair (δ, x)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, token: torch.Tensor, layer: Convolution) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.layer = weakref.ref(layer)  # the layer holds δ, whose graph holds this node: no cycle through C++
        return layer.convolve(x)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        layer = ctx.layer()
        if torch.is_grad_enabled():  # pass 1 (create_graph)
            layer.first = (gy, x)
            gx = GhostConvTranspose2d.apply(gy, layer.token, layer, x.shape) if ctx.needs_input_grad[0] else None
            return gx, None, None  # (the token's gradient is never read: it only makes the passes run this)
        if layer.collecting[0]:
            layer.pairs.append((gy, None))  # b = pass 1's x: its patches are the ones pair_dot unfolds anyway
        # (autograd asks a Python function for every input's gradient; pass 2 (collecting) differentiates in the
        # parameters only, so the model input's, a first layer's transposed convolution, would be thrown away)
        wanted = ctx.needs_input_grad[0] and not (layer.collecting[0] and layer.reads_input)
        gx = layer.transposed(gy, x.shape) if wanted else None
        return gx, None, None


class GhostConvTranspose2d(torch.autograd.Function):
    """The input gradient of ``GhostConv2d``: ⟨ȳ, convᵀ(g, W)⟩ = ⟨conv(ȳ, W), g⟩, so its weight gradient is the pair
    (g, ȳ) and its gradient in g the convolution of ȳ."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, token: torch.Tensor, layer: Convolution, shape: torch.Size) -> torch.Tensor:
        ctx.save_for_backward(g)
        ctx.layer = weakref.ref(layer)
        return layer.transposed(g, shape)

    @staticmethod
    def backward(ctx: Any, gbar: torch.Tensor) -> tuple:
        (g,) = ctx.saved_tensors
        layer = ctx.layer()
        if layer.collecting[0]:
            layer.pairs.append((g.detach(), gbar))
        dg = layer.convolve(gbar) if ctx.needs_input_grad[0] else None
        return dg, None, None, None


def _by_group(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, G·n, m] → [B·G, n, m]: a sample's rows split into its G groups, each group a matrix of its own."""
    return t.reshape(t.shape[0] * groups, t.shape[1] // groups, t.shape[2])


def ghost_cheaper(layer: Convolution, positions: int | None = None) -> bool:
    """Whether the Gram matrices (P·(O + I·k²) per pair and sample) cost less than forming the weight (2·O·I·k²);
    never for a grouped convolution, whose Gram matrices would be one pair per group (its weight is G times smaller).
    ``positions``: P where it is not the layer's own (a weight's uses taken as one layer, ``weight_dot``)."""
    if layer.groups != 1:
        return False
    positions = layer.positions() if positions is None else positions
    outputs, inputs = layer.weight.shape[0], layer.weight[0].numel()
    return positions * (outputs + inputs) < 2 * outputs * inputs


def pair_dot(layer: Convolution, ghost: bool) -> torch.Tensor:
    """Σ_j ⟨wgrad(δ_j, x_j), w_j⟩ with w_j = Σ_pairs wgrad(a_j, b_j) (``flguard.risk.ghost_products``), δ and x
    carrying pass 1's graph: through Gram matrices (``ghost``; a grouped convolution always forms its weight) or the
    formed weight. A pair's b of None is pass 1's x (the forward convolution's pair): its patches are x's, unfolded
    once."""
    delta, x = layer.first
    ghost = ghost and layer.groups == 1
    if ghost and delta.dim() == 2:  # a fully connected layer on [B, I] (P = 1): each Gram matrix one dot product
        if not layer.pairs:
            return delta.new_zeros(())
        fixed = x.detach()  # the pairs stacked [pairs, B, ·]: one expression (and one backward) for them all
        outputs = torch.stack([a for a, _ in layer.pairs])
        inputs = torch.stack([fixed if b is None else b for _, b in layer.pairs])
        return ((delta * outputs).sum(2) * (x * inputs).sum(2)).sum()
    if not ghost and layer.folds_batch():  # the formed weight by convolutions, no patches
        weight = None
        for a, b in layer.pairs:
            part = layer.sample_weights(a, x.detach() if b is None else b)
            weight = part if weight is None else weight + part
        return (layer.sample_convolve(x, weight) * delta).sum()
    deltas = layer.outputs(delta)  # [B, O, P]
    patches = layer.input_patches()  # [B, I·k², P]
    fixed = patches.detach()
    if ghost:
        total = delta.new_zeros(())
        for a, b in layer.pairs:
            outputs = torch.bmm(deltas.transpose(1, 2), layer.outputs(a))
            inputs = torch.bmm(patches.transpose(1, 2), fixed if b is None else layer.patches(b))
            total = total + (outputs * inputs).sum()
        return total
    weight = None
    for a, b in layer.pairs:
        part = layer.per_sample_weights(layer.outputs(a), fixed if b is None else layer.patches(b))  # [B, O, I·k²/G]
        weight = part if weight is None else weight + part
    return (layer.applied(weight, patches) * deltas).sum()


def weight_dot(uses: list[Convolution]) -> torch.Tensor:
    """Σ_j ⟨∇_Wℓ_j, w_j⟩ for one shared weight W (``pair_dot``'s sum) over every use the forward pass made of it. Used
    once, ``pair_dot``. Used several times — a recurrent layer's W_hh at every step, a layer applied twice — the
    sample's gradient is Σ_u wgrad_u(δ_u, x_u) and w_j the sum over every use's pairs: every use's positions are
    positions of one layer, so each side's outputs and patches are concatenated along P (their weight layout is the
    same) and the Gram matrices, or the formed weight, taken once over them all."""
    if len(uses) == 1:
        return pair_dot(uses[0], ghost_cheaper(uses[0]))
    reached = [use for use in uses if use.first is not None]
    pairs = [(use, a, b) for use in reached for a, b in use.pairs]
    if not pairs:
        return torch.zeros(())
    deltas = torch.cat([use.outputs(use.first[0]) for use in reached], 2)  # [B, O, ΣP]
    patches = torch.cat([use.input_patches() for use in reached], 2)  # [B, I·k²/G, ΣP], with pass 1's graph
    outputs = torch.cat([use.outputs(a) for use, a, _ in pairs], 2)  # [B, O, ΣQ]
    inputs = torch.cat([use.input_patches().detach() if b is None else use.patches(b) for use, _, b in pairs], 2)
    layer = uses[0]
    if ghost_cheaper(layer, deltas.shape[2]):
        return (torch.bmm(deltas.transpose(1, 2), outputs) * torch.bmm(patches.transpose(1, 2), inputs)).sum()
    return (layer.applied(layer.per_sample_weights(outputs, inputs), patches) * deltas).sum()
