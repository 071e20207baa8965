"""The per-sample-clipped upload's Jacobian blocks (``ClippedJacobian``), and ``Jacobian``: either operator.

With ``clip_per_sample`` the guard sends c Σ_i clip_C(g_i) and the attacker inverts that, so the
guard measures its Jacobian: the plain operator's products (``flguard.risk.operator``) wrapped by
the clipping's per-sample projection.
"""

from __future__ import annotations

import torch

from flguard.risk.operator import JacobianOperator


#: ``ClippedJacobian._project`` with one vector per sample computes ⟨w_i, g_i⟩ as batched dot products (``vecdot``)
#: up to this many floats in w, and as a batched GEMV (``bmm``) above: the dot products ran 2.6–3.5× faster on one CPU
#: thread (B = 32 × 44 k and B = 8 × 272 k floats; the clipped K product on the trained CNN 7–11% faster,
#: ``benchmarks/bench_clip_projection.py``, when it still projected in the parameter space — it now corrects in the
#: input space, ``ClippedJacobian.kmv``; ``j`` and ``jt`` project) but hold a temporary the size of w, which the
#: GEMV does not (1.4 GB for a ResNet-18's cached products at B = 32 on a GPU); the update w − a_i g_i is an
#: ``addcmul`` either way (1.5× a ``baddbmm``'s speed, no temporary). For k > 1 vectors per sample the GEMMs are the
#: faster form.
DOT_PROJECTION_UP_TO = 2 ** 24


