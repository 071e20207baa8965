"""What a guarded training loop did since its last optimizer step: the guarded model's forward passes (with gradients
on) and the criterion calls on their outputs — what ``make_guarded``'s step measures (``flguard.guard.training``).

Each pass keeps its input, the autocast it ran under and, once the criterion is called on its output, the target —
the output itself, or one tensor of a structured output (a tuple, a dict, Hugging Face's ``ModelOutput``), whose
place the pass keeps (``output_path``) so that the guard measures that part of the model's output (``SelectedOutput``),
and, where the model has train-mode dropout layers, the multipliers its dropouts drew (``flguard.risk.dropout_draws``:
the pass runs under a recording ``DropoutDraws``, which draws each mask as PyTorch would and keeps it; the guard
replays them).
The step then finds the latest passes whose summed gradient is ``.grad``: the last pass alone (an ordinary step, or a
``GradScaler`` that skipped earlier steps whose gradients were thrown away), or several (gradient accumulation over
micro-batches, measured as one batch). At most ``MAX_PASSES`` are kept, so a loop that evaluates with gradients on
holds a bounded number of inputs and no graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flguard.guard.failure import GuardFailure
from flguard.risk.dropout_draws import DropoutDraws, active_dropouts
from flguard.risk.functional import uncompiled
from flguard.risk.precision import AutocastState, autocast_state

#: The forward passes kept since the last step (the latest ones): gradient accumulation over more micro-batches than
#: this is refused as a gradient that no kept run of passes explains.
MAX_PASSES = 64


class GuardMisuse(GuardFailure):
    """The training loop does something the guard cannot cover; the message says what and how to fix it."""


@dataclass
class RecordedPass:
    """One forward pass: its input and autocast, and the target of the criterion call on its output (None: none)."""
    args: tuple
    kwargs: dict
    autocast: AutocastState
    target: Any = None
    scalar: bool = True  # whether that call returned a scalar loss
    path: tuple = ()  # where in the pass's output the criterion's prediction was (() : the output itself)
    draws: tuple = ()  # the multipliers of its train-mode dropouts, in call order (flguard.risk.dropout_draws)
    unreplayable: str = ""  # a dropout call it could not record (then the step is refused, saying why)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of this pass, or ``GuardMisuse`` naming what the guard cannot measure."""
        if self.kwargs or len(self.args) != 1 or not isinstance(self.args[0], torch.Tensor):
            raise GuardMisuse("the guarded model must be called with one input tensor, model(x)")
        if not isinstance(self.target, torch.Tensor):
            raise GuardMisuse("the criterion's target must be a tensor")
        if not self.scalar:
            raise GuardMisuse("the guarded criterion must return a scalar (reduction='mean' or 'sum'): with "
                              "reduction='none' the guard cannot see the loss you backpropagate")
        if self.unreplayable:
            raise GuardMisuse(f"a train-mode dropout the guard cannot replay: {self.unreplayable}")
        return self.args[0].detach(), self.target.detach()


