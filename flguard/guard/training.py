"""``make_guarded``: guard an unchanged PyTorch training loop, the way Opacus's ``make_private`` does DP-SGD.

    model, optimizer, criterion = make_guarded(model, optimizer, criterion, GuardConfig(...))
    for x, y in loader:                      # the user's loop, unchanged
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()                     # the guarded gradient of (x, y) is what gets applied

How: the model is returned as the same object with two hooks that record the input and output of
each forward pass run with gradients on; the criterion is wrapped so that it records the targets
and the loss it returned. ``optimizer.step()`` then

1. takes the forward passes since the last step, each with the criterion call on its output
   (``flguard.guard.recorder``; else: no pass, no criterion call, or a loss the wrapper cannot see —
   each a clear ``GuardMisuse``);
2. recomputes the gradient of ``criterion(model(x), y)`` for the last pass — then the last two, … —
   each under the ``torch.autocast`` it ran under, and requires the parameters' ``.grad`` to equal
   one of these sums: the last pass alone (earlier passes whose gradients were thrown away, as by a
   ``GradScaler`` that skipped a step, are fine), or several (gradient accumulation over
   micro-batches of one size, guarded as one batch of all their samples with the summed loss). A
   loss with extra terms, a missing ``zero_grad``, a gradient rescaled after ``backward``
   (``clip_grad_norm_``, a ``GradScaler`` not updated) match none and are refused, each named — the
   guard must measure the very loss that was sent (one float32 pass under per-sample clipping is checked
   against the guard's own gradient of its loss instead, ``CHECK_IN_GUARD``, and recomputed only where that
   does not explain ``.grad``);
3. runs ``Guard.protect`` on that gradient — of the model's trainable parameters that the optimizer holds,
   what its step applies (``flguard.guard.held_parameters``: fine-tuning with a frozen backbone or a head-only
   optimizer) — in float32 (a mixed-precision loop's forward pass is
   recomputed without autocast: the guard measures and sends float32, and the optimizer applies
   the guarded float32 gradient); a withheld update raises ``GuardFailure`` with the
   reason, clears ``.grad`` and leaves the parameters untouched — an unguarded step is never
   applied;
4. writes the guarded gradient into ``.grad`` and lets the wrapped optimizer (SGD with or without
   momentum, Adam, AdamW, …) take its step. Momentum and Adam's moments then only ever see guarded
   gradients, so the update is post-processing of guarded data.

Under ``flguard.flower.guard_mod`` each step's report is also filed with the round's session, so
the mod can check that every optimizer step of the round was guarded. With ``config=None`` the
optimizer uses the session's guard (the mod's configuration).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch import nn

from flguard.guard import Guard, GuardFailure
from flguard.guard.failure import UnexplainedGradient, failure_reason
from flguard.guard.config import GuardConfig
from flguard.guard.gradient_match import GRADIENT_MATCH_RTOL, refuse_gradient, same_gradient
from flguard.guard.held_parameters import (check_held, clear_unmeasured, held_parameters, measuring_only,
                                          require_own)
from flguard.guard.model_check import STRUCTURAL, UnsupportedModel, require_supported
from flguard.guard.recorder import GuardMisuse, RecordedPass, Recorder, SelectedOutput, select
from flguard.guard.report import GuardReport
from flguard.guard.session import active_session
from flguard.guard.trial_step import momentum_gain, trial_displacement
from flguard.risk.dropout_draws import DropoutDraws, check_batch, probe_shapes
from flguard.risk.precision import AutocastState, autocast_as

#: ``make_guarded`` warns about an Adam-family optimizer above this learning rate: under the guard's noise each of its
#: steps moves every weight by about lr whatever the gradient's scale. Measured on Flower's PyTorch template (a fresh
#: Adam at lr 0.01 each round), trained from scratch: 26.6–28.0% guarded against 51.8% unguarded; at lr 1e-3 50.4%
#: against 54.8% (docs/results.md, "Adam's own step, measured on a copy").
ADAPTIVE_LR_WARNING = 2e-3
ADAPTIVE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax)
#: A step of one pass and one criterion call, in float32, with per-sample clipping, checks ``.grad`` against the guard's
#: own gradient of the batch loss — the sum of the per-sample gradients its clipping takes anyway — instead of first
#: recomputing the pass's gradient: where the two differ (rounding beyond ``GRADIENT_MATCH_RTOL``, or a ``.grad`` of
#: something else) the pass is recomputed as before, so the same loops are refused with the same errors. Saves a forward
#: and backward pass a step: on the trained quickstart CNN at B = 32 about 3% of the guarded step (docs/results.md,
#: "The guarded step checks .grad against the guard's own gradient"). False: always recomputed first.
CHECK_IN_GUARD = True


class GuardedCriterion(nn.Module):
    """The user's criterion, unchanged in value, recording the targets and loss of each call.

    Attribute reads fall through to the wrapped criterion (``reduction``, ``weight``, …)."""

    def __init__(self, criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], recorder: Recorder) -> None:
        super().__init__()
        self.criterion = criterion
        self._recorder = recorder

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.criterion(prediction, target)
        self._recorder.criterion_called(prediction, target, loss)
        return loss

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("criterion", self.__dict__.get("criterion"))
            if inner is None:
                raise
            return getattr(inner, name)


class GuardedOptimizer(torch.optim.Optimizer):
    """The user's optimizer whose ``step()`` applies only the guarded gradient of the recorded batch.

    Shares ``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer (schedulers and
    ``state_dict`` work as before); ``guard_reports`` keeps one ``GuardReport`` per step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, criterion: Callable,
                 recorder: Recorder, guard: Guard | None) -> None:
        # Optimizer.__init__ is not called on purpose: the wrapped optimizer owns the parameters
        # and its step (hooked by torch) is the one that runs.
        self.original_optimizer = optimizer
        self.guard_reports: list[GuardReport] = []
        self._model, self._criterion, self._recorder, self._guard = model, criterion, recorder, guard

    # -- the optimizer interface, delegated ---------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> dict:  # type: ignore[override]
        return self.original_optimizer.state

    @state.setter
    def state(self, value: dict) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.original_optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]  # (a generator, such as model.layer4.parameters(), read once)
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        require_own(self._model, params, "add_param_group")
        self.original_optimizer.add_param_group({**param_group, "params": params})

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.original_optimizer!r})"

    # -- the guarded step ------------------------------------------------------------------------
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        """Guard the recorded batch's gradient, put it in ``.grad`` and step the wrapped optimizer."""
        if closure is not None:
            raise GuardMisuse("optimizer.step(closure) is not supported by the guard (it would re-evaluate the "
                              "loss on its own); use loss.backward(); optimizer.step()")
        params, idle = held_parameters(self._model, self.original_optimizer)
        try:
            if not params:
                raise GuardMisuse("optimizer.step(): the optimizer holds none of the model's trainable parameters "
                                  "(requires_grad): there is no update to guard")
            with measuring_only(idle):  # the certificate is on what this optimizer applies, and nothing else
                guarded = self._guarded_gradient(params)
        except Exception as error:  # never leave the unguarded gradient where a later step could apply it
            for p in params:
                p.grad = None
            if isinstance(error, GuardFailure):
                raise
            raise GuardMisuse(f"optimizer.step() could not measure the step: {failure_reason(error)}") from error
        finally:
            self._recorder.clear()
            # before the wrapped step: a frozen parameter's stale .grad, and the idle ones', never applied
            clear_unmeasured(self.original_optimizer, params, idle)
        for p, g in zip(params, guarded.split([p.numel() for p in params])):
            p.grad = g.view_as(p).to(p.dtype).clone()
        self.original_optimizer.step()

    def _guarded_gradient(self, params: list[nn.Parameter]) -> torch.Tensor:
        guard = self._active_guard()
        last = self._recorder.last()
        _refuse_unsupported(self._model)
        sent = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        if self._checked_by_guard(guard, last, sent):  # .grad checked against the guard's own gradient (CHECK_IN_GUARD)
            try:
                return self._protected(guard, params, [last], sent, last)
            except UnexplainedGradient:
                pass  # the passes recomputed one by one, as below
        run, reference = self._explaining_run(params, sent, last)
        if any(recorded.autocast for recorded in run):  # the guard measures and sends float32: recomputed without it
            path = _one_path(run)
            reference = sum(self._recompute(params, *recorded.batch(), (), path, recorded.draws) for recorded in run)
        return self._protected(guard, params, run, reference)

    def _checked_by_guard(self, guard: Guard, last: RecordedPass, sent: torch.Tensor) -> bool:
        """Whether the step may check ``.grad`` (``sent``) against the guard's own gradient of the batch loss instead
        of recomputing the last pass first (``CHECK_IN_GUARD``): one pass since the last step, one criterion call on
        it, no autocast, per-sample clipping (which takes the per-sample gradients anyway), the default ``drop``
        policy (nothing unchecked can be sent) and a finite ``.grad``."""
        cfg = guard.config
        return (CHECK_IN_GUARD and self._recorder.count == 1 and self._recorder.calls == 1 and not last.autocast
                and cfg.clip_per_sample is not None and cfg.on_unmet == "drop" and bool(torch.isfinite(sent).all()))

    def _explaining_run(self, params: list[nn.Parameter], sent: torch.Tensor,
                        last: RecordedPass) -> tuple[list[RecordedPass], torch.Tensor]:
        """The run of latest passes whose gradient is ``.grad`` (``sent``), with that gradient (``_run_in_grad``), or
        the ``GuardMisuse`` that names why none is."""
        run, as_recorded = self._run_in_grad(params, sent)
        if run is None:  # as_recorded: the last pass's own gradient
            refuse_gradient(sent, as_recorded, last.autocast, self._recorder.count, self._recorder.calls)
        return run, as_recorded

    def _explains(self, params: list[nn.Parameter], last: RecordedPass, sent: torch.Tensor,
                  measured: torch.Tensor) -> bool:
        """``Guard.protect``'s ``check_gradient``: whether ``.grad`` (``sent``) is the gradient of the last pass's
        loss — the guard's own, c·Σ_i∇ℓ_i (``measured``), to ``same_gradient``'s tolerance, or where rounding in that
        sum puts it outside, the pass recomputed as ``_run_in_grad`` does."""
        if same_gradient(sent, measured.to(sent), ()):
            return True
        return same_gradient(sent, self._recompute(params, *last.batch(), (), last.path, last.draws), ())

    def _protected(self, guard: Guard, params: list[nn.Parameter], run: list[RecordedPass], reference: torch.Tensor,
                   checked: RecordedPass | None = None) -> torch.Tensor:
        """The guarded gradient of the passes ``run`` (their summed loss as one batch's), ``reference`` their gradient
        as given to ``Guard.protect``; ``GuardFailure`` where it is withheld. ``checked``: the one pass whose gradient
        ``reference`` (``.grad``) has not been checked to be — the guard checks it (``_explains``), and where the step
        fails before that, it is checked here as without ``CHECK_IN_GUARD`` before the failure is reported: a loop's
        misuse is named first either way."""
        x, y = (torch.cat(parts) for parts in zip(*(recorded.batch() for recorded in run)))
        path = _one_path(run)
        draws = _run_draws(run, int(x.shape[0]), self._probe) if any(recorded.draws for recorded in run) else ()
        loss_fn = self._criterion if len(run) == 1 else self._accumulated_loss(run, x, y, path)
        measured = self._model if not path else SelectedOutput(self._model, path)  # a structured output's part
        asked: list[bool] = []

        def check(gradient: torch.Tensor) -> bool:
            asked.append(True)
            return self._explains(params, checked, reference, gradient)
        self._recorder.paused = True
        try:
            step_size = self._sgd_step_size()
            # other optimizers: their own next step, measured on a copy (``auto`` judges the noise's damage to it)
            step_rule = (trial_displacement(self.original_optimizer, params)
                         if step_size is None and guard.config.clip_per_sample == "auto" else None)
            out = guard.protect(measured, x, y, reference, loss_fn=loss_fn, step_size=step_size, step_rule=step_rule,
                                draws=draws, check_gradient=None if checked is None else check)
        finally:
            self._recorder.paused = False
        if checked is not None and not asked:  # withheld before the guard took its gradient: .grad checked now
            self._explaining_run(params, reference, checked)
        if len(run) > 1:
            out.report.details["micro_batches"] = len(run)  # accumulated, measured as one batch
        self.guard_reports.append(out.report)
        session = active_session()
        if session is not None:
            session.file(out.report)
        if out.gradient is None:
            failure = GuardFailure(out.report.reason)
            failure.report = out.report  # type: ignore[attr-defined]
            raise failure
        return out.gradient.reshape(-1)

    def _run_in_grad(self, params: list[nn.Parameter],
                     sent: torch.Tensor) -> tuple[list[RecordedPass] | None, torch.Tensor]:
        """The shortest run of latest passes whose summed gradient (each under its own autocast) is .grad, with that
        sum; where none is, None and the last pass's own gradient, which the refusal is named against
        (``flguard.guard.recorder``)."""
        total: torch.Tensor | None = None
        last: torch.Tensor | None = None
        for run in self._recorder.runs():
            first = run[0]
            part = self._recompute(params, *first.batch(), first.autocast, first.path, first.draws)
            total, last = (part, part) if total is None else (total + part, last)
            if same_gradient(sent, total, tuple(a for recorded in run for a in recorded.autocast)):
                return run, total
        assert last is not None  # runs() starts with the last pass, which ``Recorder.last`` checked
        return None, last

    def _accumulated_loss(self, run: list[RecordedPass], x: torch.Tensor, y: torch.Tensor, path: tuple) -> Callable:
        """The loss of the micro-batches of ``run`` as one batch (x, y): their summed losses, which for equal
        micro-batches of a mean loss is k × the criterion on all of them (of a sum, the criterion), checked on
        the model's outputs; ``GuardMisuse`` where no such loss exists."""
        sizes = [int(recorded.batch()[1].shape[0]) for recorded in run]
        if len(set(sizes)) != 1:
            raise GuardMisuse(f"{len(run)} forward passes of the guarded model accumulated in .grad over micro-batches "
                              f"of different sizes {sizes}: the guard measures accumulated micro-batches as one batch, "
                              "which needs one size — drop the incomplete last batch (DataLoader(drop_last=True))")
        factor = float(len(run)) if getattr(self._criterion, "reduction", "mean") == "mean" else 1.0
        criterion = self._criterion

        def accumulated(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return factor * criterion(prediction, target)
        self._recorder.paused = True
        try:
            with torch.no_grad(), autocast_as(()):  # the loss the guard measures, in float32
                whole = select(self._model(x), path)
                parts = [criterion(chunk, target) for chunk, target in zip(whole.split(sizes), y.split(sizes))]
                gap, total = abs(float(accumulated(whole, y)) - float(sum(parts))), abs(float(sum(parts)))
        finally:
            self._recorder.paused = False
        if not gap <= 1e-4 * total + 1e-12:
            raise GuardMisuse(f"{len(run)} micro-batches accumulated in .grad whose losses do not add up to one loss "
                              "over their samples (a class-weighted mean divides each by its own total weight): the "
                              "guard cannot measure them as one batch — step once per batch, or use reduction='sum'")
        return accumulated

    def _sgd_step_size(self) -> float | None:
        """``Guard.protect``'s ``step_size`` for a ``torch.optim.SGD`` (``auto`` judges how far its noise moves
        the parameters): the largest over the groups of lr × the root mean square of one step's response to
        independent unit noise, ``momentum_gain``. None for other optimizers, whose step is not lr × the
        gradient (Adam's is normalised per coordinate: ``flguard.guard.trial_step`` measures those steps)."""
        groups = self.param_groups
        if not isinstance(self.original_optimizer, torch.optim.SGD) or any(
                float(group.get("momentum", 0.0)) >= 1.0 for group in groups):
            return None  # (momentum ≥ 1 has no stationary root mean square: no move to judge)
        return max(float(group["lr"]) * momentum_gain(float(group.get("momentum", 0.0)),
                                                      float(group.get("dampening", 0.0)),
                                                      bool(group.get("nesterov", False))) for group in groups)

    def _active_guard(self) -> Guard:
        if self._guard is not None:
            return self._guard
        session = active_session()
        if session is None:
            raise GuardMisuse("make_guarded(..., config=None) takes its configuration from flguard.flower.guard_mod, "
                              "but no guarded Flower train message is being handled; pass a GuardConfig")
        return session.guard

    @contextmanager
    def _unrecorded(self) -> Iterator[None]:
        """The guard's own passes of the model: not recorded, its buffers (BatchNorm running statistics) left as they
        were."""
        buffers = {name: b.detach().clone() for name, b in self._model.named_buffers()}
        paused, self._recorder.paused = self._recorder.paused, True  # (inside the guard's step: stays paused)
        try:
            yield
        finally:
            self._recorder.paused = paused
            with torch.no_grad():
                for name, b in self._model.named_buffers():
                    b.copy_(buffers[name])

    def _probe(self, mode: DropoutDraws, x: torch.Tensor) -> None:
        """The model on ``x`` under ``mode`` (a probing ``DropoutDraws``), unrecorded."""
        with self._unrecorded(), mode:
            self._model(x)

    def _recompute(self, params: list[nn.Parameter], x: torch.Tensor, y: torch.Tensor,
                   autocast: AutocastState, path: tuple = (), draws: tuple = ()) -> torch.Tensor:
        """∇θ criterion(the part at ``path`` of model(x), y) with ``autocast`` as given (``()``: float32) and the
        pass's dropout masks replayed (``draws``), leaving buffers (BatchNorm running statistics) as they were."""
        with self._unrecorded(), torch.enable_grad(), autocast_as(autocast):
            with DropoutDraws(draws) as replay:
                output = self._model(x)
            replay.finish()
            loss = self._criterion(select(output, path), y)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(p)).detach().reshape(-1)
                          for g, p in zip(grads, params)])


