"""The one operator behind I2F, LAVP and the guard: per-sample blocks of the mixed Jacobian.

For a batch X = (x_1..x_B) with labels Y and the batch loss L(X, θ), sample i's block is

    J_i = ∇_{x_i} ∇_θ L(X, θ)  ∈ R^{dx × dθ}.

``JacobianOperator`` never forms J_i; it applies it matrix-free, batched over samples and over
several vectors per sample:

- ``jt(u)``: J_iᵀ u_i (u_i ∈ R^dx → R^dθ) = ∇_θ ⟨∇_{x_i} L, u_i⟩, reverse-over-reverse through one
  pullback of the per-sample input gradients, built at the first product and reused (the coupled
  path uses forward-over-reverse: the derivative of ∇_θ L along a perturbation of x_i).
- ``j(v)``:  J_i v_i (v_i ∈ R^dθ → R^dx), reverse-over-reverse: ∇_{x_i} ⟨∇_θ L, v_i⟩, through one
  pullback of the gradient map built at the first product and reused by every later one.

Two exact paths:

- **per-sample** (default when possible): the model has no cross-sample coupling and the loss is
  a sum of per-sample terms times a constant (mean or sum reduction). Then
  J_i = c ∇_{x_i}∇_θ ℓ(f(x_i), y_i) and everything is ``vmap``-ed over samples: one batched call
  serves all B samples.
- **coupled** (train-mode BatchNorm, or a loss that does not split per sample): the batch stays
  fixed and products are ``vmap``-ed over tangent directions, each a whole-batch tangent that is
  zero except at sample i. Exact, but B times the work of the per-sample path.

On the per-sample path ``products`` picks how: "cached" pullbacks of the whole batch, "direct" products in chunks of
samples (``flguard.risk.sizing``; a chunk of one sample takes the batched ghost K product where the model allows it,
``flguard.risk.ghost_products``), "auto" the cached path where it fits, and "ghost" the ghost products wherever the
model's forward pass takes them — where the cached path would fit, only if the batch's graphs are kept; where it would
not, kept or rebuilt in chunks instead of the direct path's vmapped chunks — else "auto" (the guard's own operator on a
CPU).

Parameters are the model's trainable parameters in ``model.parameters()`` order, flattened.

Train-mode dropout (``nn.Dropout``, ``nn.Dropout1d/2d/3d``, attention's, ``ReplayedDropPath``) is measured with its
masks held fixed: those of the pass that made the gradient (``draws``), or, without them, those that the operator's
first pass over the batch draws (``drew_masks``); each sample's products replay its own, checked to give its row of
the batch's output (``flguard.risk.dropout_draws``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from typing import Callable, Iterator, Literal

import torch
from torch import nn
from torch.func import grad, jvp, vjp, vmap
import torch.nn.functional as F

from flguard.risk import sizing
from flguard.risk.limits import ProductLimit, ProductLimitReached  # noqa: F401  (re-exported: the operator charges them)
from flguard.risk.precision import exact_float32, on_exact_float32
from flguard.risk.direct import DirectProducts
from flguard.risk.dropout_draws import (DropoutDraws, as_one_sample, check_batch, check_split, probe_shapes,
                                       refuse_unreplayed, sample_rows)
from flguard.risk.functional import functional_forward, uncompiled
from flguard.risk.loss_split import split_loss
from flguard.risk.sample_autograd import SampleAutograd
from flguard.risk.transposed_input_grads import InputOnly, transposed_input_grads
from flguard.risk.unfolded_convs import unfolded_per_sample_convs

#: Build the cached Jᵀ pullback with every 2-D convolution's input gradient recorded as a transposed convolution
#: (``flguard.risk.transposed_input_grads``), as the one-at-a-time path does. Off: measured on an H200 (docs/results.md,
#: "The guard on a GPU, 2026-11-27"), a guarded ResNet-18-GN step at B = 32 took the same time per product
#: (127 against 126 ms) in 2.6 GB less GPU memory (6.8 against 9.4 GB); on the CPU the build took 5–14% longer.
#: An opt-in where a GPU's memory is short.
CACHED_TRANSPOSED_INPUT_GRADS = False

#: The cached J pullback takes its cotangent per parameter where the batch's per-sample gradients hold at most this
#: many floats, so a K product hands it Jᵀ's rows as they come instead of concatenating them into [B, dθ] (the trained
#: quickstart CNN's K product 0.90×, docs/results.md "Fewer passes over parameter space"); the operator then keeps one
#: more [B, dθ] (the gradients per parameter, which the pullback holds, beside their flat copy): 16 MB at this bound.
TREE_ROWS_UP_TO = 2 ** 22

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

def default_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with mean reduction (the FedSGD batch loss)."""
    return F.cross_entropy(logits, labels)


