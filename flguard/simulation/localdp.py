"""Flower's ``LocalDpMod`` as a comparison baseline, configured from the run config and measured.

``localdp_mod_from_config()`` builds Flower's own ``LocalDpMod(clipping_norm, sensitivity, epsilon,
delta)`` from the run-config keys ``localdp-<field>``; without ``localdp-epsilon`` it is inert. It
wraps the mod so that the reply also says how much noise LocalDpMod really added: it keeps the
handler's clean model, recomputes LocalDpMod's clipping (the update θK − θ0 scaled by
min(1, C/‖θK − θ0‖), as Flower's ``compute_clip_model_update`` does) and reports

* ``dp_noise_norm`` — ‖noise‖ / (K · lr), the noise in gradient units (comparable with the
  guard's ``guard_noise_norm``, which is per local step);
* ``dp_rel_noise`` — ‖noise‖ / ‖θK − θ0‖, the noise relative to the unclipped update.

Only these two numbers are added: nothing about the draw itself leaves the client.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Context, Message, MessageType, MetricRecord
from flwr.clientapp.mod import LocalDpMod
from flwr.clientapp.typing import ClientAppCallable, Mod

from flguard.flower.guard_mod import error_reply, prefixed_config
from flguard.simulation.task import LOCAL_STEPS_KEY, LR_KEY
from flguard.guard.config import LocalDpConfig  # the same fields (and std formula) as the guard's localdp

DP_METRIC_KEYS = ("dp_noise_norm", "dp_rel_noise")
__all__ = ["LocalDpConfig", "measured_local_dp", "localdp_mod_from_config", "localdp_run_config", "DP_METRIC_KEYS"]


def _norm(arrays: list[np.ndarray]) -> float:
    return float(math.sqrt(sum(float(np.square(a.astype(np.float64)).sum()) for a in arrays)))


def measured_local_dp(config: LocalDpConfig) -> Mod:
    """Flower's LocalDpMod, plus ``dp_noise_norm`` / ``dp_rel_noise`` in the reply's MetricRecord."""
    local_dp = LocalDpMod(config.clipping_norm, config.sensitivity, config.epsilon, config.delta)

    def mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        clean: list[list[np.ndarray]] = []

        def keep_clean(inner: Message, ctx: Context) -> Message:
            reply = call_next(inner, ctx)
            if not reply.has_error() and len(reply.content.array_records) == 1:
                record = next(iter(reply.content.array_records.values()))
                clean.append([a.copy() for a in record.to_numpy_ndarrays()])
            return reply

        reply = local_dp(message, context, keep_clean)
        if reply.has_error() or not clean or len(reply.content.metric_records) != 1:
            return reply
        before = next(iter(message.content.array_records.values())).to_numpy_ndarrays()
        after = next(iter(reply.content.array_records.values())).to_numpy_ndarrays()
        update = [c.astype(np.float64) - b for c, b in zip(clean[0], before)]
        update_norm = _norm(update)
        scale = min(1.0, config.clipping_norm / update_norm) if update_norm > 0 else 1.0
        noise = [a.astype(np.float64) - (b + u * scale) for a, b, u in zip(after, before, update)]
        train = next(iter(message.content.config_records.values()), {})
        steps_lr = float(train.get(LR_KEY, 1.0)) * int(train.get(LOCAL_STEPS_KEY, 1))
        noise_norm = _norm(noise)
        name, record = next(iter(reply.content.metric_records.items()))
        reply.content[name] = MetricRecord({**dict(record), "dp_noise_norm": noise_norm / steps_lr,
                                            "dp_rel_noise": noise_norm / update_norm if update_norm > 0 else 0.0})
        return reply

    return mod


def localdp_run_config(config: LocalDpConfig | None, prefix: str = "localdp-") -> dict[str, float | str]:
    """``config`` as run-config keys ``<prefix><field>`` (every LocalDpConfig field; all ``""`` for
    none, which leaves ``localdp_mod_from_config`` inert)."""
    values = config.model_dump() if config is not None else {}
    return {f"{prefix}{name.replace('_', '-')}": values.get(name, "") for name in LocalDpConfig.model_fields}


def localdp_mod_from_config(prefix: str = "localdp-") -> Mod:
    """``measured_local_dp`` configured by run-config keys ``localdp-<field>`` (train messages only).

    Inert without ``localdp-epsilon`` (a key set to ``""`` counts as unset); a bad value becomes an error reply naming the field.
    """
    mods: dict[tuple, Mod] = {}

    def mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        values = prefixed_config(context.run_config, prefix)
        if message.metadata.message_type.split(".")[0] != MessageType.TRAIN or "epsilon" not in values:
            return call_next(message, context)
        key = tuple(sorted(values.items()))
        if key not in mods:
            try:
                mods[key] = measured_local_dp(LocalDpConfig(**values))
            except ValueError as error:
                return error_reply(message, f"bad localdp configuration: {error}")
        return mods[key](message, context, call_next)

    return mod
