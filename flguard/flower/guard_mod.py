"""The guard as a Flower client mod: only guarded updates leave the client.

Adoption is two edits (see docs/guard.md):

    app = ClientApp(mods=[guard_mod(GuardConfig(...))])
    ...
    model, optimizer, criterion = make_guarded(model, optimizer, criterion)   # in the train code

(or, for hand-written loops, ``grads = guard_step(model, x, y, grads)`` before each update).

How it fits together: while a *train* message is handled, the mod opens a ``GuardSession``
(``flguard.guard.session``); every guarded step — ``make_guarded``'s ``optimizer.step()`` or a
``guard_step`` call — runs ``Guard.protect`` and files its report there, and every
``torch.optim.Optimizer.step()`` of the round is counted by a global optimizer hook. So
multi-step local training is guarded per step and FedSGD (one step) is exact. After the handler
returns, the mod adds the guard's numeric metrics (fixed keys, every round) to the reply's
MetricRecord, with the round's worst sample over its steps. A dropped step, a misused loop, a
round with no guarded step or with *any* optimizer step that was not guarded, or a reply that is
not one ArrayRecord + one MetricRecord becomes a Flower *error* reply that says why — never an
unguarded update. Evaluate and query messages pass through untouched.

Legacy clients (``client_fn`` + ``NumPyClient``) reply in Flower's compat layout; the metrics then go
into its ``fitres.metrics`` record, which legacy strategies read. Flower's SecAgg+ mod sends its
key-exchange and unmasking stages as *train* messages that never reach the handler and carry no
model update; the mod accepts a reply without guard steps only for those stages and only when it
holds no model arrays (a server that fakes a stage gains nothing: the handler still runs guarded),
so it chains with ``secaggplus_mod`` in either order.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from flwr.app import Context, Error, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS as SECAGG_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.common.secure_aggregation.secaggplus_constants import Stage as SecAggStage
from torch import nn

from flguard.guard import Guard, GuardFailure
from flguard.config import ConfigError
from flguard.guard.config import NONE_STRINGS, THRESHOLD_DEFENSES, GuardConfig, all_guard_fields
from flguard.guard.report import METRIC_KEYS, GuardReport, summarise
from flguard.guard.session import GuardSession, active_session, open_session
from flguard.flower.round_check import suspicious_round

_LOG = logging.getLogger("flguard")

#: Error code of a reply whose update the guard withheld (Flower's MOD_FAILED_PRECONDITION).
GUARD_ERROR_CODE = 6
#: The ConfigRecord holding fit metrics in Flower's compat (NumPyClient) reply layout.
LEGACY_FIT_METRICS = "fitres.metrics"


class GuardDropped(GuardFailure):
    """A local step's update could not be guarded; the round's reply must not carry it."""

    def __init__(self, report: GuardReport) -> None:
        super().__init__(report.reason)
        self.report = report


def guard_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, gradients: Sequence[torch.Tensor],
               loss_fn=None, step_size: float | None = None, step_rule=None,
               draws: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Guard one local step: per-parameter gradients of the batch ``(x, y)`` → perturbed ones.

    The functional path, for hand-written loops (``make_guarded`` is the drop-in for ordinary
    ``loss.backward(); optimizer.step()`` loops). Outside ``guard_mod`` (no active session) the
    gradients pass through unchanged, so the same training code serves unguarded baselines.
    Raises ``GuardDropped`` when the guard withholds the update. ``step_size``: the learning rate of a
    plain SGD step ``p -= lr * g`` (``Guard.protect``'s: lets ``auto`` judge how far its noise moves the
    parameters); ``step_rule``: another optimizer's step, ``flguard.guard.trial_step.trial_displacement(optimizer,
    params)``, whose damage ``clip_per_sample="auto"`` then judges; ``draws``: a model with train-mode dropout's
    masks in the pass that made ``gradients`` (``Guard.protect``'s).
    """
    session = active_session()
    if session is None:
        return list(gradients)
    flat = torch.cat([g.reshape(-1) for g in gradients])
    out = session.guard.protect(model, x, y, flat, loss_fn=loss_fn, step_size=step_size, step_rule=step_rule,
                                draws=draws)
    session.file(out.report)
    if out.gradient is None:
        raise GuardDropped(out.report)
    return [chunk.view_as(g) for chunk, g in zip(out.gradient.split([g.numel() for g in gradients]), gradients)]


