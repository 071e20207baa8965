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

1. takes the last forward pass since the last step and the last criterion call, which must have
   seen that forward's output (else: no pass, no criterion call, or a loss the wrapper cannot see —
   each a clear ``GuardMisuse``);
2. recomputes the gradient of ``criterion(model(x), y)`` — under the same ``torch.autocast`` as the
   recorded pass — and requires the parameters' ``.grad`` to equal it: a loss with extra terms,
   gradients accumulated over several batches (a missing ``zero_grad``, or several passes before
   one step), a gradient rescaled after ``backward`` (``clip_grad_norm_``, a ``GradScaler`` not
   updated) differ and are refused, each named — the guard must measure the very loss that was
   sent. Earlier passes whose gradients were discarded (a ``GradScaler`` that skipped a step on
   infinite gradients, then ``zero_grad``) are fine: .grad holds only the last one's;
3. runs ``Guard.protect`` on that gradient in float32 (a mixed-precision loop's forward pass is
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
from typing import Any, Callable

import torch
from torch import nn

from flguard.guard import Guard, GuardFailure
from flguard.guard.config import GuardConfig
from flguard.guard.model_check import STRUCTURAL, UnsupportedModel, require_supported
from flguard.guard.report import GuardReport
from flguard.guard.session import active_session
from flguard.guard.trial_step import momentum_gain, trial_displacement
from flguard.risk.precision import AutocastState, autocast_as, autocast_state, gradient_rtol

#: ‖.grad − ∇θ criterion(model(x), y)‖ ≤ this × ‖∇θ …‖ (+ a tiny absolute slack) counts as "the same
#: loss": the recomputation runs the same operations on the same data, so only float reordering differs
#: (for a float32 gradient on a CUDA device, TF32 and cuDNN's choice of algorithm: ``gradient_rtol``).
GRADIENT_MATCH_RTOL = 1e-4
#: .grad = s × ∇θ … to this relative residual, s ≠ 1 by more than it: a gradient rescaled after ``backward`` (a
#: global norm clipping, or a GradScaler's scale left in), which the refusal then names.
RESCALED_RTOL = 1e-3
#: ``make_guarded`` warns about an Adam-family optimizer above this learning rate: under the guard's noise each of its
#: steps moves every weight by about lr whatever the gradient's scale. Measured on Flower's PyTorch template (a fresh
#: Adam at lr 0.01 each round), trained from scratch: 26.6–28.0% guarded against 51.8% unguarded; at lr 1e-3 50.4%
#: against 54.8% (docs/results.md, "Adam's own step, measured on a copy").
ADAPTIVE_LR_WARNING = 2e-3
ADAPTIVE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax)


class GuardMisuse(GuardFailure):
    """The training loop does something the guard cannot cover; the message says what and how to fix it."""


class _Recorder:
    """What the guarded loop did since the last optimizer step: its last forward pass (with the autocast it ran
    under) and last criterion call, and how many passes there were — only the last of each is kept, so passes
    that are never stepped (an evaluation with gradients on) hold no memory."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.paused = False
        self.clear()

    def clear(self) -> None:
        self.passes = 0
        self.input: tuple[tuple, dict] | None = None
        self.autocast: AutocastState = ()
        self.output: Any = None
        self.call: tuple[Any, Any, torch.Tensor] | None = None  # the criterion's prediction, target and loss

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.paused or not torch.is_grad_enabled():
            return
        self.passes += 1
        self.input, self.autocast, self.output = (args, kwargs), autocast_state(), None

    def after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.paused or not torch.is_grad_enabled():
            return
        self.output = output

    def criterion_called(self, prediction: Any, target: Any, loss: torch.Tensor) -> None:
        if self.paused or not torch.is_grad_enabled():
            return
        self.call = (prediction, target, loss)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor, AutocastState]:
        """The (x, y) of this step's last forward pass and criterion call, with the autocast the pass ran under,
        or ``GuardMisuse`` saying why there is none. Earlier passes are the gradient check's concern (module doc)."""
        if self.input is None:
            raise GuardMisuse("optimizer.step() without a forward pass of the guarded model since the last step "
                              "(with gradients enabled): the guard has no batch to measure")
        if self.call is None:
            raise GuardMisuse("optimizer.step() without a call of the guarded criterion: the guard cannot see the "
                              "loss you backpropagated — compute the loss with the criterion make_guarded returned")
        (args, kwargs), (prediction, target, loss) = self.input, self.call
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise GuardMisuse("the guarded model must be called with one input tensor, model(x)")
        if prediction is not self.output or self.output is None:
            raise GuardMisuse("the guarded criterion was not called on the guarded model's output: the guard cannot "
                              "see the loss you backpropagated — use loss = criterion(model(x), y)")
        if not isinstance(target, torch.Tensor):
            raise GuardMisuse("the criterion's target must be a tensor")
        if loss.ndim != 0:
            raise GuardMisuse("the guarded criterion must return a scalar (reduction='mean' or 'sum'): with "
                              "reduction='none' the guard cannot see the loss you backpropagate")
        return args[0].detach(), target.detach(), self.autocast


