"""Why a guarded step failed: the ``GuardFailure`` error, a failure as the reply's reason, and the
reason for a server-made dead network (``SUSPICIOUS``).

Every failure ends in the guard's fail-closed policy (``flguard.guard.engine``); these name it.
"""

from __future__ import annotations

import torch

from flguard.risk.assess import jacobian_product
from flguard.risk.clipped import Jacobian


class GuardFailure(RuntimeError):
    """Measuring or perturbing failed; the message is the reply's reason."""


class UnexplainedGradient(Exception):
    """``Guard.protect``'s ``check_gradient`` did not vouch for the gradient given against the guard's own gradient of
    the batch loss: not a failed step (nothing was perturbed or sent, no state of the guard's changed) but the caller's
    to resolve — ``make_guarded``'s step then recomputes the recorded passes one by one (``flguard.guard.training``)."""


#: Failures whose cause the guard can name from a piece of PyTorch's message: (piece, the cause and its fix).
KNOWN_CAUSES = (
    ("saved tensor hooks", "gradient checkpointing (torch.utils.checkpoint) in the model's forward pass: the guard "
                           "differentiates it inside torch.func's transforms, which cannot run it — guard the model "
                           "without checkpointing (the guard bounds its own passes' memory)"),
    ("use_reentrant=True", "gradient checkpointing with use_reentrant=True in the model's forward pass: the guard "
                           "recomputes the loss's gradient with torch.autograd.grad, which it refuses — guard the "
                           "model without checkpointing"),
    ("vmap: It looks like you're either (1) calling .item()",
     "the model or the loss reads a tensor's value as a Python number (.item(), an `if` on a tensor, F.one_hot's range "
     "check on the targets): the guard evaluates them one sample at a time inside torch.func.vmap, which cannot — "
     "write that part with tensor operations, e.g. F.one_hot(t, C) as (t.unsqueeze(1) == torch.arange(C, "
     "device=t.device).view(1, C, *[1] * (t.dim() - 1))).float()"),
)


def failure_reason(error: Exception) -> str:
    """A failure as the reply's reason: a GuardFailure's message, anything else with its type — led by its cause
    where ``KNOWN_CAUSES`` names it."""
    if isinstance(error, GuardFailure):
        return str(error)
    message = f"{type(error).__name__}: {error}"
    cause = next((cause for piece, cause in KNOWN_CAUSES if piece in message), None)
    return message if cause is None else f"{cause} ({message})"


#: The reason's prefix when the parameters the server sent leave nothing to certify (denial of service).
SUSPICIOUS = "suspicious parameters"


def dead_network_reason(op: Jacobian | None, generator: torch.Generator) -> str | None:
    """The reason for a server-made dead network, or None: after a failed step, one product J·z on a
    random parameter direction z — zero for every sample (almost surely only if every J_i = 0) means
    the inputs do not move the gradient at all, e.g. a layer whose ReLUs the server's biases killed.
    Nothing of the images leaks then (the update holds only label terms), but no floor can be
    certified either: the reply says so, instead of a solver's failure round after round."""
    if op is None:
        return None
    try:
        probe = torch.randn(op.dtheta, generator=generator, device=op.device, dtype=op.dtype)
        moved = jacobian_product(op, probe).norm(dim=1)
    except Exception:  # the step's limit, or the failure itself: keep the original reason
        return None
    if bool((moved > 0).any()):
        return None
    return (f"{SUSPICIOUS}: no sample's input moves its gradient (every per-sample Jacobian is zero: a dead "
            "network, e.g. biases that switch a layer's ReLUs off); nothing can be certified, so the client "
            "withholds — a server that sends such parameters is denying service")