class Recorder:
    """The passes and criterion calls since the last optimizer step (module doc); ``paused`` while the guard runs
    the model itself."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.paused = False
        self._drawing: DropoutDraws | None = None  # the recording mode of the pass under way
        self._depth = 0  # calls of the model under way inside that pass (a model that calls itself)
        self.clear()

    def clear(self) -> None:
        self.count = 0  # passes since the last step, kept or not
        self.calls = 0  # criterion calls since the last step, on a pass's output or not
        self.derived = False  # a criterion call whose prediction was computed from a pass's output
        self.passes: list[RecordedPass] = []
        self.output: Any = None  # the latest pass's output, until the criterion is called on it

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._drawing is not None:  # a call inside the recorded pass: its dropouts are that pass's
            self._depth += 1
            return
        if self.paused or not torch.is_grad_enabled():
            return
        self.count += 1
        self.passes = [*self.passes[-(MAX_PASSES - 1):], RecordedPass(args, kwargs, autocast_state())]
        self.output = None
        if active_dropouts(self.model):  # its masks drawn here and kept, to be replayed by the guard
            self._drawing, self._depth = DropoutDraws(), 1
            self._drawing.__enter__()

    def after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """After every pass, also one that raised (the hook is registered with ``always_call``)."""
        if self._drawing is not None:
            self._depth -= 1
            if self._depth > 0:
                return
            drawing, self._drawing = self._drawing, None
            drawing.__exit__(None, None, None)
            self.passes[-1].draws = tuple(drawing.draws)
            self.passes[-1].unreplayable = drawing.problem
        if self.paused or not torch.is_grad_enabled():
            return
        self.output = output

    def criterion_called(self, prediction: Any, target: Any, loss: torch.Tensor) -> None:
        if self.paused or not torch.is_grad_enabled():
            return
        self.calls += 1
        path = None if self.output is None else output_path(self.output, prediction)
        if path is None and self.output is not None:
            self.derived = self.derived or computed_from(prediction, self.output)
        if path is not None:
            self.passes[-1].target, self.passes[-1].scalar, self.passes[-1].path = target, loss.ndim == 0, path
            self.output = None  # the pass's graph is the loss's now; nothing of it kept here

    def last(self) -> RecordedPass:
        """The last pass, on whose output the last criterion call was made, or ``GuardMisuse`` saying why not."""
        if not self.passes:
            raise GuardMisuse("optimizer.step() without a forward pass of the guarded model since the last step "
                              "(with gradients enabled): the guard has no batch to measure")
        if self.passes[-1].target is None:  # no criterion call on its output
            if not self.calls:
                raise GuardMisuse("optimizer.step() without a call of the guarded criterion: the guard cannot see "
                                  "the loss you backpropagated — compute the loss with the criterion make_guarded "
                                  "returned")
            if self.derived:
                raise GuardMisuse("the guarded criterion's prediction was computed from the guarded model's output "
                                  "outside the model (out.squeeze(1), F.log_softmax(out, 1), …): the guard measures "
                                  "criterion(model(x), y) and must see that computation — fold it into the criterion "
                                  "given to make_guarded (lambda out, y: "
                                  "F.binary_cross_entropy_with_logits(out.squeeze(1), y)) or into the model's forward")
            raise GuardMisuse("the guarded criterion was not called on the guarded model's output: the guard cannot "
                              "see the loss you backpropagated — use loss = criterion(model(x), y), or one tensor of "
                              "a structured output as it is (criterion(model(x)['logits'], y))")
        self.passes[-1].batch()  # its misuse, if any, named now
        return self.passes[-1]

    def runs(self) -> list[list[RecordedPass]]:
        """The runs of latest passes that ``.grad`` may hold, shortest first: the last pass, the last two, … while
        each has its criterion call."""
        runs, start = [], len(self.passes) - 1
        while start >= 0 and self.passes[start].target is not None:
            runs.append(self.passes[start:])
            start -= 1
        return runs


#: How deep ``output_path`` looks into a model's structured output (a tuple of a dict, …) for the criterion's input.
OUTPUT_DEPTH = 3


def output_path(output: Any, prediction: Any, depth: int = OUTPUT_DEPTH) -> tuple | None:
    """The keys and indices that lead from a model's ``output`` to the very tensor ``prediction`` (``()`` where it is
    the output itself), through tuples, lists (named tuples: torchvision's GoogLeNet) and mappings (dicts, Hugging
    Face's ``ModelOutput``); None where it is not in it."""
    if prediction is output:
        return ()
    if depth == 0 or isinstance(output, torch.Tensor):
        return None
    for key, value in _parts(output):
        inner = output_path(value, prediction, depth - 1)
        if inner is not None:
            return (key, *inner)
    return None


#: How many autograd nodes ``computed_from`` walks back from a prediction looking for the model's output.
DERIVATION_NODES = 64


def _parts(output: Any):
    """(key or index, value) of a structured output: a mapping's items, a tuple's or list's entries; none otherwise."""
    if isinstance(output, Mapping):
        return output.items()
    return enumerate(output) if isinstance(output, (tuple, list)) else ()


def _tensors(output: Any, depth: int = OUTPUT_DEPTH) -> list[torch.Tensor]:
    """The tensors of a model's output, as deep as ``output_path`` looks."""
    if isinstance(output, torch.Tensor):
        return [output]
    return [] if depth == 0 else [t for _, value in _parts(output) for t in _tensors(value, depth - 1)]


def computed_from(prediction: Any, output: Any) -> bool:
    """Whether ``prediction``'s autograd graph reaches, within DERIVATION_NODES nodes, the node that made a tensor of
    ``output`` (a model's output, possibly structured): the prediction was computed from it (a reason's hint)."""
    made = {t.grad_fn for t in _tensors(output) if t.grad_fn is not None}
    start = getattr(prediction, "grad_fn", None)
    frontier, seen = ([start] if start is not None else []), set()
    while frontier and len(seen) < DERIVATION_NODES:
        node = frontier.pop()
        if node in made:
            return True
        seen.add(node)
        frontier += [parent for parent, _ in node.next_functions if parent is not None and parent not in seen]
    return False


def select(output: Any, path: tuple) -> Any:
    """The part of ``output`` at ``path`` (``output_path``'s)."""
    for key in path:
        output = output[key]
    return output


class SelectedOutput(nn.Module):
    """``model`` whose output is the part at ``path`` of its own (where the user's criterion took its prediction): the
    model the guard measures for a model with a structured output. The same parameters, in the same order; a
    ``torch.compile``'d model runs as its original module (``flguard.risk.functional.uncompiled``)."""

    def __init__(self, model: nn.Module, path: tuple) -> None:
        super().__init__()
        self.model = uncompiled(model)
        self.path = path

    def forward(self, x: torch.Tensor) -> Any:
        return select(self.model(x), self.path)


__all__ = ["GuardMisuse", "MAX_PASSES", "RecordedPass", "Recorder", "SelectedOutput", "output_path", "select",
           "OUTPUT_DEPTH"]