class GuardedCriterion(nn.Module):
    """The user's criterion, unchanged in value, recording the targets and loss of each call.

    Attribute reads fall through to the wrapped criterion (``reduction``, ``weight``, …)."""

    def __init__(self, criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], recorder: _Recorder) -> None:
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
                 recorder: _Recorder, guard: Guard | None) -> None:
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
        self.original_optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.original_optimizer!r})"

    # -- the guarded step ------------------------------------------------------------------------
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        """Guard the recorded batch's gradient, put it in ``.grad`` and step the wrapped optimizer."""
        if closure is not None:
            raise GuardMisuse("optimizer.step(closure) is not supported by the guard (it would re-evaluate the "
                              "loss on its own); use loss.backward(); optimizer.step()")
        params = [p for p in self._model.parameters() if p.requires_grad]
        try:
            guarded = self._guarded_gradient(params)
        except GuardFailure:
            for p in params:  # never leave the unguarded gradient where a later step could apply it
                p.grad = None
            raise
        finally:
            self._recorder.clear()
        for p, g in zip(params, guarded.split([p.numel() for p in params])):
            p.grad = g.view_as(p).to(p.dtype).clone()
        self.original_optimizer.step()

    def _guarded_gradient(self, params: list[nn.Parameter]) -> torch.Tensor:
        guard = self._active_guard()
        x, y, autocast = self._recorder.batch()
        _refuse_unsupported(self._model)
        as_recorded = self._recompute(params, x, y, autocast)
        sent = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        _require_same_gradient(sent, as_recorded, autocast, self._recorder.passes)
        # the guard measures and sends float32: a mixed-precision pass is recomputed without autocast
        reference = as_recorded if not autocast else self._recompute(params, x, y, ())
        self._recorder.paused = True
        try:
            step_size = self._sgd_step_size()
            # other optimizers: their own next step, measured on a copy (``auto`` judges the noise's damage to it)
            step_rule = (trial_displacement(self.original_optimizer, params)
                         if step_size is None and guard.config.clip_per_sample == "auto" else None)
            out = guard.protect(self._model, x, y, reference, loss_fn=self._criterion, step_size=step_size,
                                step_rule=step_rule)
        finally:
            self._recorder.paused = False
        self.guard_reports.append(out.report)
        session = active_session()
        if session is not None:
            session.file(out.report)
        if out.gradient is None:
            failure = GuardFailure(out.report.reason)
            failure.report = out.report  # type: ignore[attr-defined]
            raise failure
        return out.gradient.reshape(-1)

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

    def _recompute(self, params: list[nn.Parameter], x: torch.Tensor, y: torch.Tensor,
                   autocast: AutocastState) -> torch.Tensor:
        """∇θ criterion(model(x), y) with ``autocast`` as given (``()``: float32), leaving buffers (BatchNorm running
        statistics) as they were."""
        buffers = {name: b.detach().clone() for name, b in self._model.named_buffers()}
        self._recorder.paused = True
        try:
            with torch.enable_grad(), autocast_as(autocast):
                loss = self._criterion(self._model(x), y)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            self._recorder.paused = False
            with torch.no_grad():
                for name, b in self._model.named_buffers():
                    b.copy_(buffers[name])
        return torch.cat([(g if g is not None else torch.zeros_like(p)).detach().reshape(-1)
                          for g, p in zip(grads, params)])