def _one_path(run: list[RecordedPass]) -> tuple:
    """The place in the model's output of the passes' criterion calls: one for all (``GuardMisuse`` otherwise)."""
    paths = {recorded.path for recorded in run}
    if len(paths) != 1:
        raise GuardMisuse(f"{len(run)} micro-batches accumulated in .grad whose losses took different parts of the "
                          f"model's output {sorted(paths, key=str)}: the guard measures one part")
    return paths.pop()


def _run_draws(run: list[RecordedPass], batch: int,
               probe: Callable[[DropoutDraws, torch.Tensor], None]) -> tuple[torch.Tensor, ...]:
    """The dropout multipliers of the passes of ``run`` as one batch's (each dropout's, batch first, concatenated
    over the micro-batches), each mask's batch found from a one-sample pass (``probe(mode, x)``); ``GuardMisuse``
    where the passes called different numbers of dropouts, or where a dropout's batch cannot be told or its layout
    differs between the passes (``flguard.risk.dropout_draws.check_batch``)."""
    counts = {len(recorded.draws) for recorded in run}
    if len(counts) != 1:
        raise GuardMisuse(f"{len(run)} micro-batches accumulated in .grad whose forward passes called different "
                          f"numbers of train-mode dropouts {sorted(counts)}: the guard measures them as one batch")
    try:
        one = probe_shapes(lambda mode: probe(mode, run[0].args[0][:1]))
        passes = [check_batch(recorded.draws, int(recorded.args[0].shape[0]), one) for recorded in run]
        for parts in zip(*passes):
            if len({part.shape[1:] for part in parts}) != 1:
                shapes = [tuple(p.shape) for p in parts]
                raise ValueError(f"a train-mode dropout whose masks have shapes {shapes} in the accumulated "
                                 "micro-batches: the guard cannot tell which dimension is the batch in all")
        return tuple(torch.cat(parts) for parts in zip(*passes))
    except ValueError as error:
        raise GuardMisuse(str(error)) from error


