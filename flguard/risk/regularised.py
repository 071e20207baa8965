"""``RegularisedK``: the per-sample operators K_i + ε_iI (K_i = J_iJ_iᵀ) as one object.

In the spirit of curvlinops' linear operators: ``K @ u`` applies it, ``shape``, ``dtype`` and
``device`` describe it, and the solvers take it directly — ``K.lanczos(...)`` for the spectrum,
``K.solve(b)`` for I2F's (K_i+ε_iI)⁻¹b. It is the one place where the Jacobian operator's
products on [B, k, dx] (k vectors per sample) are adapted to the solvers' one vector per sample
[B, dx], and it carries ε, so that the CG solve and its error bound (from ‖r‖/ε) use the same ε.

The Lanczos and CG modules stay model-free (they see a batched matvec); this module binds them to
the Jacobian operator.
"""

from __future__ import annotations

import torch

from flguard.risk.krylov import CGResult, Sufficient, conjugate_gradient, preconditioned_cg, spectral_preconditioner
from flguard.risk.lanczos import Deflation, LanczosResult, galerkin_start, lanczos
from flguard.risk.lanczos_solve import LanczosSolveResult, lanczos_solve
from flguard.risk.clipped import Jacobian, base_operator


#: Opt-in: apply K_i through ``torch.compile`` (one compiled wrapper per operator; Dynamo reuses the
#: graph across operators of the same shapes). Off by default: the first compile of a process takes
#: seconds to a minute, and it is measured, not assumed, to pay (docs/results.md, "cost, continued").
COMPILE_PRODUCTS = False
#: ``torch.compile``'s ``mode`` for those products (None: its default; "reduce-overhead" replays
#: them as CUDA graphs on a GPU, where the guard's many small kernels are launch-bound).
COMPILE_MODE: str | None = None

#: The solves' products on the samples still iterating only (``ShrinkingProducts``): same iterates,
#: fewer sample-products once most samples have certified (docs/results.md, "cost, continued").
#: Per-sample operators only; a coupled operator always applies the whole batch.
SHRINK_TO_ACTIVE = True


