"""Train-mode dropout as the guard measures it: each mask drawn once, in the pass that made the gradient, and
replayed in every pass the guard differentiates.

A dropout layer multiplies its input by a random multiplier m = b/(1 − p), b ~ Bernoulli(1 − p) — one per element
(``F.dropout``: ``nn.Dropout``; ``torch.dropout``) or one per sample and channel (``F.dropout1d/2d/3d``: ``nn.Dropout1d/2d/3d``). A
fresh draw in each of the guard's passes would make every product a different random map, and the recomputed gradient
not the one sent. With the multipliers of the pass that made the gradient held fixed, sample i's gradient is a
deterministic function of x_i — the very map that produced what the server receives — so its block J_i, the
certificate and the check that the recomputed gradient is ``.grad`` are all about that map (an attacker who does not
know the masks can only do worse than one who does).

``DropoutDraws`` is a function mode with two uses:

* **record** (``DropoutDraws()``): each dropout call draws its multiplier itself (the same distribution as PyTorch's,
  from the same default generator), applies it and keeps it — around the user's forward pass (``make_guarded``'s
  recorder) or the operator's first pass over the batch (``Guard.protect`` without recorded draws);
* **replay** (``DropoutDraws(draws)``): the k-th dropout call of the pass multiplies by the k-th recorded multiplier
  instead of drawing, in the same order; ``finish`` refuses a pass that called fewer. The per-sample passes hand each
  sample its own rows: ``check_batch`` stores every multiplier with the batch first — one drawn on a sequence-first
  (L, N, E) tensor (PyTorch's default transformer layout) too, its batch put back in place on replay (``aligned``).

A dropout call in eval mode or with p = 0 is the identity and draws nothing, in both uses. Attention dropout
(``nn.MultiheadAttention``, ``F.scaled_dot_product_attention``) draws inside PyTorch's kernels: while a pass is
recorded or replayed the attention runs in plain operators (``flguard.risk.functional``) with its weights dropped
through ``F.dropout`` here (``attention_dropout``); so do a stacked recurrent layer's (``nn.LSTM``/``GRU``/``RNN``
with ``dropout`` > 0 between its layers: ``flguard.risk.recurrent``). Stochastic depth (torchvision's
``StochasticDepth``, timm's ``DropPath``) draws with ``bernoulli_`` on a tensor of its own: ``fix_model`` replaces it
by ``ReplayedDropPath``, the same per-sample drop through ``F.dropout``. Other random layers (alpha dropout,
``DropBlock2d``) draw through other functions and stay refused by the model check (``flguard.guard.model_check``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap
from torch.overrides import TorchFunctionMode

from flguard.risk.recurrent import CELLS as RECURRENT_CELLS
from flguard.risk.recurrent import PACKED, drops_between_layers, recurrent

#: The dropout functions replayed, with the number of spatial dimensions that share a multiplier (0: none — one
#: multiplier per element).
DROPOUT_FUNCTIONS = {F.dropout: 0, F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3, torch.dropout: 0}


class ReplayedDropPath(nn.Module):
    """Stochastic depth ("drop path") drawn through ``F.dropout``, so that the guard records and replays it: x·m_i
    with m_i = b_i/(1 − p), b_i ~ Bernoulli(1 − p), one draw per sample (``scale_by_keep=False``: x·b_i, to float
    rounding) — the distribution of torchvision's ``StochasticDepth(p, "row")`` and timm's ``DropPath(p)``, which draw
    with ``bernoulli_`` on a tensor of their own, out of the guard's sight. ``flguard.fix_model`` puts one in each of
    their places."""

    def __init__(self, p: float, scale_by_keep: bool = True) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"ReplayedDropPath: p={p} must be a probability")
        self.p, self.scale_by_keep = float(p), bool(scale_by_keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = F.dropout(x.new_ones((x.shape[0],) + (1,) * (x.dim() - 1)), self.p, True)
        return x * (keep if self.scale_by_keep else keep * (1.0 - self.p))

    @classmethod
    def replacing(cls, module: nn.Module, name: str) -> ReplayedDropPath:
        """The layer for torchvision's ``StochasticDepth`` (row mode) or timm's ``DropPath`` ``module``, in its mode;
        ``ValueError`` naming ``name`` for batch mode, which drops the whole batch with one draw."""
        if type(module).__name__ == "StochasticDepth":
            if module.mode != "row":
                raise ValueError(f"fix_model: {name or '<model>'} is StochasticDepth(mode={module.mode!r}), which "
                                 "drops the whole batch with one draw: the guard replays per-sample draws (mode='row')")
            return cls(module.p).train(module.training)
        return cls(module.drop_prob, getattr(module, "scale_by_keep", True)).train(module.training)

    def extra_repr(self) -> str:
        return f"p={self.p}" + ("" if self.scale_by_keep else ", scale_by_keep=False")


#: The attention functions whose weights' dropout is drawn through ``F.dropout`` here (module doc): where their dropout
#: probability is among the arguments (position, name), and their ``training`` flag's position (None: none).
ATTENTION_DROPOUT_ARGUMENTS = {F.multi_head_attention_forward: ((10, "dropout_p"), 13),
                               F.scaled_dot_product_attention: ((4, "dropout_p"), None)}

#: The layers that draw through them: train-mode instances are guarded with their masks replayed.
REPLAYED_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, ReplayedDropPath)


class DropoutDraws(TorchFunctionMode):
    """Record (``draws`` None) or replay (``draws`` given) the multipliers of a pass's dropout calls (module doc);
    ``probe``: neither — each call's multiplier shape is noted in ``shapes`` and nothing is drawn or dropped
    (``probe_shapes``)."""

    def __init__(self, draws: Sequence[torch.Tensor] | None = None, *, probe: bool = False) -> None:
        super().__init__()
        self.replaying, self.probing = draws is not None, probe
        self.draws: list[torch.Tensor] = list(draws) if draws is not None else []
        self.shapes: list[torch.Size] = []
        self.used = 0
        self.problem = ""  # record: a call it could not record (the pass then cannot be guarded)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        spatial = DROPOUT_FUNCTIONS.get(func)
        if spatial is None and func in RECURRENT_CELLS:
            return self._recurrent(func, args, kwargs)
        if spatial is None:
            return self._attention(func, args, kwargs) if func in ATTENTION_DROPOUT_ARGUMENTS else func(*args, **kwargs)
        given = {**dict(zip(("input", "p", "training", "inplace"), args)), **kwargs}
        given.setdefault("training", given.get("train", True))  # torch.dropout(input, p, train)
        p, inputs = float(given.get("p", 0.5)), given["input"]
        if not given.get("training", True) or p == 0:
            return func(*args, **kwargs)
        if self.probing:
            self.shapes.append(torch.Size(inputs.shape if spatial == 0 else (*inputs.shape[:2], *(1,) * spatial)))
            return inputs
        if self.replaying:
            if self.used == len(self.draws):
                raise ValueError(f"a train-mode {func.__name__} that the recorded pass did not call (it drew "
                                 f"{len(self.draws)} masks): the guard replays the masks of the pass that made the "
                                 "gradient, in order — the model's forward pass must call the same dropouts each time, "
                                 "and make_guarded records them where the model has an nn.Dropout layer (or an "
                                 "nn.MultiheadAttention with dropout) in train mode (a dropout called as a function in "
                                 "a model without one is not recorded: use nn.Dropout)")
            multiplier = aligned(self.draws[self.used], inputs)
            self.used += 1
            return inputs * multiplier  # out of place: the guard's passes differentiate through the input
        if spatial and inputs.dim() != spatial + 2:
            self.problem = (f"{func.__name__} on a {inputs.dim()}-d input (the guard replays it on batched "
                            f"(N, C, …) inputs of {spatial + 2} dimensions)")
            return func(*args, **kwargs)
        shape = inputs.shape if spatial == 0 else (*inputs.shape[:2], *(1,) * spatial)
        multiplier = torch.empty(shape, dtype=inputs.dtype, device=inputs.device).bernoulli_(1 - p)
        if p < 1:
            multiplier.div_(1 - p)
        self.draws.append(multiplier.detach())
        return inputs.mul_(multiplier) if given.get("inplace", False) else inputs * multiplier

    def attention_dropout(self, weights: torch.Tensor, p: float) -> torch.Tensor:
        """Attention weights (or a recurrent layer's output) dropped with probability ``p``, the mask drawn or replayed
        as a dropout call's."""
        return self.__torch_function__(F.dropout, (), (weights, p, True), {})

    def _recurrent(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A recurrent layer that drops between its layers while training: run in plain operators
        (``flguard.risk.recurrent``), the drops through ``attention_dropout``; otherwise PyTorch's own."""
        drops = drops_between_layers(args)
        value = recurrent(func, args, kwargs, self.attention_dropout) if drops else None
        if value is None:
            self.problem = PACKED if drops else self.problem  # a packed sequence: its drops are PyTorch's own
            return func(*args, **kwargs)
        return value

    def _attention(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An attention function with its weights dropped while training: run in plain operators
        (``flguard.risk.functional``), the weights dropped by ``attention_dropout`` — drawn where PyTorch's kernel
        would draw them out of sight; otherwise as it is."""
        from flguard.risk.functional import DROPPED_ATTENTION  # (functional imports this module)

        (p_at, p_name), training_at = ATTENTION_DROPOUT_ARGUMENTS[func]
        p = args[p_at] if len(args) > p_at else kwargs.get(p_name, 0.0)
        training = training_at is None or (args[training_at] if len(args) > training_at
                                           else kwargs.get("training", True))
        if not (training and p > 0):
            return func(*args, **kwargs)
        value = DROPPED_ATTENTION[func](*args, **kwargs, drop=self.attention_dropout)
        if value is None:
            self.problem = f"{func.__name__} with dropout and an option the guard does not rewrite (bias_k, …)"
            return func(*args, **kwargs)
        return value

    def finish(self) -> tuple[torch.Tensor, ...]:
        """The pass's multipliers, in call order; ``ValueError`` where a replayed pass called fewer dropouts than were
        recorded, or a recorded one a dropout it could not record."""
        if self.replaying and self.used != len(self.draws):
            raise ValueError(f"the pass called {self.used} train-mode dropouts where the recorded pass drew "
                             f"{len(self.draws)} masks: the guard replays them in order")
        if self.problem:
            raise ValueError(f"a train-mode dropout the guard cannot replay: {self.problem}")
        return tuple(self.draws)


def probe_shapes(forward: Callable[[DropoutDraws], Any]) -> tuple[torch.Size, ...]:
    """The multipliers' shapes, in call order, of the train-mode dropouts of ``forward(mode)`` — a pass on one sample
    run under ``mode`` — nothing drawn or dropped (the default generator left as it was): ``check_batch`` finds
    each mask's batch where this pass's shape has 1 and the batch's has N."""
    probe = DropoutDraws(probe=True)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        forward(probe)
    return tuple(probe.shapes)


def check_batch(draws: Sequence[torch.Tensor], batch: int,
                one_sample: Sequence[torch.Size]) -> tuple[torch.Tensor, ...]:
    """``draws`` as a tuple with the batch first, so that a sample's rows are its multipliers. Each mask's batch is the
    one dimension where its shape has N (``batch``) and its shape in a one-sample pass (``one_sample``, from
    ``probe_shapes``) has 1 — the first dimension in most layers, the second in a sequence-first (L, N, E) one, found
    whatever its other sizes; for N = 1, the first dimension of size 1. A mask whose batch is dimension d > 0 is stored
    as (N, 1, …, 1, the other dimensions) with d ones after the batch — one more dimension per place — so that
    ``aligned`` puts the batch back at d. A mask already in that layout (more dimensions than its one-sample shape)
    is kept. ``ValueError`` naming the shapes where no dimension, or more than one, goes from N to 1 (a mask shared
    by the samples, on a weight; an activation flattened across the batch; a pairwise (N, N) one), or where the
    pass called another number of dropouts."""
    if len(one_sample) != len(draws):
        raise ValueError(f"a one-sample pass called {len(one_sample)} train-mode dropouts where the batch's drew "
                         f"{len(draws)} masks: the guard replays each sample's part of them, in order")
    out = []
    for multiplier, one in zip(draws, one_sample):
        if multiplier.dim() > len(one) and multiplier.shape[0] == batch:
            out.append(multiplier)
            continue
        if multiplier.dim() != len(one):
            places = []
        elif batch == 1:
            places = [d for d in range(multiplier.dim()) if multiplier.shape[d] == 1][:1]
        else:
            places = [d for d in range(multiplier.dim()) if multiplier.shape[d] != one[d]]
        if len(places) != 1 or multiplier.shape[places[0]] != batch or one[places[0]] != 1:
            raise ValueError(f"a train-mode dropout on a tensor of shape {tuple(multiplier.shape)} ({tuple(one)} for "
                             f"one sample): no one dimension of it is the batch of {batch} samples, so the guard "
                             "cannot tell which of its elements are whose (a mask shared by the samples, on a "
                             "weight; an activation flattened or paired across the batch) — it replays each "
                             "sample's own mask")
        if places[0] == 0:
            out.append(multiplier)
            continue
        moved = multiplier.movedim(places[0], 0)
        out.append(moved.reshape(batch, *(1,) * places[0], *moved.shape[1:]))
    return tuple(out)


def aligned(multiplier: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """A stored multiplier (``check_batch``'s layout, or as drawn) in ``inputs``' layout and dtype: as it is where its
    rank is the input's; with d more dimensions, its batch (first) dimension put back at d in place of the d ones —
    for one sample's rows, as for a batch's. ``ValueError`` where it does not fit the input (another pass's masks)."""
    extra = multiplier.dim() - inputs.dim()
    if extra > 0:
        multiplier = multiplier.reshape(multiplier.shape[0], *multiplier.shape[1 + extra:]).movedim(0, extra)
    try:
        fits = extra >= 0 and torch.broadcast_shapes(multiplier.shape, inputs.shape) == inputs.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"a recorded dropout mask of shape {tuple(multiplier.shape)} replayed on a tensor of shape "
                         f"{tuple(inputs.shape)}: the pass does not call the dropouts the recorded pass called, on "
                         "tensors of the same shapes")
    return multiplier.to(inputs.dtype)


#: ``check_split``: each sample's own pass must give its row of the batch's output to this share of the largest
#: output (float rounding between a batched and a one-sample pass is about 1e-6 of it in float32).
SPLIT_RTOL = 1e-4


def check_split(sample_forward: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor],
                batch_forward: Callable[[], torch.Tensor], x: torch.Tensor, draws: Sequence[torch.Tensor]) -> None:
    """``ValueError`` unless each sample's pass with its own rows of ``draws`` — ``sample_forward(x_i, d_i)``, vmapped
    over the batch — gives its row of the batch's pass ``batch_forward()`` (both without gradients): where the
    dimension ``check_batch`` found from the shapes alone is not the samples' (rows that mix samples), each sample
    would otherwise get another's masks."""
    with torch.no_grad():
        rows, batch_output = vmap(sample_forward)(x, tuple(draws)), batch_forward()
    gap, scale = float((rows - batch_output).abs().max()), float(batch_output.abs().max())
    if not gap <= SPLIT_RTOL * scale + 1e-12:
        raise ValueError(f"a train-mode dropout's masks do not split by sample: each sample's pass with its own rows "
                         f"of the masks differs from the batch's by {gap:.3g} (largest output {scale:.3g}) — a dropout "
                         "on a tensor whose rows mix the samples (a pass whose one-sample form is not a row of its "
                         "batched form); the guard replays each sample's own mask")


def sample_rows(draws: Sequence[torch.Tensor], index: int | slice | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The multipliers of the samples ``index`` (an int: one sample's, without the batch dimension)."""
    return tuple(multiplier[index] for multiplier in draws)


def as_one_sample(draws: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One sample's multipliers with a batch dimension of one, as its forward pass on ``x_i.unsqueeze(0)`` needs."""
    return tuple(multiplier.unsqueeze(0) for multiplier in draws)


def refuse_unreplayed(model: nn.Module) -> None:
    """``ValueError`` for a train-mode dropout layer whose masks are not replayed (alpha dropout): the Jacobian of a
    freshly random map is not a property of the sample."""
    for name, module in model.named_modules():
        if (isinstance(module, nn.modules.dropout._DropoutNd) and not isinstance(module, REPLAYED_LAYERS)
                and module.training and module.p > 0):
            raise ValueError(f"module {name!r} is a train-mode {type(module).__name__}, whose masks the guard does "
                             "not replay; call .eval() on it or remove it before measuring leakage")


def active_dropouts(model: nn.Module) -> list[str]:
    """The paths of ``model``'s train-mode layers with p > 0 whose masks the guard replays: ``REPLAYED_LAYERS``,
    ``nn.MultiheadAttention``'s attention dropout and a stacked recurrent layer's dropout between its layers."""
    return [name or "<model>" for name, module in model.named_modules() if module.training and (
        (isinstance(module, REPLAYED_LAYERS) and module.p > 0)
        or (isinstance(module, nn.MultiheadAttention) and module.dropout > 0)
        or (isinstance(module, nn.RNNBase) and module.dropout > 0 and module.num_layers > 1))]


#: The stochastic-depth layers ``flguard.fix_model`` replaces by a ``ReplayedDropPath``, by class name (torchvision's
#: and timm's are not subclasses of anything of PyTorch's).
DROP_PATHS = ("StochasticDepth", "DropPath")


__all__ = ["DROPOUT_FUNCTIONS", "DROP_PATHS", "REPLAYED_LAYERS", "DropoutDraws", "ReplayedDropPath", "active_dropouts",
           "aligned", "as_one_sample", "check_batch", "check_split", "probe_shapes", "refuse_unreplayed", "sample_rows",
           "SPLIT_RTOL"]