def round_metrics(reports: Sequence[GuardReport]) -> dict[str, float]:
    """One round's guard metrics: the worst sample over all guarded steps (fixed METRIC_KEYS)."""
    return summarise(reports)


def error_reply(message: Message, reason: str) -> Message:
    return Message(Error(code=GUARD_ERROR_CODE, reason=f"flguard: update withheld: {reason}"), reply_to=message)


def _guarded_call(guard: Guard, message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Run the train handler inside a guard session and vet its reply (see module doc)."""
    secagg_control = _is_secagg_control(message)  # before call_next: secaggplus_mod pops the stage
    if guard.config.max_param_jump is not None and not secagg_control:
        suspicious = suspicious_round(message, context, guard.config.max_param_jump)
        if suspicious:  # before any training: nothing of this round is computed, let alone sent
            return error_reply(message, suspicious)
    with open_session(guard) as session:
        try:
            reply = call_next(message, context)
        except GuardFailure as failure:  # a withheld step (guard_step or make_guarded) or a misused loop
            return error_reply(message, str(failure))
    if reply.has_error():
        return reply
    problem = session_problem(session)
    if problem:
        if secagg_control and not session.optimizer_steps and not _carries_update(reply):
            return reply  # SecAgg+ keys or mask shares: no model update to guard
        return error_reply(message, problem)
    for report in session.reports:
        if not report.met:  # max-noise or an acknowledged send: the reply goes out, say why here
            _LOG.warning("flguard: update sent with guard_met=0: %s", report.reason)
    metrics = round_metrics(session.reports)
    legacy = reply.content.config_records.get(LEGACY_FIT_METRICS)
    if legacy is not None:  # compat layout: legacy strategies read fit metrics from this record
        legacy.update(metrics)
        return reply
    metric_records = list(reply.content.metric_records.items())
    if len(metric_records) != 1 or len(reply.content.array_records) != 1:
        return error_reply(message, "the reply must hold exactly one ArrayRecord and one MetricRecord")
    name, record = metric_records[0]
    reply.content[name] = MetricRecord({**dict(record), **metrics})
    return reply


def session_problem(session: GuardSession) -> str:
    """Why a round's update must not be sent ('' when every step was guarded).

    Every ``torch.optim.Optimizer.step()`` taken during the round is counted; each must have gone
    through the guard (``make_guarded``'s optimizer, or a ``guard_step`` before it)."""
    if not session.reports:
        return ("the train handler never guarded a step (no make_guarded optimizer step and no "
                "flguard.flower.guard_step call), so the update was not guarded")
    unguarded = session.unguarded_steps()
    if unguarded:
        return (f"{unguarded} of {session.optimizer_steps} optimizer steps this round were not guarded "
                f"({session.guarded_steps} guarded): every step must go through make_guarded's optimizer "
                "or guard_step")
    return ""


def _is_train(message: Message) -> bool:
    return message.metadata.message_type.split(".")[0] == MessageType.TRAIN


def _is_secagg_control(message: Message) -> bool:
    """A SecAgg+ key-exchange or unmasking stage: Flower's secaggplus_mod answers it itself."""
    secagg = message.content.config_records.get(SECAGG_CONFIGS)
    return secagg is not None and secagg.get(SecAggKey.STAGE) != SecAggStage.COLLECT_MASKED_VECTORS


def _carries_update(reply: Message) -> bool:
    """Whether a reply holds model arrays, a legacy fit result or a SecAgg+ masked vector."""
    secagg = reply.content.config_records.get(SECAGG_CONFIGS) or {}
    return (any(len(record) for record in reply.content.array_records.values())
            or LEGACY_FIT_METRICS in reply.content.config_records or SecAggKey.MASKED_PARAMETERS in secagg)


def guard_mod(config: GuardConfig | None = None) -> Mod:
    """A Flower mod that guards train replies with one ``Guard`` (one noise stream) per ClientApp."""
    guard = Guard(config)

    def mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        return _guarded_call(guard, message, context, call_next) if _is_train(message) else call_next(message, context)

    return mod


def prefixed_config(run_config: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Run-config keys ``<prefix><field>`` as ``{field: value}`` (dashes become underscores).

    A value of ``""`` means unset: a Flower app must declare every run-config key it accepts, so
    optional keys are declared with ``""`` in its pyproject.
    """
    return {key[len(prefix):].replace("-", "_"): value for key, value in run_config.items()
            if key.startswith(prefix) and value != ""}


def guard_run_config(config: GuardConfig | None, prefix: str = "guard-") -> dict[str, bool | float | int | str]:
    """``config`` as run-config keys ``<prefix><field>`` (underscores as dashes): one key per field of
    *any* defense (``all_guard_fields``), ``""`` (unset) for a field ``config``'s defense does not take
    or leaves None, every key ``""`` for no guard. Complete on purpose: defaults declared in an app's
    pyproject cannot leak into the guard. ``guard_config_from_run_config`` reads it back."""
    values = config.model_dump() if config is not None else {}
    keys: dict[str, bool | float | int | str] = {}
    for name in all_guard_fields():
        value = values.get(name)
        if isinstance(value, (tuple, list)):
            raise ConfigError(f"{type(config).__name__}.{name}: value={value!r} is not allowed: a run config "
                              "carries numbers, strings and booleans (give a scalar, or 'batch' for input_bounds)")
        off = value is None and name in NONE_STRINGS and name in values  # None switching a default off
        keys[f"{prefix}{name.replace('_', '-')}"] = "none" if off else ("" if value is None else value)
    return keys


def guard_config_from_run_config(run_config: Mapping[str, Any], prefix: str = "guard-") -> GuardConfig | None:
    """The guard's config from ``<prefix><field>`` keys (``""`` = unset), or None when ``<prefix>defense``
    is unset. The defense's own model validates the rest, so a key of another defense set to a value
    is an error naming its field (ConfigError)."""
    values = prefixed_config(run_config, prefix)
    return GuardConfig(**values) if values.get("defense") else None


def weaker_fields(candidate: GuardConfig, minimum: GuardConfig) -> list[str]:
    """The ways ``candidate`` promises less than ``minimum`` ([] when it is at least as strict).

    A floor is lower when the defense promises none (``none`` and the baselines), when τ is smaller
    (``min_rmse``; ``max_psnr`` higher), when the box-aware floor is dropped (``input_bounds``), when ε
    is smaller (a smaller ε lets less noise meet the same τ), when a missed floor may be sent
    (``on_unmet``) or when the client's up-front check of the parameters is dropped or relaxed
    (``max_param_jump``)."""
    problems = []
    if minimum.defense in THRESHOLD_DEFENSES and candidate.defense not in THRESHOLD_DEFENSES:
        problems.append(f"defense={candidate.defense!r} promises no floor (client minimum: {minimum.defense!r})")
    elif minimum.defense in THRESHOLD_DEFENSES:
        (unit, value, scale), (least_unit, least, least_scale) = _floor(candidate), _floor(minimum)
        if (unit, scale) != (least_unit, least_scale):
            problems.append(f"the floor is given as {unit} {scale or ''}; the client's is {least_unit}={least} "
                            f"{least_scale or ''}: give it in the client's unit")
        elif value is None or (value < least if unit == "min_rmse" else value > least):
            problems.append(f"{unit}={value} is weaker than the client's {unit}={least}")
    least_box = getattr(minimum, "input_bounds", None)  # only the threshold defenses take a box
    if least_box is not None and getattr(candidate, "input_bounds", None) is None:
        problems.append(f"input_bounds=None drops the client's box-aware floor (input_bounds={least_box!r})")
    if candidate.eps_mode != minimum.eps_mode:
        problems.append(f"eps_mode={candidate.eps_mode!r} differs from the client's {minimum.eps_mode!r}")
    elif candidate.eps < minimum.eps:
        problems.append(f"eps={candidate.eps} is below the client's eps={minimum.eps}")
    if minimum.max_param_jump is not None and (candidate.max_param_jump is None
                                               or candidate.max_param_jump > minimum.max_param_jump):
        problems.append(f"max_param_jump={candidate.max_param_jump} is laxer than the client's "
                        f"max_param_jump={minimum.max_param_jump}")
    if candidate.on_unmet != minimum.on_unmet and minimum.on_unmet == "drop":
        problems.append(f"on_unmet={candidate.on_unmet!r} would send updates the client withholds ('drop')")
    return problems


def _floor(config: GuardConfig) -> tuple[str, float | None, tuple | None]:
    """(unit, value, normalisation) of a config's floor: PSNR in pixel space when ``max_psnr`` is
    set (meaningful only with its pixel normalisation), else ``min_rmse`` in input units."""
    psnr = getattr(config, "max_psnr", None)
    if psnr is not None:
        return "max_psnr", psnr, (getattr(config, "pixel_mean", None), getattr(config, "pixel_std", None))
    return "min_rmse", config.min_rmse, None


def client_minimum(context: Context, minimum: GuardConfig | None, prefix: str) -> GuardConfig | None:
    """The client's own floor: ``minimum`` from code, else ``<prefix><field>`` keys of the node config
    (``flower-supernode --node-config "guard-defense='gaussian' guard-min-rmse=0.1"``), else None."""
    if minimum is not None:
        return minimum
    return guard_config_from_run_config(context.node_config, prefix)


def guard_mod_from_run_config(prefix: str = "guard-", minimum: GuardConfig | None = None,
                              node_prefix: str = "guard-") -> Mod:
    """Like ``guard_mod``, configured by run-config keys ``guard-<field>`` (e.g. ``guard-defense``,
    ``guard-min-rmse``) — for apps configured in pyproject's ``[tool.flwr.app.config]``. A key set to
    ``""`` counts as unset; a bad value is an error reply naming the field.

    The run config belongs to whoever submits the run — in the threat model, the server. So the
    client keeps a floor of its own: ``minimum`` (code) or the node config's ``guard-<field>`` keys
    (``client_minimum``). With one, the guard always runs: the run config may leave the guard unset
    (the client's configuration applies) or make it stricter, and a run config that would disable
    it or lower its floor (``weaker_fields``) turns every train reply into an error that says so.
    Without a client floor, the mod is inert unless the run config sets ``guard-defense``."""
    guards: dict[tuple, Guard] = {}

    def mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not _is_train(message):
            return call_next(message, context)
        try:
            floor = client_minimum(context, minimum, node_prefix)
            config = guard_config_from_run_config(context.run_config, prefix) or floor
        except ValueError as error:
            return error_reply(message, f"bad guard configuration: {error}")
        if config is None:
            return call_next(message, context)
        if floor is not None:
            weaker = weaker_fields(config, floor)
            if weaker:
                return error_reply(message, "the run config would lower the client's guard: " + "; ".join(weaker))
        key = config.model_dump_json()
        if key not in guards:
            guards[key] = Guard(config)
        return _guarded_call(guards[key], message, context, call_next)

    return mod


__all__ = ["guard_mod", "guard_mod_from_run_config", "guard_run_config", "guard_config_from_run_config", "weaker_fields", "client_minimum", "guard_step", "GuardDropped", "GuardSession", "session_problem",
           "active_session", "round_metrics",
           "METRIC_KEYS"]
