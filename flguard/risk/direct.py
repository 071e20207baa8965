"""The operator's direct path: each per-sample product computed afresh, nothing kept between products.

``JacobianOperator`` (``flguard.risk.operator``) takes this path where the cached pullbacks would not fit
(``flguard.risk.sizing``): J_iᵀu reverse-over-reverse, J_iv reverse-of-forward (with what a wrapper applies to v
first: the clipping's projection), the K product fused per sample, ``vmap``-ed over chunks of
``sample_chunk`` samples — or, where a chunk is one sample (a ResNet-18 on the CPU), one sample at a time with plain
autograd (``flguard.risk.sample_autograd``), except the K product (what the solvers run), the clipping's gradient
images and J of the shared noise, which take one batched pass with ghost per-sample weight gradients over graphs kept
for the step (``flguard.risk.ghost_products``) where the model's layers allow it. The path is per-sample only: an
operator on it has no train-mode BatchNorm (that couples the batch), so nothing here switches running statistics off.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.func import grad, jvp, vmap

from flguard.risk.dropout_draws import sample_rows
from flguard.risk.ghost_forward import Unsupported, ghost_support
from flguard.risk.ghost_products import GhostKmv
from flguard.risk.precision import on_exact_float32
from flguard.risk.sample_autograd import flatten_into
from flguard.risk.sample_gradients import GhostSampleGradients, SampleGradients


#: Where a chunk is one sample, multiply one sample at a time with plain autograd (``sample_autograd``) rather than
#: through ``vmap`` over chunks of one. False: ``vmap``, as before (``benchmarks/bench_sample_autograd.py`` compares
#: the two in one process).
ONE_AT_A_TIME = True
#: Where the direct path goes one sample at a time, run the K product for the whole batch in one batched pass with
#: each convolution's per-sample weight gradient never formed (``flguard.risk.ghost_products``), where the model's
#: layers allow it; False: the loop, as before.
GHOST_KMV = True
#: Where a batch too large for the cached pullbacks takes the ghost products, keep their graphs for the step also where
#: they fit only in the room of the [B, dθ] per-sample gradients, which the guard then never forms: it reads them
#: through ``flguard.risk.sample_gradients.GhostSampleGradients`` (``sample_gradient_set``). Measured on a trained
#: ResNet-18-GN at B = 32, one CPU thread (docs/results.md, "Per-sample gradients never formed"). False: the graphs
#: rebuilt in chunks at each product there, the matrix formed, as before.
UNFORMED_GRADIENTS = True


class DirectProducts:
    """``JacobianOperator``'s direct-path products (a mixin: it reads the operator's batch, parameters, forward
    pass, scale, chunk sizes and product count)."""

    @property
    def one_at_a_time(self) -> bool:
        """Whether the direct path multiplies one sample at a time (a chunk of one sample: a ResNet-18 on the CPU),
        with plain autograd instead of ``vmap`` (``flguard.risk.sample_autograd``: a fifth less time there)."""
        return ONE_AT_A_TIME and self.direct and self.sample_chunk == 1

    def _jt_one(self, xi: torch.Tensor, yi: torch.Tensor, di: tuple[torch.Tensor, ...],
                ui: torch.Tensor) -> torch.Tensor:
        """Unscaled J̃_iᵀu [dθ] of one sample, reverse-over-reverse: ∇_θ ⟨∇_x ℓ(x_i), u⟩ — the derivative of
        ∇_θ ℓ(x_i + t·u) at t = 0, by the symmetry of ℓ's mixed second derivatives. Measured against
        forward-over-reverse (one CPU thread, × a training step): quickstart CNN B = 32 3.7× vs 6.1×,
        ResNet-20-GN B = 8 4.8× vs 5.4×, ResNet-18-GN B = 8 7.4× vs 9.6× (``j``: 3.7×, 4.8×, 3.5×).
        One sample at a time (``one_at_a_time``) the same product with plain autograd, one tensor per parameter
        (the K product hands them to ``_j_one`` as they are; ``_per_sample_products`` flattens them into its result)."""
        if self.one_at_a_time:
            return self._autograd.jt(xi, yi, di, ui)
        direction = ui.reshape(xi.shape)

        def input_dot(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return (grad(lambda z: self._one_loss(params, z, yi, di))(xi) * direction).sum()
        return self._flat(grad(input_dot)(self.params))

    def _j_one(self, xi: torch.Tensor, yi: torch.Tensor, di: tuple[torch.Tensor, ...], v: torch.Tensor) -> torch.Tensor:
        """Unscaled J̃_i v [dx] of one sample, reverse-of-forward: ∇_x of ℓ's derivative along θ + s·v at s = 0
        (one sample at a time, ``one_at_a_time``, with plain autograd)."""
        if self.one_at_a_time:
            return self._autograd.j(xi, yi, di, v)
        tangent, offset = {}, 0
        for name, p in self.params.items():
            tangent[name] = v[offset:offset + p.numel()].reshape(p.shape)
            offset += p.numel()

        def along(z: torch.Tensor) -> torch.Tensor:
            return jvp(lambda params: self._one_loss(params, z, yi, di), (self.params,), (tangent,))[1]
        return grad(along)(xi).reshape(-1)

    def _per_sample_products(self, one: Callable, vectors: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """``one(x_i, y_i, d_i, w, *extra_i)`` (d_i: the sample's dropout multipliers) for every sample i and each of
        its k vectors w, [B, k, ·]: vmap
        over samples in chunks (``sample_chunk``, divided by k) and, for k > 1, over the vectors.
        ``extra``: per-sample tensors [B, …] handed to ``one`` beside the vector."""
        k = vectors.shape[1]
        chunk = max(1, self.sample_chunk // k)
        if self.one_at_a_time:  # a Python loop: ``one`` takes plain autograd's forms (``_jt_one``, ``_j_one``)
            return self._looped(one, vectors, extra)
        if k == 1:
            return vmap(one, chunk_size=chunk)(self.x, self.y, self.draws, vectors[:, 0], *extra).unsqueeze(1)
        each = lambda xi, yi, di, w, *e: vmap(lambda wj: one(xi, yi, di, wj, *e),  # noqa: E731
                                              chunk_size=self.chunk_size)(w)
        return vmap(each, chunk_size=chunk)(self.x, self.y, self.draws, vectors, *extra)

    def _looped(self, one: Callable, vectors: torch.Tensor, extra: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``_per_sample_products`` one sample and one vector at a time, written into one [B, k, ·] result (no
        stacked copy: a ResNet-18's J_iᵀu at B = 32 is 1.4 GB)."""
        out = None
        for i in range(vectors.shape[0]):
            for j in range(vectors.shape[1]):
                row = one(self.x[i], self.y[i], sample_rows(self.draws, i), vectors[i, j], *(e[i] for e in extra))
                if out is None:
                    size = row.numel() if isinstance(row, torch.Tensor) else sum(t.numel() for t in row)
                    out = vectors.new_empty(vectors.shape[0], vectors.shape[1], size)
                flatten_into(row, out[i, j])
        return out

    @on_exact_float32
    def direct_j(self, v: torch.Tensor, before: Callable, extra: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """J_i(before(v_i, *extra_i)) per sample on the direct path, ``before`` applied inside the vmapped
        call: a shared v (an expanded view, as for the noise) is never copied B times by a wrapper's
        projection. One application."""
        batch, k = self._check(v, self.dtheta)
        self._charge(batch, k)

        def one(xi: torch.Tensor, yi: torch.Tensor, di: tuple, vi: torch.Tensor, *e: torch.Tensor) -> torch.Tensor:
            return self._j_one(xi, yi, di, before(vi, *e))
        return self.scale * self._per_sample_products(one, v, *extra)

    @on_exact_float32
    def direct_kmv(self, u: torch.Tensor, charge: bool = True) -> torch.Tensor:
        """K_i u_i sample by sample on the direct path: J̃_i(J̃_iᵀu_i) inside one vmapped call per chunk of samples
        (or one sample at a time, ``one_at_a_time``: then J̃_iᵀu_i reaches J̃_i as one tensor per parameter), so J_iᵀu
        (dθ floats per sample) exists for a chunk at a time, never for the whole batch [B, k, dθ] (1.4 GB per copy
        for ResNet-18 at B = 32). The clipped operator corrects the result in the input space
        (``ClippedJacobian.kmv``), so nothing is applied between the two. Two applications (``charge`` False: counted
        by the caller, the cached K product that ran out of memory)."""
        batch, k = self._check(u, self.dx)
        if charge:
            self._charge(batch, k)
            self._charge(batch, k)
        ghost = self._ghost_kmv()
        if ghost is not None:
            return (self.scale * self.scale) * ghost(u)

        def one(xi: torch.Tensor, yi: torch.Tensor, di: tuple, ui: torch.Tensor) -> torch.Tensor:
            return self._j_one(xi, yi, di, self._jt_one(xi, yi, di, ui))
        return (self.scale * self.scale) * self._per_sample_products(one, u)

    @property
    def ghost_products(self) -> bool:
        """Whether the K product runs batched with ghost per-sample weight gradients (``GHOST_KMV``): one sample at a
        time otherwise, on a model whose layers ``ghost_support`` takes (its dropouts' masks replayed batched)."""
        if not (GHOST_KMV and self.one_at_a_time):
            return False
        if "_ghost_support" not in self.__dict__:  # the model's layers, looked at once
            self._ghost_support = ghost_support(self.model)
        return self._ghost_support is None

    @property
    def ghost_graphs(self) -> bool:
        """Whether the batched products run on the ghost graphs (built here if not yet)."""
        return self._ghost_kmv() is not None

    @property
    def ghost_overhead_rows(self) -> float | None:
        """The batched K product's fixed cost in rows' worth (``GhostKmv.overhead_rows``): what the shrinking products
        weigh a rebuild against; None where the products do not run on the ghost graphs."""
        ghost = self._ghost_kmv() if self.direct else None
        return None if ghost is None else ghost.overhead_rows

    def take_ghost_products(self) -> None:
        """``products="ghost"``: the direct path one sample at a time, so that the K products, the summed Jᵀ, the
        clipping's images and the noise's J run batched on the ghost graphs — built here. On a batch the cached
        pullbacks would hold, only where the graphs are kept for the step (rebuilt at each product, more than
        ``RETAINED_BYTES``, the cached path is faster); on a larger one, kept or rebuilt, instead of the direct path's
        vmapped chunks of samples (measured, one CPU thread, B = 32: EfficientNet-B0's K product 25.1 → 1.77 s, a small
        ViT's 8.5 → 5.0 s). The path as it was where the model's forward pass refuses them. Per-sample J and Jᵀ
        products on distinct vectors (LAVP's, an attack's) then run one sample at a time: the guard's step takes
        none."""
        before = (self.direct, self.sample_chunk)
        if before[0] and UNFORMED_GRADIENTS:  # a batch the cached pullbacks would not hold: graphs in the room of
            self._ghost_unformed_bytes = self.batch_size * self.dtheta * self.x.element_size()  # [B, dθ] (module doc)
        self.direct, self.sample_chunk = True, 1
        try:
            ghost = self._ghost_kmv()
        except Exception:  # noqa: BLE001 — a forward pass the build cannot run (checkpointing's hooks): the cached
            ghost = None   # path's products then meet it as they did, and fail with its own reason
        if ghost is None or not (ghost.retained or before[0]):
            self.direct, self.sample_chunk = before
            self.__dict__.pop("_ghost", None)

    def _ghost_kmv(self) -> GhostKmv | None:
        """The operator's ``GhostKmv``, built at the first K product (None: the loop — where ``ghost_products`` is
        False, or the forward pass handed a parameter to a function it does not rewrite: ``ghost_refused`` says
        which)."""
        if not self.ghost_products or getattr(self, "ghost_refused", None) is not None:
            return None
        if getattr(self, "_ghost", None) is None:
            try:
                # a restricted copy inherits the measure (and the check) of its operator's first GhostKmv
                self._ghost = GhostKmv(self.model, self.params, self.buffers, self.loss_fn, self.x, self.y,
                                       getattr(self, "_ghost_measured", None), self.draws,
                                       getattr(self, "_ghost_unformed_bytes", 0))
            except Unsupported as reason:
                self.ghost_refused = str(reason)
                return None
            self._ghost_measured = self._ghost.measured
        return self._ghost

    def sample_gradient_set(self) -> SampleGradients:
        """The unscaled per-sample gradients as the guard reads them — norms, dot products with one vector, weighted
        sums (``flguard.risk.sample_gradients``) — taken once: never formed where the ghost products' graphs are kept
        in their room (``GhostKmv.unformed_gradients``), else the [B, dθ] matrix of ``per_sample_gradients``."""
        if getattr(self, "_gradient_set", None) is None:
            ghost = self._ghost_kmv() if self.direct else None
            self._gradient_set = (GhostSampleGradients(ghost, self.per_sample_gradients)
                                  if ghost is not None and ghost.unformed_gradients
                                  else SampleGradients(self.per_sample_gradients()))
        return self._gradient_set

    @on_exact_float32
    def gradient_images(self, gradients: torch.Tensor | None = None) -> torch.Tensor:
        """J_ig_i [B, dx]: each sample's block on its own unscaled gradient (the clipping's rank-one correction,
        ``flguard.risk.clipped``), by the batched K product's graphs where it has them, else by a J product on
        ``gradients`` (the unscaled per-sample gradients [B, dθ] where the caller holds them: a restricted copy has
        none of its own) or on its own. One application."""
        ghost = self._ghost_kmv()
        if ghost is None:
            return self.j((self.per_sample_gradients() if gradients is None else gradients).unsqueeze(1))[:, 0]
        self._charge(self.batch_size, 1)
        return self.scale * ghost.gradient_images()

    @on_exact_float32
    def shared_j(self, v: torch.Tensor) -> torch.Tensor | None:
        """J_iv [B, dx] for one v [dθ] shared by every sample (the noise) in one batched pass, where the batched K
        product's graphs serve (``ghost_products``); None elsewhere. One application."""
        ghost = self._ghost_kmv()
        if ghost is None:
            return None
        self._charge(self.batch_size, 1)
        return self.scale * ghost.shared_j(v)

    def _chunked_sample_grads(self) -> torch.Tensor:
        """[B, dθ] filled a chunk of samples at a time: ``vmap(chunk_size=…)`` concatenates its chunks'
        outputs, so its peak is twice the result (measured on ResNet-18-GN at B = 32: 3.6 GB for a 1.4 GB
        result, the peak of the whole clipped guard step's products); this one holds the result and
        one chunk. Where the batched K product's graphs serve (``ghost_products``), from their pass 1."""
        ghost = self._ghost_kmv()  # the batched K product's graphs, built here for the step's products to come
        if ghost is not None:
            return ghost.sample_gradients()
        out = torch.empty(self.batch_size, self.dtheta, dtype=self.dtype, device=self.device)
        if self.one_at_a_time:
            for i, (xi, yi) in enumerate(zip(self.x, self.y)):
                flatten_into(self._autograd.gradient(xi, yi, sample_rows(self.draws, i)), out[i])
            return out
        for start in range(0, self.batch_size, self.sample_chunk):
            stop = min(start + self.sample_chunk, self.batch_size)
            out[start:stop] = vmap(self._sample_grad)(self.x[start:stop], self.y[start:stop],
                                                      sample_rows(self.draws, slice(start, stop))).detach()
        return out
