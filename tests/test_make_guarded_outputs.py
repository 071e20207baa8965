"""make_guarded on models whose output is structured — a tuple (logits, features), a named tuple (torchvision's
GoogLeNet in train mode), a dict or Hugging Face's ``ModelOutput`` (``out["logits"]``) — where the criterion takes one
tensor of it. They were refused ("the guarded criterion was not called on the guarded model's output"); the guard now
measures that part of the output, and the step equals the same seeded step of the plain model, bit for bit. A loss
over two parts (an auxiliary head's) is refused: it has terms the guard does not measure."""

from __future__ import annotations

import copy
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from flguard import GuardConfig, make_guarded
from flguard.guard.recorder import output_path
from flguard.guard.training import GuardMisuse
from flguard.models.zoo import create

Outputs = namedtuple("Outputs", ["logits", "aux_logits"])
SHAPES = {
    "tuple": (lambda logits, features: (logits, features), lambda out: out[0]),
    "namedtuple": (lambda logits, features: Outputs(logits, features[:, :10]), lambda out: out.logits),
    "dict": (lambda logits, features: {"features": features, "logits": logits}, lambda out: out["logits"]),
    "ordereddict": (lambda logits, features: OrderedDict(hidden=[features], logits=logits), lambda out: out["logits"]),
}


class Structured(nn.Module):
    """The ResNet-8 whose output is ``shape``'s structure holding its logits and its pooled features."""

    def __init__(self, model: nn.Module, shape: str) -> None:
        super().__init__()
        self.model, self.shape = model, shape

    def forward(self, x: torch.Tensor):
        features = self.model.pool(self.model.layers(self.model.stem(x))).flatten(1)
        return SHAPES[self.shape][0](self.model.fc(features), features)


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return create("resnet8_gn", image_size=8)


def _step(model: nn.Module, pick, x, y, extra=None) -> list[torch.Tensor]:
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                               nn.CrossEntropyLoss(), GuardConfig(seed=0))
    optimizer.zero_grad()
    out = model(x)
    loss = criterion(pick(out), y)
    if extra is not None:
        loss = loss + extra(out)
    loss.backward()
    optimizer.step()
    assert optimizer.guard_reports[-1].met, optimizer.guard_reports[-1].reason
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_structured_output_is_guarded_on_the_part_the_criterion_took(shape):
    base = _resnet()
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    expected = _step(copy.deepcopy(base), lambda out: out, x, y)
    structured = _step(Structured(copy.deepcopy(base), shape), SHAPES[shape][1], x, y)
    assert len(expected) == len(structured) and all(torch.equal(a, b) for a, b in zip(expected, structured))


def test_a_loss_on_two_parts_of_the_output_is_refused():
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    model = Structured(_resnet(), "namedtuple")
    with pytest.raises(GuardMisuse, match="terms the guard cannot see"):
        _step(model, lambda out: out.logits, x, y, extra=lambda out: 0.3 * out.aux_logits.square().mean())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_part_of_the_output_transformed_before_the_criterion_is_refused_naming_the_fix(shape):
    """The criterion's prediction computed from a part of a structured output outside the model (a log-softmax): the
    step is refused naming the fix (fold it into the criterion), nothing applied."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    model = Structured(_resnet(), shape)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(GuardMisuse, match="fold it into the criterion"):
        _step(model, lambda out: torch.log_softmax(SHAPES[shape][1](out), 1), x, y)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_output_path_finds_the_very_tensor_and_nothing_equal_to_it():
    logits = torch.zeros(2, 3)
    assert output_path({"a": [1, (logits,)]}, logits) == ("a", 1, 0)
    assert output_path({"a": logits.clone()}, logits) is None  # equal values, another tensor
    assert output_path(logits, logits) == ()


def test_guard_protect_names_selected_output_for_a_structured_model_and_measures_it_wrapped():
    """Guard.protect (guard_step's engine) on a dict-output model withholds naming SelectedOutput, instead of an
    AttributeError; wrapped in SelectedOutput it protects as the plain model does, bit for bit."""
    from flguard import Guard
    from flguard.guard.recorder import SelectedOutput

    base = _resnet()
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    gradient = torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        nn.functional.cross_entropy(base(x), y), list(base.parameters()))])
    structured = Structured(base, "dict")
    refused = Guard(GuardConfig(seed=0)).protect(structured, x, y, gradient)
    assert refused.gradient is None and "SelectedOutput" in refused.report.reason
    wrapped = Guard(GuardConfig(seed=0)).protect(SelectedOutput(structured, ("logits",)), x, y, gradient)
    plain = Guard(GuardConfig(seed=0)).protect(base, x, y, gradient)
    assert plain.report.met and torch.equal(wrapped.gradient, plain.gradient)
