"""Which models a practitioner brings does the guard take: torchvision's architectures through ``check_model``,
``fix_model`` and ``make_guarded`` with the defaults (only the normalisation given), one guarded step each.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_architectures.py [--batch 4] [--models a,b]
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_architectures.py --train-steps 300 --steps 10 \
        --batch 32 --models mobilenet_v3_small,convnext_2stage

With ``--train-steps N`` each model is first trained as a practitioner would (Adam, lr 1e-3, batches of 32 from the
first 4,500 crops, its drop layers active), then given ``--steps`` guarded SGD steps (lr 0.01; ``--optimizer adam``:
Adam at lr 1e-3, a fresh state; ``--lr`` either's) through ``make_guarded`` with the defaults (``--guard FIELD=VALUE``
changes them), the layers ``check_model`` lists put in eval mode; printed per model: held-out accuracy (the last 500
crops) after training, after the guarded steps and after the same steps unguarded, the steps sent, seconds per guarded
step against the unguarded step's, products per sample and the withheld steps' reasons (``--log``: each step's clip
level, progress and damage too).

Each model is built untrained for 10 classes (``quickstart_cnn``: the CNN of Flower's PyTorch template, ``flwr new
--framework pytorch``, whose ``train`` steps a fresh Adam at lr 0.01 each round: ``--optimizer adam --lr 0.01``;
ConvNeXt with two stages of 16 and 32 channels, stochastic depth 0.1; the ViT with 8×8 patches, two layers of width 32,
and ``seq_first_transformer``, the same size in ``nn.TransformerEncoder``'s default sequence-first layout;
torchvision's own configurations otherwise, so that one CPU step takes seconds), fixed (BatchNorm → GroupNorm), the
layers ``check_model`` still lists put in eval mode (what its message tells the user to do), and given one step of a ``photos32`` batch (offline colour crops). Printed: the problems
``check_model`` lists by kind before and after ``fix_model``, and the step's outcome — sent, or withheld with its
reason. An untrained model on a few samples may well need more noise than the budget: the point is that every
model runs to an answer the guard can stand behind, not that each sends (docs/results.md, "Models beyond ResNets").
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import Counter

import torch
from torch import nn

from _common import accuracy, guard_settings


def _builders() -> dict:
    import torchvision.models as tvm
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    from torchvision.models.vision_transformer import VisionTransformer

    from flguard.models import create

    return {
        "quickstart_cnn": lambda: create("cnn", in_channels=3, num_classes=10, image_size=32),  # Flower's template's
        "resnet18": lambda: tvm.resnet18(num_classes=10),
        "squeezenet1_1": lambda: tvm.squeezenet1_1(num_classes=10),
        "shufflenet_v2_x0_5": lambda: tvm.shufflenet_v2_x0_5(num_classes=10),
        "mobilenet_v3_small": lambda: tvm.mobilenet_v3_small(num_classes=10),
        "efficientnet_b0": lambda: tvm.efficientnet_b0(num_classes=10),
        "convnext_2stage": lambda: ConvNeXt(
            [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], stochastic_depth_prob=0.1, num_classes=10),
        "vit_2layer": lambda: VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10),
        "vit_2layer_dropout": lambda: VisionTransformer(  # its dropouts (0 by default) at 0.1, attention's too
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10,
            dropout=0.1, attention_dropout=0.1),
        "seq_first_transformer": SequenceFirstTransformer,
    }


class SequenceFirstTransformer(nn.Module):
    """The ViT of ``vit_2layer_dropout``'s size written as PyTorch's docs write a transformer: 8×8 patches, a learnt
    position embedding, ``nn.TransformerEncoder`` of two ``nn.TransformerEncoderLayer(32, 2, 64)`` with their
    defaults — sequence-first (L, N, E), dropout 0.1 on attention, residuals and feed-forward — mean pooling, a
    linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 8, stride=8)
        self.position = nn.Parameter(torch.zeros(16, 1, 32).normal_(std=0.02))
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64), 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).permute(2, 0, 1) + self.position  # (L = 16, N, E)
        return self.head(self.encoder(tokens).mean(0))