class ShrinkingProducts:
    """K_i u_i for some samples of ``op``'s batch at the cost of about that many samples.

    A product's cost grows with the samples it carries (on the demo's CNN at B = 32, 16, 8, 4:
    34, 13, 9, 7 ms), while a solve's samples certify at different iterations (PCG: median 3,
    the last at 17). Products run on a sub-operator (``restricted``) of a set S ⊇ the rows asked
    for, rebuilt for exactly those rows once they are at most half of S — a rebuild costs about
    two products of the new size, so halving keeps all rebuilds below about two full products.
    S starts as the whole batch on ``op`` itself (whose pullbacks the Lanczos run already built).
    Rows of S not asked for are carried as zeros. On the direct path (``JacobianOperator.direct``:
    a ResNet-18 on a CPU) a restricted copy builds nothing and a product costs each sample it
    carries — one at a time, a zero row as much as any — so there S is always exactly the rows
    asked for. On a GPU's cached path S stays the whole batch: a product there is launch-bound, about as dear
    on a few samples as on all of them, so a rebuild (≈ 2.7 products on an H200) never pays — measured with it
    on and off on an H200: ResNet-18-GN at B = 32 2.51 → 1.73 s per step (102 → 64 ms per application), the
    quickstart CNN 294 → 253 ms (docs/results.md, "Shrinking products on a GPU"). The parent's ``applications``
    grows by the sub-products' applications × |S|/B: the count stays in whole-batch products. Partial products
    run eagerly (``COMPILE_PRODUCTS`` compiles the whole-batch ones only). On the ghost graphs a product's cost is
    mostly fixed on a small model (the quickstart CNN's: 7.2 ms on one row, 0.52 ms a row more), so a rebuild also
    has to repay itself within two products (``_rebuild``): its PCG's last few rows ride on S.
    """

    def __init__(self, op: Jacobian) -> None:
        self.op: Jacobian = op
        self.sub: Jacobian = op
        self.rows = torch.arange(op.batch_size, device=op.device)

    def __call__(self, u: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """K_i u_i for the samples ``rows`` (ascending indices [r]), u [r, dx] → [r, dx]."""
        if self._rebuild(rows):
            self.rows, self.sub = rows.clone(), self.op.restricted(rows)
        at = torch.searchsorted(self.rows, rows)
        padded = u if at.numel() == self.rows.numel() else u.new_zeros(self.rows.numel(), u.shape[1]).index_copy(0, at, u)
        counter = base_operator(self.sub)
        before = counter.applications
        out = self.sub.kmv(padded.unsqueeze(1)).squeeze(1)
        if self.sub is not self.op:  # the whole-batch operator counts its own applications
            base_operator(self.op).applications += (counter.applications - before) * self.rows.numel() / self.op.batch_size
        return out[at]

    def _rebuild(self, rows: torch.Tensor) -> bool:
        """Whether to take the products on a sub-operator of exactly ``rows``: where S does not hold them, where they
        are at most half of S on a CPU's cached path and on the ghost products (``ghost_products``) — there only where
        the rows dropped also pay the rebuild back within two products (a product's cost a + b·rows, the rebuild about
        a + b·rows/3; a/b is ``GhostKmv.overhead_rows``: a dozen rows on the quickstart CNN, whose last few rows are
        cheaper carried than rebuilt); on the rest of the direct path wherever they are fewer than S (nothing to
        rebuild there); never otherwise on an accelerator's cached path (launch-bound products)."""
        if not self._holds(rows):
            return True
        base = base_operator(self.op)
        if base.direct and not base.ghost_products:
            return rows.numel() < self.rows.numel()
        if self.op.device.type != "cpu":
            return False
        asked, held = rows.numel(), self.rows.numel()
        overhead = base.ghost_overhead_rows
        if overhead is not None:  # a rebuild ≈ a product's fixed cost and a third of its rows': repaid in two products
            return 2 * asked <= held and 2 * (held - asked) >= overhead + asked / 3
        return 2 * asked <= held

    def _holds(self, rows: torch.Tensor) -> bool:
        """Whether every row asked for is in S (a mask over the batch: ``torch.isin`` sorts, 1 ms a call on a CPU). S
        the whole batch holds every row without the mask, which on a GPU would wait on the device at every product."""
        if self.rows.numel() == self.op.batch_size:
            return True
        mask = torch.zeros(self.op.batch_size, dtype=torch.bool, device=rows.device)
        mask[self.rows] = True
        return bool(mask[rows].all())


class RegularisedK:
    """K_i + ε_iI for every sample i of ``op``'s batch, matrix-free.

    ``eps``: None for K itself (what Lanczos runs on: a relative ε needs λmax first), a scalar, or
    a tensor [B] of per-sample ε_i ≥ 0. Vectors are [B, dx] (one per sample) or [B, k, dx].
    """

    def __init__(self, op: Jacobian, eps: torch.Tensor | float | None = None) -> None:
        self.op = op
        #: (B, dx, dx): B blocks, each dx × dx; dtype and device those of the operator's inputs.
        self.shape: tuple[int, int, int] = (op.batch_size, op.dx, op.dx)
        self.dtype: torch.dtype = op.dtype
        self.device: torch.device = op.device
        self.eps = None if eps is None else torch.as_tensor(eps, dtype=op.dtype, device=op.device).expand(op.batch_size)

    def with_eps(self, eps: torch.Tensor | float | None) -> RegularisedK:
        """The same K with another ε (the operator's cached pullbacks are shared)."""
        return RegularisedK(self.op, eps)

    def _kernel(self, u: torch.Tensor) -> torch.Tensor:
        """K_i u_i, u [B, dx] or [B, k, dx]."""
        kmv, compiled = self.op.kmv, None
        if COMPILE_PRODUCTS:  # the first product builds the operator's pullbacks eagerly, later ones compiled
            compiled = getattr(self.op, "_compiled_kmv", None)
            if compiled is None:
                setattr(self.op, "_compiled_kmv", torch.compile(self.op.kmv, mode=COMPILE_MODE))
            else:
                kmv = compiled
        out = kmv(u.unsqueeze(1)).squeeze(1) if u.ndim == 2 else kmv(u)
        # CUDA-graph replays ("reduce-overhead") write their outputs into buffers the next replay reuses;
        # eager products own their outputs and are not copied
        return out if compiled is None else out.clone()

    def matvec(self, u: torch.Tensor) -> torch.Tensor:
        """(K_i + ε_iI) u_i for u [B, dx] or [B, k, dx] (same shape back)."""
        out = self._kernel(u)
        if self.eps is None:
            return out
        return out + self.eps.view(-1, *([1] * (u.ndim - 1))) * u

    __matmul__ = matvec
    __call__ = matvec  # a plain batched matvec for code that takes a callable

    def lanczos(self, **kwargs) -> LanczosResult:
        """Extreme Ritz pairs of K_i + ε_iI per sample (``flguard.risk.lanczos.lanczos``'s keywords)."""
        return lanczos(self, self.op.batch_size, self.op.dx, like=self.op.x, **kwargs)

    def solve(self, rhs: torch.Tensor, *, rtol: float = 1e-3, max_iter: int | None = None,
              ritz: tuple[torch.Tensor, torch.Tensor] | None = None, sufficient: Sufficient | None = None,
              start: LanczosResult | None = None, deflate: bool = True) -> CGResult:
        """(K_i + ε_iI)⁻¹ rhs_i by CG, rhs [B, dx]; with ε > 0 its relative error is at most
        ``rtol`` (the bound ‖r‖/ε, ``flguard.risk.krylov``). ``ritz``: (values [B, k], vectors
        [B, k, dx]) of K_i — PCG with their spectral preconditioner, stopped on the true residual
        (where some ε_i = 0 with rhs_i ≠ 0 there is no ‖r‖/ε bound: plain CG, as without).
        ``sufficient``: the caller's early stop, on the verified PCG path only. ``start``: a Lanczos run on this K
        (with its remainder) whose Galerkin solution PCG starts from, for no product, and with ``deflate`` whose
        Krylov space its search directions stay A-orthogonal to (deflated CG, ``flguard.risk.lanczos.Deflation``)."""
        shift = self.eps if self.eps is not None else torch.zeros(self.op.batch_size, dtype=self.dtype,
                                                                  device=self.device)
        rows = ShrinkingProducts(self.op) if SHRINK_TO_ACTIVE and not base_operator(self.op).coupled else None
        if ritz is not None and bool(((shift > 0) | (rhs.norm(dim=1) == 0)).all()):
            precond = spectral_preconditioner(ritz[0].to(rhs), ritz[1].to(rhs), shift)
            deflation = Deflation(start, shift, rhs) if start is not None and deflate else None
            initial, residual = (galerkin_start(start, rhs, shift) if start is not None and not deflate
                                 else (None, None))
            return preconditioned_cg(self._kernel, rhs, shift, precond, rtol=rtol, max_iter=max_iter, rows_matvec=rows,
                                     sufficient=sufficient, initial=initial, initial_residual=residual,
                                     deflation=deflation)
        return conjugate_gradient(self._kernel, rhs, shift, rtol=rtol, max_iter=max_iter, rows_matvec=rows)

    def solve_with_lambda_max(self, rhs: torch.Tensor, eps: float, *, relative: bool = True, rtol: float = 1e-3,
                              max_iter: int | None = None, seed: int = 0,
                              skip: torch.Tensor | None = None,
                              sufficient: Sufficient | None = None) -> LanczosSolveResult:
        """λmax of K_i and (K_i + ε_iI)⁻¹rhs_i with ε_i = eps·λmax_i (``relative``) or eps, from one
        Lanczos run per sample started at rhs_i (``flguard.risk.lanczos_solve``): this object's own
        ε is not used — the run sets it. Products on the samples still iterating only, as ``solve``;
        none on the samples ``skip`` marks; ``sufficient``: the caller's early stop."""
        rows = ShrinkingProducts(self.op) if SHRINK_TO_ACTIVE and not base_operator(self.op).coupled else None
        return lanczos_solve(self._kernel, rhs, eps=eps, relative=relative, rtol=rtol, max_iter=max_iter,
                             rows_matvec=rows, seed=seed, skip=skip, sufficient=sufficient)