class ClippedJacobian:
    """The blocks of the per-sample-clipped upload U(X) = c Σ_i clip_C(g_i(x_i)), clip_C(g) = g·min(1, C/‖g‖).

    With per-sample clipping the attacker inverts U, not the plain gradient, so the guard must
    measure U's Jacobian. For a clipped sample (‖g_i‖ > C, g_i unscaled) the chain rule gives
    ∂clip_C(g_i)/∂g_i = s_i(I − ĝ_iĝ_iᵀ), s_i = C/‖g_i‖, ĝ_i = g_i/‖g_i‖, so in the J (dx × dθ) layout

        J̄_i = J_i · s_i(I − ĝ_iĝ_iᵀ)   (J̄_i = J_i for an unclipped sample),

    exact wherever ‖g_i‖ ≠ C. Products wrap ``JacobianOperator``'s: j(v) = J_i(s_i P_i v) and
    jᵀ(u) = s_i P_i J_iᵀu; the K product, which the solvers run, takes the projection in the input space,
    s_i²(K_iu − a_i⟨a_i, u⟩) with a_i = J_iĝ_i (``kmv``). ``gradient`` is U itself (the update to send). Per-sample
    path only.
    """

    def __init__(self, op: JacobianOperator, clip: float) -> None:
        if op.coupled:
            raise ValueError("per-sample clipping needs a per-sample-separable loss and no train-mode BatchNorm: "
                             "the loss must be a mean, a sum or a class-weighted mean of the samples' own losses "
                             "(flguard.risk.loss_split) — a loss pooled over the batch (a Dice loss summing every "
                             "sample's pixels together) couples them: compute it per sample, then average")
        self.op, self.clip = op, float(clip)
        # the per-sample gradients as norms, dot products and weighted sums: the [B, dθ] matrix, or never formed where
        # the operator's graphs are kept in its room (flguard.risk.sample_gradients)
        per = op.sample_gradient_set()
        norms = per.norms()
        clipped = norms > self.clip
        tiny = torch.finfo(norms.dtype).tiny
        self.factor = torch.where(clipped, self.clip / norms.clamp_min(tiny), torch.ones_like(norms))
        # ĝ_i = inverse_norm_i · g_i, zero for unclipped samples (no projection): the per-sample gradients
        # the operator keeps anyway serve as the directions, no second [B, dθ] copy of unit vectors
        self.inverse_norm = torch.where(clipped, 1.0 / norms.clamp_min(tiny), torch.zeros_like(norms))
        self.per = per  # shared with the operator (and with every restricted copy: rows index into it)
        self.rows: torch.Tensor | None = None  # which rows of ``per`` are this operator's samples (None: all)
        self.sample_norms = norms
        self.gradient = op.scale * per.weighted(self.factor)  # Σ_i s_i g_i without a [B, dθ] temporary
        self.unclipped_gradient = op.scale * per.total()
        # J_i g_i of this operator's samples ([B, dx], ``_gradient_images``): taken at the first product that needs
        # them, on this operator or sliced from a copy it was restricted from that took them
        self._images: dict = {"values": None, "parent": None, "index": None}

    def __getattr__(self, name: str):  # x, dx, dtheta, batch_size, dtype, device, applications …
        return getattr(self.op, name)

    def _project(self, w: torch.Tensor) -> torch.Tensor:
        """s_i(I − ĝ_iĝ_iᵀ)w_i for w [B, k, dθ]. One fused w − (wĝ)ĝᵀ and an in-place scale: these are memory-bound
        passes over B·k·dθ floats, a fifth of the clipped guard's time when written as separate temporaries."""
        per = self._dense()
        one = w.shape[1] == 1  # one vector per sample: DOT_PROJECTION_UP_TO
        dot = (torch.linalg.vecdot(w, per.unsqueeze(1)).unsqueeze(2) if one and w.numel() <= DOT_PROJECTION_UP_TO
               else torch.bmm(w, per.unsqueeze(2)))
        along = dot * self.inverse_norm.square().view(-1, 1, 1)  # [B, k, 1]
        out = (torch.addcmul(w, along, per.unsqueeze(1), value=-1) if one
               else torch.baddbmm(w, along, per.unsqueeze(1), alpha=-1))
        return out.mul_(self.factor.view(-1, 1, 1))

    def _projection(self) -> tuple:
        """(before, extra) for the direct path's J product: sample i's gradient read from the shared [B, dθ] by its
        row inside the vmapped call (a restricted operator copies no rows of it)."""
        per = self.per.dense()
        rows = torch.arange(self.batch_size, device=per.device) if self.rows is None else self.rows

        def before(w: torch.Tensor, row: torch.Tensor, inverse_norm_sq: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor:
            return _clip_projection(w, per[row], inverse_norm_sq, scale)
        return before, (rows, self.inverse_norm.square(), self.factor)

    def j(self, v: torch.Tensor) -> torch.Tensor:
        if self.op.direct and v.shape[1] == 1 and v.stride(0) == 0 and self.op.ghost_products:
            shared = self.op.shared_j(v[0, 0])  # one v for every sample (the noise): J_iv in one batched pass
            if shared is not None:  # s_iJ_iP_iv = s_i(J_iv − ‖g_i‖⁻²⟨g_i, v⟩J_ig_i)
                dots = self.per.dots(v[0, 0])
                along = self.inverse_norm.square() * (dots if self.rows is None else dots[self.rows])
                return (self.factor.unsqueeze(1) * (shared - along.unsqueeze(1) * self._gradient_images())).unsqueeze(1)
        if self.op.direct:  # projected per sample inside the product: no [B, k, dθ] copy of v
            return self.op.direct_j(v, *self._projection())
        return self.op.j(self._project(v))

    def jt(self, u: torch.Tensor) -> torch.Tensor:
        return self._project(self.op.jt(u))

    def _gradient_images(self) -> torch.Tensor:
        """J_ig_i [b, dx] for this operator's samples (the operator's scaled J, the unscaled per-sample gradients),
        taken once per operator at its first K product, summed Jᵀ product or noise J product: the rows of an operator
        it was restricted from that took them (``restricted``: the solvers' shrinking products), else one J product
        per sample on this operator itself — its own samples only (the guard's products run on the batch without its
        negligible samples, whose images nothing needs: they are never clipped), on the graphs its K products
        build anyway."""
        images = self._images
        if images["values"] is None:
            images["values"] = _taken_above(images)
            if images["values"] is None:  # (the gradients are read only where the operator has no graphs)
                images["values"] = self.op.gradient_images(None if self.op.ghost_graphs else self._dense())
        return images["values"]

    def jt_sum(self, u: torch.Tensor) -> torch.Tensor:
        """Σ_i J̄_iᵀu_i = Σ_i s_iP_iJ_iᵀu_i, u [B, dx] → [dθ], without a [B, dθ]: the plain operator's summed
        product of the s_iu_i, less the clipped samples' components along their gradients,
        s_i‖g_i‖⁻²⟨J_ig_i, u_i⟩ g_i (``_gradient_images``). One application, and the images' one if no product took
        them before."""
        along = self._gradient_images()  # J_i g_i [B, dx]
        weights = self.factor * self.inverse_norm.square() * (along * u).sum(1)  # 0 for an unclipped sample
        return self.op.jt_sum(self.factor.unsqueeze(1) * u) - self.per.weighted(self._whole_batch(weights))

    def _dense(self) -> torch.Tensor:
        """This operator's rows of the [B, dθ] per-sample gradients (formed here if they were not)."""
        per = self.per.dense()
        return per if self.rows is None else per[self.rows]

    def _whole_batch(self, weights: torch.Tensor) -> torch.Tensor:
        """Weights of this operator's samples [b] as the whole batch's [B] (zero on the other rows)."""
        if self.rows is None:
            return weights
        out = weights.new_zeros(self.per.norms().shape[0])
        out[self.rows] = weights
        return out

    def kmv(self, u: torch.Tensor) -> torch.Tensor:
        """J̄_iJ̄_iᵀu_i = s_i²J_i(I − ĝ_iĝ_iᵀ)J_iᵀu_i = s_i²(K_iu_i − a_i⟨a_i, u_i⟩) with a_i = J_iĝ_i: the clipping's
        projection moved to the input space, where it is a rank-one correction of dx floats per vector, instead of a
        pass over dθ floats inside every product (a_i from ``_gradient_images``, once per step; a_i = 0 for an
        unclipped sample). Two applications (plus the images' one, once)."""
        images = self._gradient_images() * self.inverse_norm.unsqueeze(1)  # a_i = J_iĝ_i [B, dx]
        plain = self.op.kmv(u)
        along = (u * images.unsqueeze(1)).sum(2, keepdim=True)  # ⟨a_i, u_ik⟩ [B, k, 1]
        return torch.addcmul(plain, along, images.unsqueeze(1), value=-1).mul_(self.factor.square().view(-1, 1, 1))

    def restricted(self, index: torch.Tensor) -> ClippedJacobian:
        """The clipped blocks of the samples ``index`` alone (see ``JacobianOperator.restricted``)."""
        sub = ClippedJacobian.__new__(ClippedJacobian)  # not copy.copy: __getattr__ delegates to .op
        sub.__dict__.update(self.__dict__)
        sub.op = self.op.restricted(index)
        sub.factor, sub.sample_norms = self.factor[index], self.sample_norms[index]
        sub.inverse_norm = self.inverse_norm[index]
        sub.rows = index if self.rows is None else self.rows[index]  # into the shared per-sample gradients
        sub._images = {"values": None, "parent": self._images, "index": index}  # this one's, or sliced from above
        return sub


def _taken_above(images: dict) -> torch.Tensor | None:
    """The gradient images an operator's ``_images`` can slice from the nearest operator above it (the one it was
    restricted from, and so on) that took them; None where none did."""
    parent = images["parent"]
    if parent is None:
        return None
    above = parent["values"] if parent["values"] is not None else _taken_above(parent)
    return None if above is None else above[images["index"]]


def _clip_projection(w: torch.Tensor, g: torch.Tensor, inverse_norm_sq: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor:
    """One sample's scale·(I − ĝĝᵀ)w with ĝ = g/‖g‖ (inverse_norm_sq = 1/‖g‖², 0 for an unclipped sample): the
    clipping's P_i with scale s_i, on a flat w [dθ]."""
    return scale * (w - (inverse_norm_sq * torch.dot(w, g)) * g)


#: Either operator (plain or per-sample-clipped upload): what the guard, the defenses and
#: ``RegularisedK`` accept — both apply j, jt and kmv on the same [B, k, ·] layout.
Jacobian = JacobianOperator | ClippedJacobian


def base_operator(op: Jacobian) -> JacobianOperator:
    """The plain operator under ``op`` (itself, or the one a ``ClippedJacobian`` wraps): where the
    path (``coupled``) and the application count live."""
    return op.op if isinstance(op, ClippedJacobian) else op
