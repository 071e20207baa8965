"""Refusing a round up front when the parameters the server sent jumped in scale (issue 23 §2).

A server that fishes (``flguard.server.fishing``, Wen et al. 2022) or denies service rewrites a few
tensors of the model it sends — class fishing sets the classifier's other biases to 1000, the
dead-network attack a hidden layer's biases to −1000 — and leaves the rest alone. FedAvg never
does that: a round moves each tensor by a fraction of its own scale. So the client compares the
scale of every tensor it receives with the same tensor in the last rounds it trained:

    jump_t = |rms(θ_t) − rms(θ'_t)| / max(rms(θ'_t), median_s rms(θ'_s))

(θ' an earlier round's parameters; a tensor that starts at zero, like a bias or a GroupNorm shift,
is measured against the median tensor's scale — robust to the one tensor a server blew up — not
its own). The
smaller jump against the last two rounds counts, so the honest round after a fished one is not
refused as well. With ``GuardConfig.max_param_jump`` set, a round whose largest jump exceeds it is
refused before any training, with a reply that names the tensor (``SUSPICIOUS``). Class fishing's
biases jump ~10⁴×; honest rounds of the demo's training stay below 1 (tests/test_round_check.py).

What the check cannot see: a change that keeps every tensor's scale (a permutation, a rescaled
copy of another class's row), and the first round a client trains (nothing to compare with). The
guard's per-step floor does not depend on it: it certifies every step the client does send.
Only per-tensor scales are kept (``context.state``), never parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Context, Message, MetricRecord

from flguard.guard.failure import SUSPICIOUS

#: ``context.state`` records of the last two received rounds' per-tensor RMS (newest first).
HISTORY_KEYS = ("flguard.param-rms.1", "flguard.param-rms.2")
MODEL_KEY = "__median__"  # the median tensor's RMS, the unit of tensors that start at zero


def tensor_scales(arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
    """RMS of each floating-point tensor, and their median under ``MODEL_KEY``."""
    scales = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating) and value.size:
            scales[name] = math.sqrt(float(np.square(value, dtype=np.float64).mean()))
    scales[MODEL_KEY] = float(np.median(list(scales.values()))) if scales else 0.0
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


def suspicious_round(message: Message, context: Context, max_jump: float) -> str | None:
    """The reason to refuse this train round, or None; records its scales in ``context.state`` either way.

    Refused rounds are recorded too: the next round is then compared with both the refused one and
    the one before, and the smaller jump counts (one fishing attempt costs one round, not two)."""
    current = tensor_scales(received_arrays(message))
    history = [dict(context.state.metric_records[key]) for key in HISTORY_KEYS if key in context.state.metric_records]
    if len(current) > 1:  # a message without model arrays (e.g. a SecAgg+ stage) leaves the history alone
        if history:
            context.state[HISTORY_KEYS[1]] = MetricRecord(history[0])
        context.state[HISTORY_KEYS[0]] = MetricRecord(current)
    if not history or len(current) <= 1:
        return None
    per_round = [parameter_jumps(current, previous) for previous in history]
    names = set.intersection(*(set(jumps) for jumps in per_round))
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
