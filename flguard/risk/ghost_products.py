"""Every sample's K product in one batched pass, each convolution's per-sample weight gradient never formed.

Where the direct path would run one sample at a time (``flguard.risk.direct``: a chunk of one sample, a ResNet-18 on
the CPU), ``GhostKmv`` computes K_iu_i for the whole batch at once:

    K_iu = J_i(J_iᵀu),   J_iᵀu = ∇_θ⟨∇_xℓ_i, u⟩,   J_iw = ∇_x⟨∇_θℓ_i, w⟩,

so K_iu_i = ∇_{x_i} Σ_j ⟨∇_θℓ_j, w_j⟩ at w_j = J_jᵀu_j held constant (the sum separates over samples). Three
reverse passes over the batch:

1. the forward pass and the input gradient ∇_xℓ with its graph — built once per operator and kept, as the cached
   path keeps its pullbacks;
2. ∇_θ⟨∇_xℓ, u⟩ per sample: every parameter other than a convolution's or a fully connected layer's weight enters
   as a per-sample leaf (an expanded [B, …] view of it), so its gradient comes out per sample;
3. ∇_x of Σ_j ⟨∇_θℓ_j, w_j⟩.

A convolution's per-sample weight gradient is a sum over output positions p of δ(p) ⊗ patch(p). Pass 2 leaves
w_j's part at a convolution as pairs (a, b) — w = Σ wgrad(a, b), one pair from the forward convolution, one from its
input gradient recorded as a transposed convolution — and ∇_θℓ_j's part is wgrad(δ, x), so

    ⟨wgrad(δ, x), wgrad(a, b)⟩ = Σ_{p,q} ⟨δ(p), a(q)⟩·⟨patch_x(p), patch_b(q)⟩,

two P×P Gram matrices per sample (P output positions) instead of the O×I·k² weight — the route Opacus' ghost clipping
takes to per-sample gradient norms. Where P·(O + I·k²) ≥ 2·O·I·k² (early layers: large maps, few channels) the
weight is formed instead, by one batched matrix product per pair. A fully connected layer is a 1×1 convolution over
its input's inner positions (``Dense``): on a [B, I] input two dot products per pair. The batch's own layers (the
forward pass, the input gradients) run batched with the shared weight, at about twice the speed of one-sample
convolutions on a CPU. Measured on ResNet-18-GN at B = 8, one CPU thread (docs/results.md, "Ghost K products"): the K
product 0.48× the one-at-a-time loop's, to 1.5e-6; with ``products="ghost"`` (``flguard.risk.direct``) it also serves
batches the cached pullbacks would hold ("Ghost products on small models").

Supported: trainable parameters in ``nn.Conv2d`` and ``nn.Conv1d`` (numeric padding, any groups — a grouped or
depthwise convolution always forms its per-sample weight, G times smaller than an ungrouped one's; a padding mode's
``F.pad`` runs before the convolution), ``nn.GroupNorm``, ``nn.LayerNorm``, ``nn.Linear``, attention's projections
(self-attention's packed one; in cross-attention the packed one applied to each input, three uses, or q's, k's and
v's weights of their own), the recurrent layers and cells — a weight used several times (a recurrent weight at each
step, a layer applied twice) taken as one layer whose positions are all its uses' (``weight_dot``) — and parameters
that enter an elementwise product or sum beside the activations, broadcast over the batch (a layer scale, an added
position embedding: ``flguard.risk.ghost_forward``). A model with any other parameterised PyTorch layer, or a forward
pass that hands a parameter to any other function (checked on every call of the pass that builds the graph, and on one
sample first, where a tensor whose first dimension is not the samples' no longer has the batch's rows), raises
``Unsupported``, and the operator keeps the one-at-a-time products.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.func import vmap

from flguard.risk.dropout_draws import sample_rows
from flguard.risk.functional import functional_forward
from flguard.risk.ghost_convolutions import Convolution, Patched, weight_dot
from flguard.risk.ghost_forward import PerSampleParameters, Unsupported, ghost_support

#: The graphs are kept for the step while the whole batch's take at most RETAINED_BYTES (pass 1's saved tensors,
#: measured on one sample first: a ResNet-18-GN at 32×32 keeps 17 MB a sample, so B = 8 is kept as one graph), else
#: built again at each product in chunks of at most CHUNK_BYTES. Measured on ResNet-18-GN at B = 32 (one guarded
#: step, ``bench_guard_memory.py``): kept, in chunks of 15, the step peaked at 3.36× training's RSS; rebuilt in chunks
#: of at most 7, 2.72× (issue 22's bound: 3×).
RETAINED_BYTES = 2 ** 28
CHUNK_BYTES = 2 ** 27
#: On a CUDA device the graphs are also kept while the whole batch's fit in this share of the device's free memory
#: at the product's creation, and rebuilt in chunks of at most half that where they do not: a GPU wants few, large
#: kernels (a chunk is one more launch-bound pass), and its memory, not the host's RSS, is the limit — as the cached
#: pullbacks' ``flguard.risk.sizing.CUDA_CACHED_SHARE``. A ResNet-18-GN at 32×32 keeps 17 MB a sample: B = 32 in
#: 0.55 GB, kept on any card with 2.2 GB free (on the CPU, rebuilt in chunks of 7).
CUDA_RETAINED_SHARE = 0.25
#: ``GhostKmv.overhead_rows``' unit: a parameter tensor's share of a product's fixed cost, as the bytes per sample whose
#: rows cost as much. Measured on the quickstart CNN at one CPU thread: a K product 7.2 ms on one row and 0.52 ms a row
#: more, its graphs' build 6 ms plus 0.17 a row, 10 parameter tensors and 54 kB per sample.
FIXED_BYTES_PER_PARAMETER = 2 ** 16
@dataclass(eq=False)
class _Graph:
    """Pass 1 on some rows of the batch: the input leaf, its gradient with the graph, the per-sample leaves with
    their gradients, and the convolutions."""
    x: torch.Tensor
    input_grad: torch.Tensor
    names: list[str]
    leaves: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    layers: list[Convolution]
    collecting: list

    @property
    def weights(self) -> list[list[Convolution]]:
        """The layers grouped by their shared weight: each weight's uses, in the forward pass's order."""
        uses: dict[str, list[Convolution]] = {}
        for layer in self.layers:
            uses.setdefault(layer.name, []).append(layer)
        return list(uses.values())


class GhostKmv:
    """Unscaled K_iu_i = J̃_i(J̃_iᵀu_i) for every sample (module doc), u [B, k, dx] → [B, k, dx]; ``loss_fn`` one
    sample's loss (z [1, …], y [1, …]); ``draws`` the train-mode dropouts' multipliers to replay (batch first).
    Raises ``Unsupported`` on creation where the forward pass uses a parameter otherwise than the rewritten layers do
    (checked on one sample unless ``measured`` is given)."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, measured: tuple[int, int | None] | None = None,
                 draws: tuple[torch.Tensor, ...] = (), unformed_bytes: int = 0) -> None:
        reason = ghost_support(model)
        if reason is not None:
            raise Unsupported(reason)
        self.model, self.params, self.buffers, self.loss_fn = model, params, buffers, loss_fn
        self.x, self.y = x, y
        self.draws = tuple(draws)  # the train-mode dropouts' multipliers, batch first (``flguard.risk.dropout_draws``)
        #: the weights that stay shared (never expanded per sample), by parameter name, True for a fully connected
        #: layer's: convolutions', fully connected layers' and attention's input projections
        self.shared_weights = shared_weights(model)
        #: pass 1's bytes per sample and, of them, the ``Patched`` layers' patches: ``measured`` where a GhostKmv of
        #: the same model and input shape measured them (and checked its forward pass: a restricted copy's), else
        #: measured on one sample here — or at an earlier step (``_MEASURED``) where the batch's graphs are then kept:
        #: building them checks the pass as well. (The patch bytes, where not known, are set by the first build.)
        batch = int(x.shape[0])
        key = _measure_key(model, params, x)
        retained_bytes, chunk_bytes = graph_bytes(x.device)
        if measured is None:
            earlier = _MEASURED.get(model, {}).get(key)
            fits = earlier is not None and batch * earlier[0] <= retained_bytes + unformed_bytes
            measured = earlier if fits else None
        self.patch_bytes: int | None = None if measured is None else measured[1]
        self.sample_bytes = measured[0] if measured is not None else max(self._measure(), 1)
        self.retained = batch * self.sample_bytes <= retained_bytes + unformed_bytes
        #: kept only in the room of the per-sample gradients, which are then never formed (``unformed_bytes``: the
        #: [B, dθ] matrix's size, where the operator's caller reads them through ``flguard.risk.sample_gradients``)
        self.unformed_gradients = self.retained and batch * self.sample_bytes > retained_bytes
        most = batch if self.retained else max(1, chunk_bytes // self.sample_bytes)
        self.chunk = -(-batch // -(-batch // most))  # the fewest chunks of at most ``most`` samples, evened out
        self.graphs = [self._build(start) for start in range(0, batch, self.chunk)] if self.retained else None
        _MEASURED.setdefault(model, {})[key] = self.measured  # (with the patch bytes, where a build took them)

    @property
    def measured(self) -> tuple[int, int | None]:
        """(pass 1's bytes per sample, its patches' bytes): what a GhostKmv of the same model and input shape takes
        as ``measured`` instead of measuring again."""
        return self.sample_bytes, self.patch_bytes

    @property
    def overhead_rows(self) -> float:
        """A product's cost that does not grow with its rows, in rows' worth: FIXED_BYTES_PER_PARAMETER per parameter
        tensor (each a layer's or a per-sample leaf's nodes in the passes) over pass 1's bytes per sample (what a row
        adds) less its ``Patched`` layers' patches (k² copies of their inputs, taken once a build; counted in the
        memory, not as a row's work). The quickstart CNN about 14 rows, ResNet-8-GN 3, ResNet-20-GN 0.8, ResNet-18-GN
        0.2."""
        return FIXED_BYTES_PER_PARAMETER * len(self.params) / max(self.sample_bytes - (self.patch_bytes or 0), 1)

    def _measure(self) -> int:
        """Bytes that pass 1 keeps for one sample: its saved tensors, each view counted once by its own extent (not
        its storage's: a batch sliced from a whole dataset shares the dataset's storage)."""
        storages: dict[tuple, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[(t.data_ptr(), tuple(t.shape), tuple(t.stride()))] = t.numel() * t.element_size()
            return t
        with saved_tensors_hooks(pack, lambda t: t):
            self._build(0, 1)
        return sum(storages.values())

    def _build(self, start: int, size: int | None = None) -> _Graph:
        stop = min(start + (size or self.chunk), self.x.shape[0])
        rows = stop - start
        weights, dense, per_sample, values = {}, set(), {}, {}
        for name, p in self.params.items():
            if name in self.shared_weights:
                values[name] = p
                weights[id(p)] = name
                if self.shared_weights[name]:
                    dense.add(id(p))
            else:
                values[name] = p.expand(rows, *p.shape).requires_grad_(True)
                per_sample[id(values[name])] = name
        x = self.x[start:stop].detach().requires_grad_(True)
        mode = PerSampleParameters(rows, weights, dense, per_sample, x)
        draws = sample_rows(self.draws, slice(start, stop))  # the dropouts replay the rows' own multipliers
        with mode:
            logits = functional_forward(self.model, (values, self.buffers), x, draws)
        loss = _summed_losses(self.loss_fn, logits, self.y[start:stop])
        names = [n for n in self.params if id(values[n]) in per_sample]
        leaves = [values[n] for n in names]
        # every layer's token too: a layer whose input the batch does not reach (a recurrent weight on the zero initial
        # state, a projection of a constant) would otherwise be pruned from pass 1, its (δ, x) never recorded
        tokens = [layer.token for layer in mode.layers]
        input_grad, *grads = torch.autograd.grad(loss, [x] + leaves + tokens, create_graph=True, allow_unused=True)
        if self.patch_bytes is None:
            self.patch_bytes = sum(layer.first[1][0].numel() * layer.first[1].element_size() for layer in mode.layers
                                   if isinstance(layer, Patched) and layer.first is not None)
        return _Graph(x, input_grad, names, leaves, grads[:len(leaves)], mode.layers, mode.collecting)

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(u)
        for start, graph in self._graphs():
            stop, vectors = start + graph.x.shape[0], u.shape[1]
            for k in range(vectors):  # a rebuilt graph is freed by its last vector's pass 3
                out[start:stop, k] = self._product(graph, u[start:stop, k], self.retained or k + 1 < vectors)
        return out

    def gradient_images(self) -> torch.Tensor:
        """J̃_ig̃_i [B, dx], each sample's unscaled Jacobian on its own unscaled gradient (the clipping's rank-one
        correction, ``flguard.risk.clipped``): pass 3 alone, with pass 1's own (δ, x) as every convolution's pair."""
        out = self.x.new_empty(self.x.shape[0], self.x[0].numel())
        for start, graph in self._graphs():
            total = _leaf_dot(graph.grads, [None if g is None else g.detach() for g in graph.grads])
            for uses in graph.weights:
                for layer in uses:
                    layer.pairs = [] if layer.first is None else [(layer.first[0].detach(), None)]
                if any(layer.pairs for layer in uses):
                    total = total + weight_dot(uses)
                for layer in uses:
                    layer.pairs = []
            out[start:start + graph.x.shape[0]] = self._input_gradient(graph, total, self.retained)
        return out

    def shared_j(self, v: torch.Tensor) -> torch.Tensor:
        """J̃_iv [B, dx] for one v [dθ] (flat, in ``params`` order) shared by every sample, such as the noise: pass 3
        alone, each convolution's term ⟨δ, conv(x, V)⟩ a batched convolution with the shared weight V."""
        parts = dict(zip(self.params, v.split([p.numel() for p in self.params.values()])))
        out = self.x.new_empty(self.x.shape[0], self.x[0].numel())
        for start, graph in self._graphs():
            total = _leaf_dot(graph.grads, [parts[n].reshape(self.params[n].shape) for n in graph.names])
            for layer in graph.layers:
                if layer.first is not None:
                    delta, x = layer.first
                    total = total + (layer.convolve(x, parts[layer.name].reshape(layer.weight.shape)) * delta).sum()
            out[start:start + graph.x.shape[0]] = self._input_gradient(graph, total, self.retained)
        return out

    def sample_gradients(self) -> torch.Tensor:
        """The unscaled per-sample gradients ∇_θℓ_i [B, dθ] (flat, in ``params`` order) from pass 1: the per-sample
        leaves' gradients as they are, each convolution's weight gradient per sample as one batched matrix product of
        its (δ, patches(x)) — the clipping's norms and directions, with no one-sample backward pass."""
        out = self.x.new_zeros(self.x.shape[0], sum(p.numel() for p in self.params.values()))
        columns, at = {}, 0
        for name, p in self.params.items():
            columns[name], at = slice(at, at + p.numel()), at + p.numel()
        for start, graph in self._graphs():
            rows = out[start:start + graph.x.shape[0]]
            for name, g in zip(graph.names, graph.grads):
                if g is not None:  # (a parameter the loss does not reach keeps its zeros)
                    rows[:, columns[name]] = g.detach().reshape(rows.shape[0], -1)
            for layer in graph.layers:
                if layer.first is not None:  # summed over its uses
                    rows[:, columns[layer.name]] += self.sample_weight(layer).reshape(rows.shape[0], -1)
        return out

    @staticmethod
    def sample_weight(layer: Convolution) -> torch.Tensor:
        """One use's per-sample weight gradients wgrad(δ_i, x_i) [rows, …] from pass 1's (δ, x): by grouped
        convolutions or by patches (``Convolution.folds_batch``)."""
        delta, x = (t.detach() for t in layer.first)
        return (layer.sample_weights(delta, x) if layer.folds_batch() else
                layer.per_sample_weights(layer.outputs(delta), layer.patches(x)))

    def transposed_sum(self, u: torch.Tensor) -> torch.Tensor:
        """Σ_iJ̃_iᵀu_i [dθ] (flat, in ``params`` order) for u [B, dx]: pass 2 alone, each per-sample leaf's gradient
        summed over the rows and each convolution's weight gradient Σ_pairs wgrad(a, b) a batched weight gradient of
        the shared weight — resolvent noise's summed Jᵀ product, with no per-sample vector in parameter space."""
        total = {n: torch.zeros_like(p) for n, p in self.params.items()}
        for start, graph in self._graphs():
            rows = graph.x.shape[0]
            grads = self._transposed(graph, u[start:start + rows], self.retained)
            for name, g in zip(graph.names, grads):
                if g is not None:
                    total[name] += g.sum(0)
            for layer in graph.layers:
                for a, b in layer.pairs:  # (a 1-D convolution's 2-D view of its weight: the same numbers)
                    part = layer.weight_gradient(a, layer.first[1].detach() if b is None else b)
                    total[layer.name] += part.reshape(total[layer.name].shape)
                layer.pairs = []
        return torch.cat([t.reshape(-1) for t in total.values()])

    def _graphs(self):
        """(first row, graph) for each chunk: the kept graphs, or each built afresh."""
        for start in range(0, self.x.shape[0], self.chunk):
            yield start, (self.graphs[start // self.chunk] if self.retained else self._build(start))

    def _product(self, graph: _Graph, u: torch.Tensor, keep: bool) -> torch.Tensor:
        """Passes 2 and 3 on one graph: K_iu_i [rows, dx] for u [rows, dx]; ``keep``: the graph for another product."""
        grads = self._transposed(graph, u, True)
        total = _leaf_dot(graph.grads, grads)
        for uses in graph.weights:
            if any(layer.pairs and layer.first is not None for layer in uses):
                total = total + weight_dot(uses)
            for layer in uses:
                layer.pairs = []
        return self._input_gradient(graph, total, keep).reshape(u.shape)

    @staticmethod
    def _transposed(graph: _Graph, u: torch.Tensor, keep: bool) -> tuple:
        """Pass 2 on one graph for u [rows, dx]: the per-sample leaves' gradients of ⟨∇_xℓ, u⟩ (None where a leaf
        has none), each convolution's pairs left in its ``pairs``; ``keep``: the graph for another pass."""
        for layer in graph.layers:
            layer.pairs = []
        graph.collecting[0] = True
        try:
            tokens = [layer.token for layer in graph.layers]
            dot = (graph.input_grad * u.reshape(graph.input_grad.shape)).sum()
            grads = torch.autograd.grad(dot, graph.leaves + tokens, retain_graph=keep, allow_unused=True)
        finally:
            graph.collecting[0] = False
        return grads[:len(graph.leaves)]

    @staticmethod
    def _input_gradient(graph: _Graph, total: torch.Tensor, keep: bool) -> torch.Tensor:
        """Pass 3: ∇_x of ``total`` [rows, dx] (zeros where it does not depend on x)."""
        if not total.requires_grad:
            return graph.x.new_zeros(graph.x.shape[0], graph.x[0].numel())
        (result,) = torch.autograd.grad(total, graph.x, retain_graph=keep, allow_unused=True, materialize_grads=True)
        return result.reshape(graph.x.shape[0], -1)


def graph_bytes(device: torch.device) -> tuple[int, int]:
    """(bytes the batch's graphs may take and still be kept for the step, bytes of a chunk rebuilt at each product):
    ``RETAINED_BYTES`` and ``CHUNK_BYTES``, on a CUDA device at least ``CUDA_RETAINED_SHARE`` of its free memory and
    half that."""
    retained, chunk = RETAINED_BYTES, CHUNK_BYTES
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        share = int(CUDA_RETAINED_SHARE * free)
        retained, chunk = max(retained, share), max(chunk, share // 2)
    return retained, chunk


def shared_weights(model: nn.Module) -> dict[str, bool]:
    """The parameters the batched product keeps shared, by name: each ``nn.Conv1d``'s and ``nn.Conv2d``'s weight
    (False: a 1-D convolution runs as a 2-D one a row high), each ``nn.Linear``'s, each ``nn.MultiheadAttention``'s
    input projections (packed, or q's, k's and v's) and a recurrent layer's or cell's weights — input, recurrent and
    projection, each layer and direction (True: fully connected)."""
    shared = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Linear)):
            shared[prefix + "weight"] = isinstance(module, nn.Linear)
        elif isinstance(module, nn.MultiheadAttention):  # the packed projection, or q's, k's and v's of their own
            names = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
            shared.update({prefix + name: True for name in names if getattr(module, name) is not None})
        elif isinstance(module, nn.RNNBase):
            shared.update({prefix + name: True for name in module._flat_weights_names if name.startswith("weight")})
        elif isinstance(module, nn.RNNCellBase):
            shared.update({prefix + "weight_ih": True, prefix + "weight_hh": True})
    return shared


#: pass 1's bytes per sample and patch bytes (``GhostKmv.measured``) by model and ``_measure_key``: a guard builds a new
#: operator at every step, on the same model and input shape (measuring cost about 1.5% of the quickstart CNN's step)
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _measure_key(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple:
    """What pass 1's bytes per sample depend on besides the model: the sample's shape, type and device, the trainable
    parameters and their shapes, and train or eval mode."""
    shapes = tuple((name, tuple(p.shape)) for name, p in params.items())
    return tuple(x.shape[1:]), x.dtype, x.device, model.training, shapes


def _leaf_dot(grads: list[torch.Tensor | None], vectors: list[torch.Tensor | None]) -> torch.Tensor:
    """Σ ⟨g, w⟩ over the per-sample leaves' pass-1 gradients g (with their graphs) and w (per sample, or shared and
    broadcast over the rows), skipping a leaf without either."""
    total = None
    for g, w in zip(grads, vectors):
        if g is not None and w is not None:
            term = (g * w).sum()
            total = term if total is None else total + term
    return total if total is not None else torch.zeros(())


def _summed_losses(loss_fn: Callable, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_i loss_fn(sample i) [scalar], one sample's loss taking [1, …] slices: ``vmap``-ed over the rows (one batched
    op per step of the loss, in the graph and its derivatives, instead of B of each), or one call per row where the
    loss does not ``vmap``."""
    try:
        return vmap(lambda z, t: loss_fn(z.unsqueeze(0), t.unsqueeze(0)))(logits, y).sum()
    except Exception:  # noqa: BLE001 — a loss written for plain tensors (``.item()``, data-dependent control flow)
        return sum(loss_fn(logits[i:i + 1], y[i:i + 1]) for i in range(logits.shape[0]))
