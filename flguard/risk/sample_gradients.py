"""The batch's unscaled per-sample gradients g_i = ∇_θℓ_i as the guard uses them: their norms, their dot products with
one vector, their weighted sums — held as the [B, dθ] matrix (``SampleGradients``), or never formed
(``GhostSampleGradients``), each taken from the batched ghost products' graphs.

Why both: on the guard's path a large model's per-sample gradients are only ever read through those three operations
(the clip level and clipping factors, the clipped upload Σ_i s_ig_i, the left-out samples' sum, the noise's ⟨g_i, v⟩
and the summed Jᵀ product's correction). On ResNet-18-GN at B = 32 the matrix takes 1.4 GB, and with it in memory
the step's graphs did not fit issue 22's bound of 3× training's RSS: they were rebuilt at every product, a fifth of
the step. Without it the graphs are kept (``flguard.risk.ghost_products.GhostKmv``'s ``unformed_gradients``) and
each operation is one pass over them: a norm forms one layer's per-sample weight gradient at a time, a dot product
is one batched convolution with the shared vector, a weighted sum one batched weight gradient
(docs/results.md, "Per-sample gradients never formed").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from flguard.risk.precision import on_exact_float32

if TYPE_CHECKING:
    from flguard.risk.ghost_products import GhostKmv

#: ``SampleGradients.along_sum``: parameters per float64 block (B × this × 8 bytes: 64 MB at B = 32).
ALONG_COLUMNS = 2 ** 18


class SampleGradients:
    """g_i held as the [B, dθ] matrix ``matrix``: each operation a matrix product (``dense`` is the matrix)."""

    def __init__(self, matrix: torch.Tensor) -> None:
        self.matrix = matrix
        self._norms: torch.Tensor | None = None
        self._total: torch.Tensor | None = None

    def norms(self) -> torch.Tensor:
        """‖g_i‖ [B] (taken once)."""
        if self._norms is None:
            self._norms = self._take_norms()
        return self._norms

    def _take_norms(self) -> torch.Tensor:
        return self.matrix.norm(dim=1)

    def dots(self, v: torch.Tensor) -> torch.Tensor:
        """⟨g_i, v⟩ [B] for one v [dθ]."""
        return self.matrix @ v

    def weighted(self, w: torch.Tensor) -> torch.Tensor:
        """Σ_i w_ig_i [dθ] for weights w [B]: never a scaled [B, dθ] copy."""
        return w.to(self.matrix) @ self.matrix

    def total(self) -> torch.Tensor:
        """Σ_ig_i [dθ] (taken once: the engine's check of the gradient given and the clipping read it)."""
        if self._total is None:
            self._total = self._take_total()
        return self._total

    def _take_total(self) -> torch.Tensor:
        return self.matrix.sum(0)

    def along_sum(self) -> torch.Tensor:
        """a_i = ⟨g_i, Σ_jg_j⟩ [B] in float64 (``flguard.guard.clipping.retained_clip_level``), in blocks of columns
        without a float64 copy of the matrix."""
        along = torch.zeros(self.matrix.shape[0], dtype=torch.float64, device=self.matrix.device)
        for block in self.matrix.split(ALONG_COLUMNS, dim=1):
            block = block.double()
            along += block @ block.sum(dim=0)
        return along

    def dense(self) -> torch.Tensor:
        """The [B, dθ] matrix (a product that projects each sample's vector on its own gradient needs it)."""
        return self.matrix


class GhostSampleGradients(SampleGradients):
    """g_i never formed: each operation one pass over the graphs of ``ghost`` (a ``GhostKmv`` of the batch), whose
    pass 1 left each per-sample leaf's gradient and each shared weight's (δ, x) per use. ``form``: the [B, dθ] matrix
    where a caller needs it after all (``dense``: the operator's ``per_sample_gradients``)."""

    def __init__(self, ghost: GhostKmv, form: Callable[[], torch.Tensor]) -> None:
        self.ghost, self.form = ghost, form
        self._norms = self._total = None

    @property
    def device(self) -> torch.device:
        return self.ghost.x.device

    @on_exact_float32
    def _take_norms(self) -> torch.Tensor:
        """Σ over the leaves of ‖∇ℓ_i‖² and over the shared weights of ‖Σ_uses wgrad(δ_i, x_i)‖², one weight's
        per-sample gradient formed at a time."""
        out = self.ghost.x.new_zeros(self.ghost.x.shape[0])
        for start, graph in self.ghost._graphs():
            rows = graph.x.shape[0]
            part = out[start:start + rows]
            for g in graph.grads:
                if g is not None:
                    part += g.detach().reshape(rows, -1).square().sum(1)
            for uses in graph.weights:
                weight = None
                for layer in uses:
                    if layer.first is not None:
                        one = self.ghost.sample_weight(layer).reshape(rows, -1)
                        weight = one if weight is None else weight + one
                if weight is not None:
                    part += weight.square().sum(1)
        return out.sqrt()

    @on_exact_float32
    def dots(self, v: torch.Tensor) -> torch.Tensor:
        """Each leaf's ⟨∇ℓ_i, v⟩ and each use's ⟨δ_i, conv(x_i, V)⟩ — one batched convolution with the shared V."""
        ghost = self.ghost
        parts = dict(zip(ghost.params, v.split([p.numel() for p in ghost.params.values()])))
        out = ghost.x.new_zeros(ghost.x.shape[0])
        for start, graph in ghost._graphs():
            rows = graph.x.shape[0]
            part = out[start:start + rows]
            for name, g in zip(graph.names, graph.grads):
                if g is not None:
                    part += (g.detach() * parts[name].reshape(g.shape[1:])).reshape(rows, -1).sum(1)
            for layer in graph.layers:
                if layer.first is not None:
                    delta, x = (t.detach() for t in layer.first)
                    image = layer.convolve(x, parts[layer.name].reshape(layer.weight.shape))
                    part += (image * delta).reshape(rows, -1).sum(1)
        return out

    @on_exact_float32
    def weighted(self, w: torch.Tensor) -> torch.Tensor:
        """Each leaf's Σ_iw_i∇ℓ_i and each use's wgrad(w∘δ, x): one batched weight gradient of the shared weight."""
        ghost = self.ghost
        total = {n: torch.zeros_like(p) for n, p in ghost.params.items()}
        w = w.to(ghost.x)
        for start, graph in ghost._graphs():
            rows = graph.x.shape[0]
            own = w[start:start + rows]
            for name, g in zip(graph.names, graph.grads):
                if g is not None:
                    total[name] += (own.view(-1, *[1] * (g.dim() - 1)) * g.detach()).sum(0)
            for layer in graph.layers:
                if layer.first is not None:
                    delta, x = (t.detach() for t in layer.first)
                    part = layer.weight_gradient(own.view(-1, *[1] * (delta.dim() - 1)) * delta, x)
                    total[layer.name] += part.reshape(total[layer.name].shape)
        return torch.cat([t.reshape(-1) for t in total.values()])

    def _take_total(self) -> torch.Tensor:
        return self.weighted(torch.ones(self.ghost.x.shape[0]))

    def along_sum(self) -> torch.Tensor:
        return self.dots(self.total()).double()

    def dense(self) -> torch.Tensor:
        return self.form()
