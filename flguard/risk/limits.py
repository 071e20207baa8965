"""A per-step budget on the Jacobian operator's work (``ProductLimit``): the guard's time limit.

The operator (``flguard.risk.operator``) charges it before every product, so a solver that would run
away is stopped with a reason naming the limit, and the guard withholds the step.
"""

from __future__ import annotations

import time


class ProductLimitReached(RuntimeError):
    """A step's limit on Jacobian products or seconds (``ProductLimit``) was reached; the message names it."""


class ProductLimit:
    """A per-step budget on the operator's work, checked before every product: at most
    ``max_products`` applications per sample (a product on r of the B samples with k vectors each
    counts k·r/B, as ``applications`` does) and at most ``max_seconds`` of wall time from its
    creation. Shared by an operator and every ``restricted`` copy of it, so the solvers' partial
    products count too. Reaching either raises ``ProductLimitReached`` naming the limit: the
    caller (the guard) then withholds the step, whatever the solver was doing."""

    def __init__(self, batch_size: int, max_products: float | None = None, max_seconds: float | None = None) -> None:
        self.batch_size = batch_size
        self.max_products, self.max_seconds = max_products, max_seconds
        self.products = 0.0
        self.start = time.perf_counter()

    def charge(self, vectors: int, rows: int) -> None:
        """Count a product of ``vectors`` per sample on ``rows`` samples, after checking the limits."""
        cost = vectors * rows / self.batch_size
        if self.max_products is not None and self.products + cost > self.max_products + 1e-9:
            raise ProductLimitReached(f"the step's limit max_products={self.max_products:g} Jacobian products per "
                                      f"sample was reached ({self.products:.1f} taken)")
        if self.max_seconds is not None and time.perf_counter() - self.start > self.max_seconds:
            raise ProductLimitReached(f"the step's limit max_seconds={self.max_seconds:g} was reached "
                                      f"({time.perf_counter() - self.start:.1f} s, {self.products:.1f} products "
                                      "per sample)")
        self.products += cost
