"""Which models the guard can certify, checked before the first step: ``check_model`` and ``fix_model``.

The guard certifies each sample's block J_i = ∇_{x_i}∇_θ L of the update. That is a property of
sample i alone only when the forward pass treats samples independently and deterministically:

* **train-mode BatchNorm** normalises every sample with the batch's mean and variance, so each
  block depends on the whole batch (the exact coupled Jacobian costs B times the per-sample one
  and its memory grows with every product on a ResNet), and it updates its running statistics —
  buffers that a Flower client sends with the parameters, unguarded. The fix is the one Opacus
  makes (``ModuleValidator.fix``): GroupNorm with the same channels, per-sample by construction.
* **train-mode random drops that are not replayed**: PyTorch's ``nn.Dropout`` and ``nn.Dropout1d/2d/3d`` are
  guarded as they train — each mask is recorded in the pass that made the gradient and replayed in the guard's
  (``flguard.risk.dropout_draws``) — but a layer that draws its randomness another way would make each of the
  guard's passes a different random map, and its recomputed gradient not the one sent: alpha dropout,
  torchvision's ``StochasticDepth`` (in its EfficientNets and ConvNeXts) and timm's ``DropPath`` until ``fix_model``
  replaces them, and timm's ``DropBlock2d`` — found by their drop probability, so a layer with it at 0 passes.
  Attention dropout (``nn.MultiheadAttention``, ``F.scaled_dot_product_attention``) is replayed too: its weights are
  dropped through ``F.dropout`` while the mask is recorded.
* **InstanceNorm with running statistics** is per-sample in its forward pass but updates its
  running buffers from the batch in train mode: the same unguarded side channel as BatchNorm's.
* **half-precision parameters** (a model cast to bfloat16 or float16): the guard's solves are
  verified to rtol 1e-2–1e-3 and its certificate rests on products in the float32 or float64 of the
  parameters; half precision errs near 1e-2–1e-3 in each. Mixed precision keeps float32 weights and
  runs the forward pass under ``torch.autocast``, which ``make_guarded`` guards as it stands.

``check_model`` lists these problems (each names the module's path, why, and the fix);
``make_guarded`` and ``Guard.protect`` refuse a model with any of them before measuring, with an
``UnsupportedModel`` error that names BatchNorm and ``fix_model``, instead of failing step after
step. ``fix_model`` returns a *new* model (a deep copy: the original is left as it was) with every
BatchNorm replaced by a GroupNorm of the same channels and affine parameters carried over — or, for
fine-tuning a pretrained model, by a ``FrozenBatchNorm`` that keeps its running statistics fixed
(``flguard.guard.frozen_batchnorm``: the eval-mode map, per sample, in any mode).
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from torch import nn

from flguard.guard.frozen_batchnorm import FrozenBatchNorm
from flguard.risk.dropout_draws import DROP_PATHS, REPLAYED_LAYERS, ReplayedDropPath


class UnsupportedModel(ValueError):
    """The model has a layer the per-sample guard cannot certify; the message lists them with their fix."""


#: GroupNorm's group count for a BatchNorm of C channels: the largest divisor of C that is at most
#: this (32 channels per group is GroupNorm's paper default and Opacus' choice; ResNet-18's 64–512
#: channels get 32 groups, a 6-channel layer 6).
MAX_GROUPS = 32


def _batchnorm_problem(name: str, module: nn.Module) -> str:
    mode = "train mode" if module.training else "eval mode (model.train() turns it back on)"
    return (f"{name or '<model>'}: {type(module).__name__} in {mode} normalises each sample with the batch's "
            "statistics, so a sample's leakage depends on the whole batch, and its running statistics (sent "
            "with the parameters) are updated from the batch unguarded; fix: flguard.fix_model(model) replaces "
            "every BatchNorm with a GroupNorm of the same channels (training from scratch), or "
            "flguard.fix_model(model, batchnorm='frozen') keeps a pretrained model's running statistics fixed "
            "(fine-tuning)")


#: Problems that a module's mode cannot change (refused as soon as a model is wrapped); the others
#: (train-mode random layers the guard does not replay) depend on the mode and are refused at the step.
STRUCTURAL = ("batchnorm", "instancenorm", "precision")

#: The parameter dtypes the guard measures in.
CERTIFIED_DTYPES = (torch.float32, torch.float64)


def model_problems(model: nn.Module) -> list[tuple[str, str]]:
    """(kind, message) for every problem ``check_model`` lists; kind is one of ``STRUCTURAL`` or
    ``"dropout"``."""
    if not isinstance(model, nn.Module):
        raise TypeError("check_model: model must be a torch.nn.Module")
    problems = []
    half = next(((name, p.dtype) for name, p in model.named_parameters()
                 if p.requires_grad and p.is_floating_point() and p.dtype not in CERTIFIED_DTYPES), None)
    if half is not None:
        problems.append(("precision", f"<model>: trainable parameters in {half[1]} (the first: {half[0]}): the guard "
                         "measures and certifies in float32 or float64; fix: keep the model in float32 and run the "
                         "forward pass under torch.autocast (make_guarded guards such a loop as it stands)"))
    for name, module in model.named_modules():
        where = name or "<model>"
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            problems.append(("batchnorm", _batchnorm_problem(name, module)))
        elif isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            problems.append(("instancenorm", f"{where}: {type(module).__name__} with track_running_stats=True "
                             "updates its running statistics from the batch, unguarded; fix: "
                             "track_running_stats=False"))
        elif module.training and (drop := _random_drop(module))[1] > 0:
            fix = ("flguard.fix_model(model) replaces it by a ReplayedDropPath, the same per-sample drop drawn where "
                   "the guard replays it" if type(module).__name__ in DROP_PATHS else
                   "use nn.Dropout, remove it, set its probability to 0, or call .eval() on it")
            problems.append(("dropout", f"{where}: {type(module).__name__}({drop[0]}={drop[1]:.3g}) in train "
                             "mode drops at random in a way the guard does not replay (it replays nn.Dropout and "
                             "nn.Dropout1d/2d/3d), so the per-sample Jacobian is undefined and the gradient cannot be "
                             f"reproduced; fix: {fix}"))
    return problems


#: Layers that drop at random while training, by class name (torchvision's and timm's are not subclasses of
#: PyTorch's dropout), with the attribute that holds their probability.
DROP_ATTRIBUTE = {"StochasticDepth": "p", "DropPath": "drop_prob", "DropBlock2d": "drop_prob"}


def _random_drop(module: nn.Module) -> tuple[str, float]:
    """(attribute, probability) with which ``module`` drops at random in train mode; probability 0 for a layer that
    never does."""
    if isinstance(module, REPLAYED_LAYERS):  # guarded with its masks replayed
        return "p", 0.0
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return "p", float(module.p)
    attribute = DROP_ATTRIBUTE.get(type(module).__name__, "")
    value = getattr(module, attribute, 0.0) if attribute else 0.0
    return attribute, float(value) if isinstance(value, (int, float)) else 0.0


def check_model(model: nn.Module) -> list[str]:
    """The problems that stop the guard from certifying ``model`` per sample, one string each
    (module path, why, fix); an empty list when there are none.

    BatchNorm is listed in either mode: a model is normally guarded while it trains, and
    ``model.train()`` restores the batch coupling. A random layer that the guard does not replay (alpha dropout,
    stochastic depth) is listed only in train mode with p > 0 (in eval mode it is the identity); PyTorch's
    ``nn.Dropout`` and ``nn.Dropout1d/2d/3d`` are not listed: their masks are replayed."""
    return [message for _, message in model_problems(model)]


def require_supported(model: nn.Module, caller: str, kinds: tuple[str, ...] | None = None) -> None:
    """Raise ``UnsupportedModel`` listing ``check_model``'s problems (those of ``kinds``; None: all)."""
    problems = [message for kind, message in model_problems(model) if kinds is None or kind in kinds]
    if problems:
        raise UnsupportedModel(f"{caller}: the model cannot be guarded per sample:\n  - " + "\n  - ".join(problems))