def _kinds(problems: list[str]) -> str:
    kinds = Counter(p.split(": ", 1)[1].split(" ")[0].split("(")[0] for p in problems)
    return ", ".join(f"{n}× {k}" for k, n in sorted(kinds.items())) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--train-steps", type=int, default=0, help="train each model first (Adam), then guard it")
    parser.add_argument("--guard", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="GuardConfig fields beside the normalisation (trained mode)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="the guarded (and unguarded control) steps' optimizer, trained mode")
    parser.add_argument("--lr", type=float, default=None, help="its learning rate (default: sgd 0.01, adam 1e-3)")
    parser.add_argument("--log", action="store_true",
                        help="trained mode: each guarded step's clip level, P, D, L; held-out accuracy every ten")
    parser.add_argument("--steps", type=int, default=10, help="guarded steps of a trained model")
    parser.add_argument("--dropout", choices=("eval", "replay"), default="eval",
                        help="nn.Dropout layers in eval mode, as in the runs recorded before the guard replayed their "
                             "masks (2026-11-28), or left training, their masks replayed")
    args = parser.parse_args()
    global DROPOUT_IN_EVAL
    DROPOUT_IN_EVAL = args.dropout == "eval"
    if args.train_steps > 0:
        return trained(args)
    import flguard
    from flguard.data import load

    data = load("photos32")
    index = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:args.batch]
    x, y = data.normalize(data.images[index]), data.labels[index]
    builders = _builders()
    names = args.models.split(",") if args.models else list(builders)
    print("| model | parameters | check_model | after fix_model | the guarded step (defaults) | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        torch.manual_seed(0)
        model = builders[name]()
        before = flguard.check_model(model)
        model = flguard.fix_model(model).train()
        after = flguard.check_model(model)
        _listed_to_eval(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer, criterion = flguard.make_guarded(
            model, optimizer, nn.CrossEntropyLoss(), flguard.GuardConfig(pixel_mean=data.mean, pixel_std=data.std))
        start = time.perf_counter()
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        try:
            optimizer.step()
            outcome = "sent"
        except Exception as error:  # the guard's refusals and failures: the reason is the finding
            outcome = f"withheld: {type(error).__name__}: {' '.join(str(error).split())[:220]}"
        params = sum(p.numel() for p in model.parameters())
        print(f"| {name} | {params:,} | {_kinds(before)} | {_kinds(after)} | {outcome} | "
              f"{time.perf_counter() - start:.1f} |", flush=True)


#: ``--dropout eval``: nn.Dropout layers (and attention dropout) in eval mode too, as every random layer was before the
#: guard replayed their masks (then ``check_model`` listed them) — the runs recorded in docs/results.md.
DROPOUT_IN_EVAL = True


def _listed_to_eval(model: nn.Module) -> None:
    """The layers ``check_model`` still lists (drop layers after ``fix_model``) in eval mode, as its message says
    (and nn.Dropout, ``DROPOUT_IN_EVAL``)."""
    import flguard
    from flguard.risk.dropout_draws import REPLAYED_LAYERS

    listed = {p.split(":")[0] for p in flguard.check_model(model)}
    for path, module in model.named_modules():
        if path in listed or (DROPOUT_IN_EVAL and isinstance(module, (*REPLAYED_LAYERS, nn.MultiheadAttention))):
            module.eval()


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    held_out = accuracy(model, x, y)
    _listed_to_eval(model)  # (the mode restored turned them back on)
    return held_out


def _log_step(number: int, report, model: nn.Module | None, x: torch.Tensor, y: torch.Tensor) -> None:
    """``--log``: one guarded step's clip level (and its factor of the median), noise kind, C, noise ÷ upload, and
    the step's progress P, its noise's damage D and the batch loss L (``flguard.guard.damage``), or why it was
    withheld; with ``model``, its held-out accuracy after the step."""
    d = report.details
    effect = " ".join(f"{key}={d[name]:.3g}" for key, name in (("P", "step_progress"), ("D", "noise_damage"),
                                                                 ("L", "batch_loss")) if name in d)
    state = (f"sent {d.get('clip_rule', '')} ×{d.get('clip_factor', 1):g} {d.get('defense_used', report.defense)} "
             f"C={d.get('clip', float('nan')):.3g} noise/upload={report.rel_noise:.3g}" if report.met else
             f"withheld: {' '.join(report.reason.split())[:120]}")
    accuracy = "" if model is None else f"  held-out {_accuracy(model, x, y):.1f}%"
    print(f"  step {number}: {state} {effect}{accuracy}", flush=True)


def _optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    """The guarded steps' optimizer: ``--optimizer`` at ``--lr``."""
    if args.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3 if args.lr is None else args.lr)
    return torch.optim.SGD(model.parameters(), lr=0.01 if args.lr is None else args.lr)


def trained(args: argparse.Namespace) -> None:
    """Each model trained ``args.train_steps`` Adam steps, then ``args.steps`` guarded SGD steps with the defaults."""
    import statistics

    import flguard
    from flguard.data import load

    data = load("photos32")
    x_all, y_all = data.normalize(data.images), data.labels
    split = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(0))
    train, test = split[:-500], split[-500:]
    builders = _builders()
    names = args.models.split(",") if args.models else list(builders)
    print("| model | parameters | trained (held-out) | guarded steps sent | after them (unguarded) | "
          "s per guarded step (× unguarded) | products per sample | withheld: why |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        torch.manual_seed(0)
        model = flguard.fix_model(builders[name]()).train()
        adam = torch.optim.Adam(model.parameters(), lr=1e-3)
        order = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(1))]
        for step in range(args.train_steps):
            idx = order[(step * 32) % (len(order) - 32):][:32]
            adam.zero_grad()
            nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            adam.step()
        _listed_to_eval(model)
        before = _accuracy(model, x_all[test], y_all[test])
        batches = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(2))].split(args.batch)
        batches = batches[:args.steps]
        timing = _optimizer(args, model)  # its own state: the guarded steps' optimizer starts fresh, as the control's
        plain = []
        for idx in batches[:3]:  # the unguarded step on the same batches (the update itself undone)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            start = time.perf_counter()
            timing.zero_grad()
            nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            timing.step()
            plain.append(time.perf_counter() - start)
            model.load_state_dict(state)
        control = copy.deepcopy(model)  # the same steps unguarded: what the guarded steps' accuracy is held against
        control_opt = _optimizer(args, control)
        for idx in batches:
            control_opt.zero_grad()
            nn.functional.cross_entropy(control(x_all[idx]), y_all[idx]).backward()
            control_opt.step()
        model, optimizer, criterion = flguard.make_guarded(
            model, _optimizer(args, model), nn.CrossEntropyLoss(),
            flguard.GuardConfig(pixel_mean=data.mean, pixel_std=data.std, **guard_settings(args.guard)))
        seconds, reasons = [], []
        for number, idx in enumerate(batches, 1):
            start = time.perf_counter()
            optimizer.zero_grad()
            criterion(model(x_all[idx]), y_all[idx]).backward()
            try:
                optimizer.step()
            except Exception as error:  # the guard's refusals and failures: the reason is the finding
                reasons.append(f"{type(error).__name__}: {' '.join(str(error).split())[:160]}")
            seconds.append(time.perf_counter() - start)
            if args.log:
                _log_step(number, optimizer.guard_reports[-1], model if number % 10 == 0 else None, x_all[test],
                          y_all[test])
        reports = optimizer.guard_reports
        sent = sum(r.met for r in reports)
        step, unguarded = statistics.median(seconds), statistics.median(plain)
        params = sum(p.numel() for p in model.parameters())
        why = "; ".join(sorted(set(reasons)))[:400] or "—"
        after, plain_after = (_accuracy(m, x_all[test], y_all[test]) for m in (model, control))
        print(f"| {name} | {params:,} | {before:.1f}% | {sent} / {len(batches)} | "
              f"{after:.1f}% ({plain_after:.1f}%) | {step:.2f} ({step / unguarded:.0f}×) | "
              f"{statistics.median(r.matvecs for r in reports):.1f} | {why} |", flush=True)


if __name__ == "__main__":
    main()
