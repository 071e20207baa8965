"""Per-sample leakage risk: the Jacobian operator, Krylov solvers, ``assess`` and c(M).

Dependencies flow one way: risk ← defenses ← guard ← flower; attacks use risk, never the reverse.
"""

from flguard.risk.assess import assess, i2f_norms, resolve_eps
from flguard.risk.defaults import DEFAULT_EPS_RELATIVE
from flguard.risk.krylov import conjugate_gradient
from flguard.risk.lanczos import lanczos
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK
from flguard.risk.report import METRIC_NAMES, RiskReport

__all__ = ["assess", "RiskReport", "JacobianOperator", "RegularisedK", "lanczos", "conjugate_gradient", "resolve_eps",
           "i2f_norms", "METRIC_NAMES", "DEFAULT_EPS_RELATIVE", "architecture_index"]


def __getattr__(name: str):
    # c(M) lives in its own module (it builds R-GAP's linear systems); import it on first use.
    if name in ("architecture_index", "ArchitectureIndex"):
        from flguard.risk import architecture

        return getattr(architecture, name)
    raise AttributeError(name)