def _warn_adaptive_lr(optimizer: torch.optim.Optimizer) -> None:
    """A ``UserWarning`` for an Adam-family optimizer above ``ADAPTIVE_LR_WARNING`` (its measured cost)."""
    lr = max(float(group["lr"]) for group in optimizer.param_groups)
    if isinstance(optimizer, ADAPTIVE_OPTIMIZERS) and lr > ADAPTIVE_LR_WARNING:
        warnings.warn(f"make_guarded: {type(optimizer).__name__} at lr {lr:g}: under the guard's noise each step moves "
                      "every weight by about lr, whatever the gradient's scale — Flower's PyTorch template (Adam, lr "
                      "0.01) trained from scratch to 26.6–28.0% guarded against 51.8% unguarded, and to 50.4% "
                      "(54.8%) at lr 1e-3; use lr ≤ 1e-3 or SGD (docs/guard.md, 'Adam and other optimizers')",
                      UserWarning, stacklevel=3)


def _refuse_unsupported(model: nn.Module) -> None:
    """At every step: the model's mode may have changed since ``make_guarded`` (``model.train()``
    re-enables a stochastic-depth layer): refuse what ``check_model`` lists, as a ``GuardMisuse`` naming it."""
    try:
        require_supported(model, "optimizer.step() (flguard.check_model)")
    except UnsupportedModel as error:
        raise GuardMisuse(str(error)) from error


