"""Fine-tuning a pretrained BatchNorm network under the guard: what a practitioner who brings torchvision's ResNet-18
with its pretraining, freezes the backbone and trains a new head sees, with the defaults (only the normalisation
given).

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_fine_tuning.py [--pretrain-steps 300] [--steps 60] \
        [--batch 32] [--lr 0.03] [--full-steps 0]

"Pretraining" (offline, so on the photos that ship with the packages): torchvision's ``resnet18`` with its BatchNorms,
trained ``--pretrain-steps`` Adam steps (lr 1e-3, batches of 32, train mode) on ``photos32``'s first five photos. The
downstream task is the other five photos: a fresh five-class head (``fc``) on the frozen backbone, trained ``--steps``
SGD steps (``--lr``, batches of ``--batch``: epochs over its 1,250 training crops; the optimizer built over
``model.parameters()``, as tutorials do), each arm from the same head and on the same batches:

- the BatchNorm model itself: ``make_guarded`` refuses it (printed: the start of its message);
- ``fix_model(model, batchnorm="frozen")``: the pretrained network's eval-mode map, kept in train mode (the backbone's
  features as pretrained) — unguarded and guarded;
- ``fix_model(model)`` (BatchNorm → GroupNorm, the fix for training from scratch): unguarded and guarded.

Printed per arm: held-out accuracy on the downstream photos (the last 250 crops of each), steps sent, seconds per
guarded step against the unguarded frozen-backbone step and against a full training step of the model (all
parameters, the same batch size), products per sample. ``--full-steps N`` adds N guarded steps of full fine-tuning
(every parameter trainable, frozen BatchNorm; ``--also-train layer4``: the head and layer4 only) with their cost.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import flguard
from flguard.data import load

from _common import accuracy

SOURCE, TARGET = range(0, 5), range(5, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--full-steps", type=int, default=0)
    parser.add_argument("--also-train", default="", help="the --full-steps arm trains the head and the modules with "
                        "these comma-separated name prefixes (e.g. layer4) instead of every parameter")
    args = parser.parse_args()
    import torchvision

    data = load("photos32")
    x_all, y_all = data.normalize(data.images), data.labels
    source, (target_train, target_test) = _split(y_all, SOURCE), _split(y_all, TARGET)
    torch.manual_seed(0)
    pretrained = torchvision.models.resnet18(num_classes=len(SOURCE)).train()
    adam = torch.optim.Adam(pretrained.parameters(), lr=1e-3)
    for step in range(args.pretrain_steps):
        idx = source[0][torch.randint(len(source[0]), (32,), generator=torch.Generator().manual_seed(step))]
        adam.zero_grad()
        nn.functional.cross_entropy(pretrained(x_all[idx]), y_all[idx]).backward()
        adam.step()
    print(f"pretrained {args.pretrain_steps} steps: {accuracy(pretrained, x_all[source[1]], y_all[source[1]]):.1f}% "
          f"on held-out source photos (eval mode)")
    torch.manual_seed(1)
    head = nn.Linear(pretrained.fc.in_features, len(TARGET))
    labels = y_all - TARGET.start
    order = target_train[torch.randperm(len(target_train), generator=torch.Generator().manual_seed(2))]
    epoch = [idx for idx in order.split(args.batch) if len(idx) == args.batch]
    batches = (epoch * (args.steps // len(epoch) + 1))[:args.steps]  # epochs over the downstream photos
    full_step = _full_step_seconds(pretrained, x_all, labels, batches)
    try:
        flguard.make_guarded(_with_head(pretrained, head), torch.optim.SGD(pretrained.parameters(), lr=args.lr),
                             nn.CrossEntropyLoss(), flguard.GuardConfig(pixel_mean=data.mean, pixel_std=data.std))
        print("BatchNorm model: accepted (unexpected)")
    except flguard.UnsupportedModel as error:
        print(f"BatchNorm model: refused — {' '.join(str(error).split())[:160]} …")
    print("| backbone | guarded | downstream held-out accuracy | steps sent | s per step (× unguarded frozen step; "
          "× full training step) | products per sample |")
    print("| --- | --- | --- | --- | --- | --- |")
    test = (x_all[target_test], labels[target_test])
    for fix in ("frozen", "groupnorm"):
        for guarded in (False, True):
            model = _with_head(flguard.fix_model(pretrained, batchnorm=fix), head)
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("fc."))
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
            reports, seconds = _fine_tune(model, optimizer, guarded, data, x_all, labels, batches)
            held_out = accuracy(model, *test)
            if not guarded:
                plain = statistics.median(seconds)
                print(f"| {fix} | no | {held_out:.1f}% | — | {plain:.3f} | — |", flush=True)
                continue
            step = statistics.median(seconds)
            sent = sum(r.met for r in reports)
            print(f"| {fix} | yes | {held_out:.1f}% | {sent} / {len(batches)} | {step:.2f} ({step / plain:.0f}×; "
                  f"{step / full_step:.1f}×) | {statistics.median(r.matvecs for r in reports):.1f} |", flush=True)
    if args.full_steps:
        model = _with_head(flguard.fix_model(pretrained, batchnorm="frozen"), head)
        prefixes = tuple(f"{name}." for name in args.also_train.split(",") if name)
        for name, p in model.named_parameters():
            p.requires_grad_(not prefixes or name.startswith(("fc.", *prefixes)))
        trained = (f"fc and {args.also_train} trained ({sum(p.numel() for p in model.parameters() if p.requires_grad):,}"
                   " parameters)" if prefixes else "every parameter trained")
        reports, seconds = _fine_tune(model, torch.optim.SGD(model.parameters(), lr=args.lr), True, data, x_all,
                                      labels, batches[:args.full_steps])
        step = statistics.median(seconds)
        print(f"| frozen, {trained} | yes | {accuracy(model, *test):.1f}% | "
              f"{sum(r.met for r in reports)} / {len(reports)} | {step:.2f} (—; {step / full_step:.1f}×) | "
              f"{statistics.median(r.matvecs for r in reports):.1f} |", flush=True)
    print(f"(a full training step of the model at B = {args.batch}: {full_step:.3f} s)")


def _split(labels: torch.Tensor, classes: range) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) indices of ``classes``: the last 250 crops of each photo held out."""
    parts = [(labels == c).nonzero().squeeze(1) for c in classes]
    return torch.cat([p[:-250] for p in parts]), torch.cat([p[-250:] for p in parts])