def _require_same_gradient(sent: torch.Tensor, reference: torch.Tensor, autocast: AutocastState, passes: int) -> None:
    """``GuardMisuse`` unless .grad (``sent``) is the recomputed gradient of the recorded batch, naming the likely
    cause: several passes accumulated, a gradient rescaled after backward, or another loss."""
    gap, scale = float((sent - reference).norm()), float(reference.norm())
    slack = 1e-12 * max(reference.numel(), 1) ** 0.5
    if gap <= gradient_rtol(reference, GRADIENT_MATCH_RTOL, autocast) * scale + slack:
        return
    found = f"‖difference‖ = {gap:.3g}, ‖gradient‖ = {scale:.3g}"
    if passes > 1:
        raise GuardMisuse(f"{passes} forward passes of the guarded model since the last optimizer.step(), and .grad is "
                          f"not the last one's gradient ({found}): gradient accumulation over several batches (or an "
                          "extra forward pass with gradients on) is not supported — step once per batch, and "
                          "evaluate under torch.no_grad()")
    factor = float(sent @ reference) / max(scale ** 2, 1e-300)
    off_line = float((sent - factor * reference).norm())
    if abs(factor - 1.0) > RESCALED_RTOL and off_line <= RESCALED_RTOL * abs(factor) * scale:
        cause = ("a global norm clipping (torch.nn.utils.clip_grad_norm_): the guard clips each sample's gradient "
                 "itself (GuardConfig.clip_per_sample) — remove it from the guarded loop" if factor < 1 else
                 "a GradScaler's scale still in it: call scaler.update() after every scaler.step(optimizer), also "
                 "when the step raised GuardFailure")
        raise GuardMisuse(f".grad is {factor:.4g} × the gradient of criterion(model(x), y) on the recorded batch: "
                          f"{cause}")
    raise GuardMisuse(f".grad differs from the gradient of criterion(model(x), y) on the recorded batch ({found}): a "
                      "loss with terms the guard cannot see, gradients accumulated over several batches (a missing "
                      "optimizer.zero_grad()), a gradient changed after backward (clip_grad_value_), or randomness "
                      "in the forward pass that flguard.check_model cannot list (a functional dropout); the guard "
                      "must measure the exact loss that is sent")


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
    re-enables a Dropout): refuse what ``check_model`` lists, as a ``GuardMisuse`` naming it."""
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
    ``UnsupportedModel``, which names the modules and ``flguard.fix_model``; a train-mode Dropout,
    whose mode can still change, is refused at the step (``GuardMisuse``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError("make_guarded: model must be a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, GuardedOptimizer):
        raise TypeError("make_guarded: optimizer must be a plain torch.optim.Optimizer (not already guarded)")
    if not callable(criterion):
        raise TypeError("make_guarded: criterion must be callable as criterion(prediction, target)")
    require_supported(model, "make_guarded", STRUCTURAL)  # BatchNorm: refused before the first step
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in trainable:
                raise ValueError("make_guarded: the optimizer holds a parameter that is not a trainable parameter "
                                 "of the model; the guard can only cover the model's own gradients")
    _warn_adaptive_lr(optimizer)
    recorder = getattr(model, "_flguard_recorder", None)
    if recorder is None:  # a model guarded again (a new optimizer per round) keeps its one pair of hooks
        recorder = _Recorder(model)
        model.register_forward_pre_hook(recorder.before_forward, with_kwargs=True)
        model.register_forward_hook(recorder.after_forward, with_kwargs=True)
        model._flguard_recorder = recorder  # type: ignore[attr-defined]
    recorder.clear()
    guarded_criterion = GuardedCriterion(criterion, recorder)
    guard = Guard(config) if config is not None else None
    return model, GuardedOptimizer(optimizer, model, criterion, recorder, guard), guarded_criterion


__all__ = ["make_guarded", "GuardedOptimizer", "GuardedCriterion", "GuardMisuse", "GRADIENT_MATCH_RTOL",
           "UnsupportedModel"]