def make_guarded(model: nn.Module, optimizer: torch.optim.Optimizer,
                 criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 config: GuardConfig | None = None) -> tuple[nn.Module, GuardedOptimizer, GuardedCriterion]:
    """Guard an ordinary ``loss.backward(); optimizer.step()`` loop (see module doc).

    Returns ``(model, optimizer, criterion)``: the same model object (with recording hooks; its
    ``state_dict`` and behaviour are unchanged), a ``GuardedOptimizer`` and a ``GuardedCriterion``.
    ``config`` builds this optimizer's own ``Guard`` (one noise stream for its lifetime); ``None``
    uses the guard of the enclosing ``flguard.flower.guard_mod`` at each step.

    A model with BatchNorm (or InstanceNorm with running statistics) is refused here with
    ``UnsupportedModel``, which names the modules and ``flguard.fix_model``; a train-mode random layer that the
    guard does not replay (alpha dropout, stochastic depth before ``fix_model``), whose mode can still change, is
    refused at the step (``GuardMisuse``). PyTorch's ``nn.Dropout`` and ``nn.Dropout1d/2d/3d``, attention dropout and
    ``fix_model``'s stochastic depth train as they are: each pass's masks are recorded and replayed in every pass the
    guard differentiates (``flguard.risk.dropout_draws``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError("make_guarded: model must be a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, GuardedOptimizer):
        raise TypeError("make_guarded: optimizer must be a plain torch.optim.Optimizer (not already guarded)")
    if not callable(criterion):
        raise TypeError("make_guarded: criterion must be callable as criterion(prediction, target)")
    require_supported(model, "make_guarded", STRUCTURAL)  # BatchNorm: refused before the first step
    check_held(model, optimizer)
    _warn_adaptive_lr(optimizer)
    recorder = getattr(model, "_flguard_recorder", None)
    if recorder is None:  # a model guarded again (a new optimizer per round) keeps its one pair of hooks
        recorder = Recorder(model)
        model.register_forward_pre_hook(recorder.before_forward, with_kwargs=True)
        model.register_forward_hook(recorder.after_forward, with_kwargs=True, always_call=True)
        model._flguard_recorder = recorder  # type: ignore[attr-defined]
    recorder.clear()
    guarded_criterion = GuardedCriterion(criterion, recorder)
    guard = Guard(config) if config is not None else None
    return model, GuardedOptimizer(optimizer, model, criterion, recorder, guard), guarded_criterion


__all__ = ["make_guarded", "GuardedOptimizer", "GuardedCriterion", "GuardMisuse", "GRADIENT_MATCH_RTOL",
           "UnsupportedModel"]