def _with_head(model: nn.Module, head: nn.Linear) -> nn.Module:
    """A copy of ``model`` with a copy of ``head`` as its ``fc``."""
    model = copy.deepcopy(model)
    model.fc = copy.deepcopy(head)
    return model


def _fine_tune(model, optimizer, guarded, data, x_all, labels, batches):
    """The steps on ``batches`` (guarded through ``make_guarded`` with the defaults, or not): (reports, seconds)."""
    criterion = nn.CrossEntropyLoss()
    if guarded:
        model, optimizer, criterion = flguard.make_guarded(
            model, optimizer, criterion, flguard.GuardConfig(pixel_mean=data.mean, pixel_std=data.std))
    seconds = []
    for idx in batches:
        start = time.perf_counter()
        optimizer.zero_grad()
        criterion(model(x_all[idx]), labels[idx]).backward()
        try:
            optimizer.step()
        except flguard.GuardFailure:
            pass  # withheld: reported
        seconds.append(time.perf_counter() - start)
    return (optimizer.guard_reports if guarded else []), seconds


def _full_step_seconds(model, x_all, labels, batches) -> float:
    """The median of three training steps of every parameter of a copy of ``model`` (train mode, SGD)."""
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seconds = []
    for idx in batches[:3]:
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x_all[idx]), labels[idx] % model.fc.out_features).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


if __name__ == "__main__":
    main()