def has_batch_coupling(model: nn.Module) -> bool:
    """True when a module mixes samples in the forward pass (train-mode BatchNorm)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())


@contextlib.contextmanager
def batchnorm_without_running_stats(model: nn.Module) -> Iterator[None]:
    """Train-mode BatchNorm normalises with batch statistics either way; switching off
    ``track_running_stats`` keeps exactly that forward but stops the in-place running-stat
    updates, which cannot happen under ``vmap`` (and must not change the client's model)."""
    touched = [m for m in model.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
    for m in touched:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in touched:
            m.track_running_stats = True


class JacobianOperator(DirectProducts):
    """Matrix-free per-sample blocks J_i of the batch loss's mixed Jacobian (see module doc).

    Vectors are batched as [B, k, dx] for ``jt`` and [B, k, dθ] for ``j``; ``applications``
    counts operator applications per sample (a call on k vectors for each sample counts k; work
    done on a ``restricted`` operator is added by ``RegularisedK``'s solves as its share of B).
    ``limit`` (a ``ProductLimit``, shared with restricted copies) caps the work of one step.
    The operator is a snapshot of (model, batch): its products reuse pullbacks built at the first
    call, so build a new operator after changing the model's parameters (products of an operator
    whose parameters were then modified in place are not defined).
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                 *, coupled: bool | None = None, chunk_size: int | None = None,
                 limit: ProductLimit | None = None, products: Literal["auto", "cached", "direct", "ghost"] = "auto",
                 draws: Sequence[torch.Tensor] | None = None) -> None:
        model = uncompiled(model)  # a torch.compile'd model: its own module, the same parameters
        refuse_unreplayed(model)
        if not x.is_floating_point():
            raise ValueError(f"the model's input is a {x.dtype} tensor (token ids, indices): the guard measures how an "
                             "update moves the reconstruction of continuous inputs (images, features) and cannot "
                             "differentiate with respect to integers — nor does an input-space floor cover what a "
                             "text model's embedding gradient shows by itself (its nonzero rows are the tokens used)")
        self.model = model
        self.loss_fn = loss_fn or default_loss
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not self.names:
            raise ValueError("the model has no trainable parameters: there is no gradient to leak")
        params = dict(model.named_parameters())
        # contiguous: a channels-last model's 4-d weights otherwise send adaptive_avg_pool2d's double
        # backward through an as_strided_ that vmap has no batching rule for (a slow fallback, and a warning)
        self.params = {n: params[n].detach().contiguous() for n in self.names}
        self.buffers = dict(model.named_buffers())
        # contiguous: the same values, but the products never take channels-last kernels — torch 2.14's CPU
        # float32 weight gradient of a strided 1×1 convolution (a ResNet shortcut) is wrong and varies
        # from call to call on channels-last inputs (docs/results.md, "Channels-last on the CPU")
        self.x = x.detach().to(next(iter(self.params.values())).dtype).contiguous()
        self.y = y.detach()
        self.batch_size = int(x.shape[0])
        self.input_shape = tuple(x.shape[1:])
        self.dx = int(self.x[0].numel())
        self.dtheta = sum(p.numel() for p in self.params.values())
        self.chunk_size = chunk_size
        self.limit = limit
        self.applications = 0
        self._cached_pullback: Callable | None = None
        self._cached_transpose: Callable | None = None
        self._tree_pullback = False  # whether the cached J pullback takes per-parameter cotangents (TREE_ROWS_UP_TO)
        # the dropouts' multipliers: replayed as given, or drawn by this first pass (module doc)
        self.draws = tuple(draws) if draws is not None else ()
        recording = DropoutDraws() if draws is None else None
        with torch.no_grad(), batchnorm_without_running_stats(model):
            logits = self._forward(self.params, self.x, recording)
            if recording is not None:
                self.draws = recording.finish()
            if self.draws:  # each mask's batch found from a one-sample pass's shapes (dropout_draws.check_batch)
                one = probe_shapes(lambda mode: self._forward(self.params, self.x[:1], mode))
                self.draws = check_batch(self.draws, self.batch_size, one)
        self.drew_masks = bool(self.draws) and draws is None
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"the model returns a {type(logits).__name__}, not one tensor: the guard measures the part "
                            "of the output the loss takes — wrap the model as flguard.guard.recorder.SelectedOutput("
                            "model, ('logits',)) (the keys or indices to that tensor), or guard the loop with "
                            "make_guarded, which finds it")
        #: L_B(θ), the batch loss at these parameters from this first pass (a restricted copy has none):
        #: ``flguard.guard.damage`` reads it instead of a forward pass of its own
        loss = self.loss_fn(logits, self.y)
        self.batch_loss: float | None = float(loss) if torch.as_tensor(loss).numel() == 1 else None
        split = None if has_batch_coupling(model) else split_loss(self.loss_fn, logits, self.y, self.batch_loss)
        self.coupled = (split is None) if coupled is None else coupled
        if not self.coupled and split is None:
            raise ValueError("coupled=False needs a per-sample-separable loss (mean or sum reduction) "
                             "and a model without train-mode BatchNorm")
        if self.draws and not self.coupled:  # each sample's rows of the masks are its own (dropout_draws)
            with exact_float32(self.device), batchnorm_without_running_stats(model):  # no TF32: both passes exact
                check_split(lambda xi, di: self._forward(self.params, xi.unsqueeze(0), as_one_sample(di))[0],
                            lambda: self._forward(self.params, self.x), self.x, self.draws)
        self.batch_loss_fn = self.loss_fn  # the loss of the whole batch, as given
        if not self.coupled:  # the batch loss = c Σ_i ℓ(sample i): ℓ a weighted mean's summed form (loss_split)
            self.loss_fn = split.per_sample
        # c, and c·B: the clipped update's largest norm per unit C, the noise budget's unit (loss_split)
        self.scale, self.span = (1.0, 1.0) if self.coupled else (split.scale, split.span)
        if products not in ("auto", "cached", "direct", "ghost"):
            raise ValueError(f"products={products!r}: choose 'auto', 'cached', 'direct' or 'ghost'")
        fits = sizing.takes_cached(self.dtheta, self.batch_size, self.device, self.x.element_size())
        self.direct = not self.coupled and (products == "direct" or (products in ("auto", "ghost") and not fits))
        self.sample_chunk = sizing.direct_sample_chunk(self.dtheta, self.batch_size, self.device, self.x.element_size())
        self._autograd = SampleAutograd(model, self.buffers, self.loss_fn, self.params)
        if products == "ghost" and not self.coupled:
            self.take_ghost_products()

    # -- building blocks -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def _forward(self, params: dict[str, torch.Tensor], inputs: torch.Tensor,
                 draws: Sequence[torch.Tensor] | DropoutDraws | None = None) -> torch.Tensor:
        """The model on ``inputs`` (the whole batch, unless ``draws`` are those of the samples it holds)."""
        return functional_forward(self.model, (params, self.buffers), inputs, self.draws if draws is None else draws)

    def _one_loss(self, params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor,
                  di: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """ℓ(f(x_i), y_i) of one sample, with its own dropout multipliers ``di``."""
        return self.loss_fn(self._forward(params, xi.unsqueeze(0), as_one_sample(di)), yi.unsqueeze(0))

    def _flat(self, tree: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tree[n].reshape(-1) for n in self.names])

    def _sample_grad(self, xi: torch.Tensor, yi: torch.Tensor, di: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Unscaled ∇_θ ℓ(f(x_i), y_i), flat [dθ] (per-sample path)."""
        return self._flat(self._sample_grad_tree(xi, yi, di))

    def _sample_grad_tree(self, xi: torch.Tensor, yi: torch.Tensor, di: tuple[torch.Tensor, ...]) -> dict:
        """``_sample_grad`` per parameter: the cached J pullback's map where it takes Jᵀ's rows as they come."""
        return grad(lambda params: self._one_loss(params, xi, yi, di))(self.params)

    def _batch_grad(self, inputs: torch.Tensor) -> torch.Tensor:
        """∇_θ L(X, θ) of the whole batch, flat [dθ] (coupled path)."""
        def batch_loss(params):
            return self.loss_fn(self._forward(params, inputs), self.y)
        return self._flat(grad(batch_loss)(self.params))

    def _vmap(self, fn: Callable, in_dims=0) -> Callable:
        return vmap(fn, in_dims=in_dims, chunk_size=self.chunk_size)

    # -- the two products ------------------------------------------------------------------
    @on_exact_float32
    def jt(self, u: torch.Tensor) -> torch.Tensor:
        """J_iᵀ u_i for every sample: u [B, k, dx] → [B, k, dθ]."""
        batch, k = self._check(u, self.dx)
        self._charge(batch, k)
        with batchnorm_without_running_stats(self.model):
            direct = lambda: self._per_sample_products(self._jt_one, u).mul_(self.scale)  # noqa: E731
            if self.direct:
                return direct()
            if not self.coupled:
                return self._cached_or_direct(lambda: self._cached_jt(u), direct)
            tangents = torch.zeros(batch, k, batch, self.dx, dtype=u.dtype, device=u.device)
            idx = torch.arange(batch, device=u.device)
            tangents[idx, :, idx] = u
            tangents = tangents.reshape(batch * k, *self.x.shape)
            out = self._vmap(lambda t: jvp(self._batch_grad, (self.x,), (t,))[1])(tangents)
            return out.reshape(batch, k, self.dtheta)

    @on_exact_float32
    def jt_sum(self, u: torch.Tensor) -> torch.Tensor:
        """Σ_i J_iᵀu_i, u [B, dx] → [dθ]: the batch's J_iᵀ products summed, as reverse-over-reverse passes
        of the loss — ∇_θ⟨∇_X L(X, θ), U⟩ — with no per-sample vectors in parameter space (the batch's
        [B, dθ] would be 1.4 GB on a ResNet-18 at B = 32). Exact on both paths: d/dt ∇_θL(X + tU) is the
        sum of the samples' blocks. On the direct path the pass runs over ``sample_chunk`` samples at a
        time (their double-backward graph, not the batch's: 3.76 GB at B = 32 on a ResNet-18 in one
        pass), summed — one sample at a time, where the batched K product's graphs serve (``ghost_products``), by
        their pass 2 alone, summed; on the cached path, once a product has built Jᵀ's pullback, through it (0.80× on
        the quickstart CNN at B = 32, 0.70× on ResNet-8-GN: docs/results.md "Fewer passes over parameter space"). One
        application."""
        if u.ndim != 2 or u.shape[0] != self.batch_size or u.shape[1] != self.dx:
            raise ValueError(f"expected vectors of shape [B={self.batch_size}, {self.dx}], got {tuple(u.shape)}")
        self._charge(self.batch_size, 1)
        direction = u.reshape(self.x.shape)

        def loss(params: dict[str, torch.Tensor], z: torch.Tensor, labels: torch.Tensor,
                 draws: tuple[torch.Tensor, ...]) -> torch.Tensor:
            if self.coupled:
                return self.loss_fn(self._forward(params, z, draws), labels)
            # c Σ_i ℓ_i with the operator's own c: a chunk (or a restricted copy) keeps the whole batch's scale
            each = vmap(lambda out, label: self.loss_fn(out.unsqueeze(0), label.unsqueeze(0)))
            return self.scale * each(self._forward(params, z, draws), labels).sum()

        def in_chunks(chunk: int) -> torch.Tensor:
            total = None
            with batchnorm_without_running_stats(self.model):
                for start in range(0, self.batch_size, chunk):
                    x, y, d = (t[start:start + chunk] for t in (self.x, self.y, direction))
                    rows = sample_rows(self.draws, slice(start, start + chunk))

                    def input_dot(params: dict[str, torch.Tensor]) -> torch.Tensor:
                        return (grad(lambda z: loss(params, z, y, rows))(x) * d).sum()  # noqa: B023 (called at once)
                    part = self._flat(grad(input_dot)(self.params))
                    total = part if total is None else total.add_(part)
            return total

        if self.coupled:
            return in_chunks(self.batch_size)
        if self.one_at_a_time:
            ghost = self._ghost_kmv()  # the batched K product's graphs: pass 2 alone, summed (``ghost_products``)
            if ghost is not None:
                return self.scale * ghost.transposed_sum(u)
            with batchnorm_without_running_stats(self.model):
                total = torch.zeros(self.dtheta, dtype=self.dtype, device=self.device)
                for i, (xi, yi, ui) in enumerate(zip(self.x, self.y, direction)):
                    sample = self._autograd.jt(xi, yi, sample_rows(self.draws, i), ui)
                    for part, t in zip(total.split(self._autograd.sizes), sample):
                        part.add_(t.reshape(-1))
                return total.mul_(self.scale)
        if self.direct:
            return in_chunks(self.sample_chunk)
        if self._cached_transpose is not None:  # a K product built Jᵀ's pullback: one more pass through it, summed
            def summed() -> torch.Tensor:
                with batchnorm_without_running_stats(self.model):
                    rows = self._cached_jt(u.unsqueeze(1), flat=False)
                return torch.cat([rows[n].sum(0).reshape(-1) for n in self.names])
            return self._cached_or_direct(summed, lambda: in_chunks(self.sample_chunk))
        return self._cached_or_direct(lambda: in_chunks(self.batch_size), lambda: in_chunks(self.sample_chunk))

    def _transpose_pullback(self) -> Callable:
        """Per-sample path: the vjp of (θ_1..θ_B) ↦ (∇_{x_i} ℓ(f(x_i; θ_i), y_i))_i at θ_i = θ, built
        once. Its pullback of u is (J_iᵀ u_i)_i (mixed partials commute), so every Jᵀ product reuses
        one forward and backward pass (measured: about half the cost of a forward-over-reverse jvp)."""
        if self._cached_transpose is None:
            def input_gradient(params, xi, yi, di):
                return grad(lambda z: self._one_loss(params, z, yi, di))(xi).reshape(-1)
            per_sample = {n: p.unsqueeze(0).expand(self.batch_size, *p.shape) for n, p in self.params.items()}

            input_only = InputOnly()  # the build's inner gradient is to the input only; the pullback's, to both
            rerouted = transposed_input_grads(input_only) if CACHED_TRANSPOSED_INPUT_GRADS else contextlib.nullcontext()
            with rerouted, input_only(), unfolded_per_sample_convs(self.device):  # few-channel convolutions unfolded
                self._cached_transpose = vjp(lambda params: vmap(input_gradient)(params, self.x, self.y, self.draws),
                                             per_sample)[1]
        return self._cached_transpose

    def _cached_jt(self, u: torch.Tensor, flat: bool = True) -> torch.Tensor | dict[str, torch.Tensor]:
        """The cached path's J_iᵀu_i [B, k, dθ]; with one vector per sample and ``flat`` False, per parameter [B, …]."""
        pullback = self._transpose_pullback()
        scaled = self.scale * u  # the pullback is linear: scale its dx floats, not the [B, k, dθ] result
        if u.shape[1] == 1:  # one vector per sample (every solver step): no vmap layer (measured 10–25% faster)
            rows = pullback(scaled[:, 0])[0]
            return self._flat_rows(rows).unsqueeze(1) if flat else rows
        return vmap(lambda w: self._flat_rows(pullback(w)[0]), in_dims=1, out_dims=1,
                    chunk_size=self.chunk_size)(scaled)

    def _flat_rows(self, tree: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tree[n].reshape(self.batch_size, -1) for n in self.names], dim=1)

    def _cotangent(self, flat: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """[B, dθ] as the cached J pullback takes it: itself, or per parameter [B, …] as views (``TREE_ROWS_UP_TO``)."""
        if not self._tree_pullback:
            return flat
        parts = flat.split([self.params[n].numel() for n in self.names], dim=1)
        return {n: part.reshape(flat.shape[0], *self.params[n].shape) for n, part in zip(self.names, parts)}

    @on_exact_float32
    def j(self, v: torch.Tensor) -> torch.Tensor:
        """J_i v_i for every sample: v [B, k, dθ] → [B, k, dx]."""
        batch, k = self._check(v, self.dtheta)
        if self.direct and k == 1 and v.stride(0) == 0 and self.ghost_products:  # one v for every sample: batched
            shared = self.shared_j(v[0, 0])
            if shared is not None:
                return shared.unsqueeze(1)
        self._charge(batch, k)
        direct = lambda: self._per_sample_products(self._j_one, v).mul_(self.scale)  # noqa: E731
        if self.direct:
            return direct()
        if not self.coupled:
            def cached() -> torch.Tensor:
                pullback = self._pullback()
                with batchnorm_without_running_stats(self.model):
                    # Row i of the pullback of X ↦ (∇_θ ℓ(x_i))_i is J_i v_i: sample i's gradient depends on x_i only.
                    if k == 1:
                        return self.scale * pullback(self._cotangent(v[:, 0]))[0].reshape(batch, 1, -1)
                    return self.scale * vmap(lambda w: pullback(self._cotangent(w))[0].reshape(batch, -1), in_dims=1,
                                             out_dims=1, chunk_size=self.chunk_size)(v)
            return self._cached_or_direct(cached, direct)
        pullback = self._pullback()
        with batchnorm_without_running_stats(self.model):
            rows = vmap(lambda w: pullback(w)[0], chunk_size=self.chunk_size)(v.reshape(batch * k, self.dtheta))
            rows = rows.reshape(batch, k, batch, self.dx)
            idx = torch.arange(batch, device=v.device)
            return rows[idx, :, idx]

    def _pullback(self) -> Callable:
        """The vjp of the gradient map at this batch, built once: J products reuse its forward and
        backward pass instead of redoing them (measured: half the cost of a J product on LeNet).
        On the per-sample path its primal output is the per-sample gradients, kept for
        ``per_sample_gradients``."""
        if self._cached_pullback is None:
            with batchnorm_without_running_stats(self.model):
                self._tree_pullback = not self.coupled and self.batch_size * self.dtheta <= TREE_ROWS_UP_TO
                gradients = (self._batch_grad if self.coupled
                             else lambda inputs: vmap(self._sample_grad_tree if self._tree_pullback
                                                      else self._sample_grad)(inputs, self.y, self.draws))
                with unfolded_per_sample_convs(self.device):  # an image's first layer unfolded (CPU)
                    primal, self._cached_pullback = vjp(gradients, self.x)
                if not self.coupled:  # a tree's flat copy is one more [B, dθ]: TREE_ROWS_UP_TO bounds it
                    self._per_sample = (self._flat_rows(primal) if self._tree_pullback else primal).detach()
        return self._cached_pullback

    def _cached_or_direct(self, cached: Callable[[], torch.Tensor], direct: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The cached path's product (or ``jt_sum``'s whole-batch pass), or — where the device runs out of
        memory building or applying the pullbacks (``takes_cached`` counts parameters, not activations: a
        large input makes the graph larger) — the direct path's, which this operator keeps from then on.
        Both are exact."""
        try:
            return cached()
        except torch.cuda.OutOfMemoryError:
            self._cached_pullback = self._cached_transpose = None
            self.direct = True
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return direct()

    @on_exact_float32
    def kmv(self, u: torch.Tensor) -> torch.Tensor:
        """K_i u_i = J_i J_iᵀ u_i, u [B, k, dx] → [B, k, dx] (two applications; fused per sample on the
        direct path, ``direct_kmv``)."""
        if self.direct:
            return self.direct_kmv(u)
        batch, k = self._check(u, self.dx)
        if self.coupled or k != 1:
            return self.j(self.jt(u))
        self._charge(batch, 1)
        self._charge(batch, 1)

        def cached() -> torch.Tensor:  # Jᵀ's rows per parameter into J's pullback where it takes them (no cat)
            with batchnorm_without_running_stats(self.model):
                pullback = self._pullback()
                rows = self._cached_jt(u, flat=not self._tree_pullback)
                cotangent = rows if isinstance(rows, dict) else rows[:, 0]
                return self.scale * pullback(cotangent)[0].reshape(batch, 1, -1)
        return self._cached_or_direct(cached, lambda: self.direct_kmv(u, charge=False))

    def restricted(self, index: torch.Tensor) -> JacobianOperator:
        """The blocks of the samples ``index`` alone: products of the result on [len(index), k, ·]
        equal rows ``index`` of this operator's (the batch loss's scale c is kept), at the cost of
        len(index) samples. Per-sample path only: a coupled sample's block depends on the whole batch.
        The result builds its own pullbacks and counts its own applications."""
        if self.coupled:
            raise ValueError("a coupled operator's blocks cannot be restricted to a subset of the batch")
        sub = copy.copy(self)
        sub.x, sub.y, sub.draws = self.x[index], self.y[index], sample_rows(self.draws, index)
        sub.batch_size = int(sub.x.shape[0])
        sub.applications = 0
        sub._cached_pullback = sub._cached_transpose = None
        sub.__dict__.pop("_per_sample", None)
        sub.__dict__.pop("_gradient_set", None)
        sub.__dict__.pop("_compiled_kmv", None)  # a compiled product is bound to its own operator
        sub.__dict__.pop("_ghost", None)  # the batched K product's graphs are the batch's own
        sub.batch_loss = None  # the whole batch's
        return sub

    # -- gradients -------------------------------------------------------------------------
    @on_exact_float32
    def per_sample_gradients(self) -> torch.Tensor:
        """Unscaled per-sample gradients ∇_θ ℓ(f(x_i), y_i), [B, dθ] (with the batch's
        normalisation statistics when samples are coupled). Per-sample path: the primal output of
        the J pullback, which this builds (``chunk_size`` does not apply to it)."""
        with batchnorm_without_running_stats(self.model):
            if self.direct:
                if getattr(self, "_per_sample", None) is None:
                    self._per_sample = self._chunked_sample_grads()
                return self._per_sample
            if not self.coupled:  # the pullback's primal output is exactly these gradients: built once for both
                return self._cached_or_direct(lambda: (self._pullback(), self._per_sample)[1],
                                              self.per_sample_gradients)

            def losses(params):
                logits = self._forward(params, self.x)
                return vmap(lambda z, y: self.loss_fn(z.unsqueeze(0), y.unsqueeze(0)))(logits, self.y)

            jac = torch.func.jacrev(losses)(self.params)
            return torch.cat([jac[n].reshape(self.batch_size, -1) for n in self.names], dim=1)

    @on_exact_float32
    def batch_gradient(self) -> torch.Tensor:
        """The shared gradient g = ∇_θ L(X, θ), flat [dθ]."""
        with batchnorm_without_running_stats(self.model):
            return self._batch_grad(self.x)

    def _charge(self, batch: int, k: int) -> None:
        if self.limit is not None:
            self.limit.charge(k, batch)
        self.applications += k

    def _check(self, vectors: torch.Tensor, dim: int) -> tuple[int, int]:
        if vectors.ndim != 3 or vectors.shape[0] != self.batch_size or vectors.shape[2] != dim:
            raise ValueError(f"expected vectors of shape [B={self.batch_size}, k, {dim}], got {tuple(vectors.shape)}")
        return int(vectors.shape[0]), int(vectors.shape[1])
