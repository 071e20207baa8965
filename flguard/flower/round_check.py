"""Refusing a round up front when the parameters the server sent are out of scale (issue 23 §2).

A server that fishes (``flguard.server.fishing``, Wen et al. 2022) or denies service rewrites a few
tensors of the model it sends — class fishing sets the classifier's other biases to 1000, the
dead-network attack a hidden layer's biases to −1000 — and leaves the rest alone. Training never
does that. With ``GuardConfig.max_param_jump`` set, the guard mod checks each train round's
parameters before any training and refuses the round with a reply that names the tensor
(``SUSPICIOUS``), on either of two tests:

- **out of scale in the model it arrives in** (no history needed, so it also catches a server that
  fishes a client from the first round it trains): a tensor whose RMS exceeds OUTLIER_FACTOR ×
  ``max_param_jump`` × the median nonzero tensor RMS (1,000× at 100; honest models measured 2.5–8.4×,
  the GroupNorm ResNets' scales at 1 the largest; class fishing's biases ~10⁴×);
- **a jump since the last rounds this client trained**: per tensor,

      jump_t = |rms(θ_t) − rms(θ'_t)| / max(rms(θ'_t), median over nonzero s of rms(θ'_s)),

  θ' an earlier round's parameters (a tensor that starts at zero, like a bias or a GroupNorm
  shift, is measured in the median tensor's unit — robust to the one tensor a server blew up). The
  smaller jump against the last two rounds counts, so the honest round after a refused one passes.
  Guarded local SGD on the quickstart CNN moves no tensor by more than 0.1 (tests/test_round_check.py).

What it cannot see: a change that keeps every tensor's scale (a permutation, a rescaled copy of
another class's row), or fishing with multipliers small enough to stay in scale (which magnifies
the target's gradient less). The guard's per-step floor does not depend on it: it certifies every
step the client sends. Only per-tensor scales are kept (``context.state``), never parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Context, Message, MetricRecord

from flguard.guard.failure import SUSPICIOUS

#: ``context.state`` records of the last two received rounds' per-tensor RMS (newest first).
HISTORY_KEYS = ("flguard.param-rms.1", "flguard.param-rms.2")
MODEL_KEY = "__median__"  # the median nonzero tensor's RMS, the unit of tensors that start at zero
#: A tensor larger than OUTLIER_FACTOR × max_param_jump × the median tensor's RMS (1,000× at 100) is
#: refused without history: ResNet-18-GN's GroupNorm scales at initialisation are 8.4×; class
#: fishing's biases ~10⁴×.
OUTLIER_FACTOR = 10.0


def tensor_scales(arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
    """RMS of each floating-point tensor, and the median of the nonzero ones under ``MODEL_KEY``."""
    scales = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating) and value.size:
            scales[name] = math.sqrt(float(np.square(value, dtype=np.float64).mean()))
    nonzero = [scale for scale in scales.values() if scale > 0]  # zero-initialised tensors set no unit
    scales[MODEL_KEY] = float(np.median(nonzero)) if nonzero else 0.0
    return scales


def parameter_jumps(current: Mapping[str, float], previous: Mapping[str, float]) -> dict[str, float]:
    """Per tensor present in both: |rms − rms'| / max(rms', the previous median tensor rms) (module doc)."""
    unit = previous.get(MODEL_KEY, 0.0)
    jumps = {}
    for name, scale in current.items():
        if name == MODEL_KEY or name not in previous:
            continue
        reference = max(previous[name], unit)
        jumps[name] = abs(scale - previous[name]) / reference if reference > 0 else (math.inf if scale > 0 else 0.0)
    return jumps


def received_arrays(message: Message) -> dict[str, np.ndarray]:
    """The model arrays of a train message (record-prefixed names when it holds several records)."""
    records = list(message.content.array_records.items())
    return {(key if len(records) == 1 else f"{record_name}.{key}"): np.asarray(array.numpy())
            for record_name, record in records for key, array in record.items()}


def outlier_tensors(current: Mapping[str, float]) -> dict[str, float]:
    """Per tensor: its RMS in units of the same model's median tensor RMS."""
    unit = current.get(MODEL_KEY, 0.0)
    return {name: scale / unit if unit > 0 else (math.inf if scale > 0 else 0.0)
            for name, scale in current.items() if name != MODEL_KEY}


def suspicious_round(message: Message, context: Context, max_jump: float) -> str | None:
    """The reason to refuse this train round, or None (module doc).

    Two tests, most blatant first: a tensor more than OUTLIER_FACTOR × ``max_jump`` times the model's
    median tensor scale (needs no history: catches a server that fishes a client from its first
    round on; such a round is not recorded, it is no reference for the next), then the jump against
    the last two rounds recorded in ``context.state``. A round refused for its jump is recorded: the
    next round is compared with both it and the one before, and the smaller jump counts (one
    refused round per attempt, not two)."""
    current = tensor_scales(received_arrays(message))
    if len(current) <= 1:  # no model arrays (e.g. a SecAgg+ stage): nothing to check or record
        return None
    outliers = outlier_tensors(current)
    worst = max(outliers, key=outliers.get)
    if outliers[worst] > OUTLIER_FACTOR * max_jump:
        return (f"{SUSPICIOUS}: the server sent '{worst}' at RMS {current[worst]:.3g}, {outliers[worst]:.3g}× the "
                f"median tensor's ({current[MODEL_KEY]:.3g}; at most {OUTLIER_FACTOR:g} × max_param_jump={max_jump:g}); "
                "trained models hold no such tensor (fishing and dead-network attacks do), so the round is refused "
                "up front")
    history = [dict(context.state.metric_records[key]) for key in HISTORY_KEYS if key in context.state.metric_records]
    if history:
        context.state[HISTORY_KEYS[1]] = MetricRecord(history[0])
    context.state[HISTORY_KEYS[0]] = MetricRecord(current)
    per_round = [parameter_jumps(current, previous) for previous in history]
    names = set.intersection(*(set(jumps) for jumps in per_round)) if per_round else set()
    if not names:
        return None
    jump = {name: min(jumps[name] for jumps in per_round) for name in names}
    worst = max(jump, key=jump.get)
    if jump[worst] <= max_jump:
        return None
    before = history[0].get(worst, float("nan"))
    return (f"{SUSPICIOUS}: the server sent '{worst}' at RMS {current[worst]:.3g} against {before:.3g} in the last "
            f"round this client trained, a jump of {jump[worst]:.3g}× its scale (max_param_jump={max_jump:g}); "
            "FedAvg does not move a tensor like that (fishing and dead-network attacks do), so the round is refused "
            "up front")