def _group_norm(module: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    channels = module.num_features
    groups = math.gcd(channels, MAX_GROUPS)
    norm = nn.GroupNorm(groups, channels, eps=module.eps, affine=module.affine)
    if module.affine:
        norm.weight.data.copy_(module.weight.data)
        norm.bias.data.copy_(module.bias.data)
        norm.weight.requires_grad_(module.weight.requires_grad)
        norm.bias.requires_grad_(module.bias.requires_grad)
    norm.to(device=module.weight.device if module.affine else None)
    norm.train(module.training)
    return norm


#: ``fix_model``'s replacements for a BatchNorm.
BATCHNORM_FIXES = ("groupnorm", "frozen")


def fix_model(model: nn.Module, batchnorm: str = "groupnorm") -> nn.Module:
    """A copy of ``model`` with every BatchNorm (1d, 2d, 3d, Sync) replaced; ``model`` itself is not changed.

    ``batchnorm="groupnorm"`` (Opacus' fix, for a model trained from scratch): a GroupNorm of the same channels
    (``MAX_GROUPS``), its ε and affine weights carried over. ``batchnorm="frozen"`` (for fine-tuning a pretrained
    model): a ``FrozenBatchNorm`` that normalises with the BatchNorm's running statistics as they stand — the very map
    the pretrained network computes in eval mode, now in train mode too, per sample; a BatchNorm without running
    statistics is refused by name. The copy's parameters are new tensors: build the optimizer (and ``make_guarded``)
    on the returned model. A BatchNorm given as the whole model is replaced too. Stochastic depth (torchvision's
    ``StochasticDepth`` in row mode — EfficientNet, ConvNeXt, Swin — and timm's ``DropPath``) is replaced by a
    ``ReplayedDropPath`` of the same probability: the same per-sample drop, drawn where the guard records and replays
    it (batch mode, one draw for the whole batch, is refused by name). ``nn.Dropout`` is guarded as it is, its masks
    replayed; the other random layers (``check_model`` lists them in train mode) are the user's to change — removing
    one changes the regularisation."""
    if not isinstance(model, nn.Module):
        raise TypeError("fix_model: model must be a torch.nn.Module")
    if batchnorm not in BATCHNORM_FIXES:
        raise ValueError(f"fix_model: batchnorm={batchnorm!r} must be one of {BATCHNORM_FIXES}")

    def replaced(module: nn.modules.batchnorm._BatchNorm, name: str) -> nn.Module:
        _require_plain(module, name)
        if batchnorm == "groupnorm":
            return _group_norm(module)
        frozen = FrozenBatchNorm.from_batchnorm(module, name)
        return frozen.to(device=module.running_mean.device).train(module.training)

    if batchnorm == "frozen":
        _warn_untrained(model)
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return replaced(model, "")
    if type(model).__name__ in DROP_PATHS:
        return ReplayedDropPath.replacing(model, "")
    fixed = copy.deepcopy(model)
    for parent_name, parent in list(fixed.named_modules()):
        for child_name, child in list(parent.named_children()):
            path = f"{parent_name}.{child_name}".lstrip(".")
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                setattr(parent, child_name, replaced(child, path))
            elif type(child).__name__ in DROP_PATHS:
                setattr(parent, child_name, ReplayedDropPath.replacing(child, path))
    return fixed


#: BatchNorm classes whose forward pass is BatchNorm's alone: ``fix_model`` replaces these and subclasses that keep
#: ``_BatchNorm.forward`` (BatchNorm1d/2d/3d and their lazy forms).
PLAIN_BATCHNORMS = (nn.SyncBatchNorm,)


def _require_plain(module: nn.modules.batchnorm._BatchNorm, name: str) -> None:
    """A ValueError for a BatchNorm subclass with a forward pass of its own (timm's ``BatchNormAct2d`` adds an
    activation): replacing it by a normalisation alone would change the model without a word."""
    if isinstance(module, PLAIN_BATCHNORMS) or type(module).forward is nn.modules.batchnorm._BatchNorm.forward:
        return
    raise ValueError(f"fix_model: {name or '<model>'} ({type(module).__name__}) is a BatchNorm with a forward pass of "
                     "its own (timm's BatchNormAct2d adds an activation): replacing it by a normalisation alone would "
                     "change the model; replace it in your code (a GroupNorm, or flguard.guard.FrozenBatchNorm, "
                     "followed by what its forward adds)")


def _warn_untrained(model: nn.Module) -> None:
    """One warning naming the BatchNorms that have seen no batch: frozen, their statistics are the initial 0 and 1."""
    untrained = [name or "<model>" for name, module in model.named_modules()
                 if isinstance(module, nn.modules.batchnorm._BatchNorm)
                 and getattr(module, "num_batches_tracked", None) is not None and int(module.num_batches_tracked) == 0]
    if untrained:
        warnings.warn(f"fix_model(batchnorm='frozen'): {len(untrained)} BatchNorm(s) have seen no batch "
                      f"({', '.join(untrained[:3])}{', …' if len(untrained) > 3 else ''}): their frozen statistics are "
                      "the initial 0 and 1 — for a model trained from scratch use batchnorm='groupnorm'",
                      UserWarning, stacklevel=3)


__all__ = ["check_model", "fix_model", "model_problems", "require_supported", "UnsupportedModel", "MAX_GROUPS",
           "STRUCTURAL", "DROP_ATTRIBUTE", "BATCHNORM_FIXES", "FrozenBatchNorm"]
