"""The guard with its defaults on the models practitioners train: cost, memory and sent share by model size.

For each model: train it unguarded (``--train-steps`` SGD steps from a fixed seed), then run the same
local round (``--steps`` SGD steps at batch ``B``, the same batches) twice through an ordinary
``loss.backward(); optimizer.step()`` loop — unguarded, and through ``flguard.make_guarded`` with only
the data's normalisation given (``GuardConfig(pixel_mean=…, pixel_std=…)``: every other setting the
default). Each round runs in a child process of its own, so its peak RSS is its own. Printed per
model and batch size: guarded / unguarded ms per step (medians; ``ratio_here`` divides by the
unguarded step timed again in the guarded round's own process, on a copy of the model and the same
batches; ``ratio_mean_here`` the mean guarded step over it — the round's cost where ``auto`` sends eigen on
some steps and the Gaussian on others, which the median hides), Jacobian products per sample per guarded step, steps sent, samples left out,
the noise's norm (median and largest over the sent steps), the share of each batch at or below its clip level C
(``clip_share``, median/max over the steps: 0.5 is the median), peak RSS of each round, test accuracy before and after.
With ``--repeats N`` the guarded round runs N times in its process, each time after the unguarded steps timed again,
and ``ratio_min`` divides the median over the steps of each step's least time over the runs by the unguarded steps'
(on a shared CPU the same code's median step varied ±15% between processes; the least of several runs varies less).

    OMP_NUM_THREADS=1 python benchmarks/bench_guard_models.py                   # cnn B=32, resnet20_gn B=32
    OMP_NUM_THREADS=1 python benchmarks/bench_guard_models.py --models cnn \
        --guard clip_per_sample=median max_rel_noise=40 max_excluded=0.25 rtol=0.01     # candidate defaults
    OMP_NUM_THREADS=1 python benchmarks/bench_guard_models.py --models cnn --guard seed=1 --repeats 5
    OMP_NUM_THREADS=1 python benchmarks/bench_guard_models.py --models resnet18_gn --batch 8 --steps 10
    python benchmarks/bench_guard_models.py --device cuda --models cnn,resnet20_gn,resnet18_gn

Models: ``cnn`` (Flower's quickstart CNN), ``dropout_cnn`` (PyTorch's MNIST example), ``lstm_rows`` (an LSTM over
the image's rows; ``--train-steps 600`` trains it to about 80%) and ``conv1d_rows`` (1-D convolutions over the rows as a
time series) on ``mnist5k``; ``resnet20_gn`` and ``resnet18_gn``
(GroupNorm) on ``photos32`` (offline 32×32 colour crops); torchvision's ``mobilenet_v3_small``, ``shufflenet_v2_x0_5``,
``regnet_x_400mf``, ``efficientnet_b0`` and ``convnext_tiny`` (depthwise or grouped convolutions; LayerNorm and layer
scales in ConvNeXt) and ``vit_tiny32`` (torchvision's VisionTransformer for 32×32 images, ``TORCHVISION_ARGS``) through
``flguard.fix_model`` on ``photos32``. Results go to benchmarks/results/bench_guard_models.csv.
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from _common import accuracy, guard_settings, in_child, study_paths, synchronize, write_table

#: torchvision's models with grouped or depthwise convolutions (and dropout, SE blocks), on ``photos32`` through
#: ``flguard.fix_model`` (BatchNorm → GroupNorm), as a practitioner would bring them
TORCHVISION = ("mobilenet_v3_small", "shufflenet_v2_x0_5", "regnet_x_400mf", "efficientnet_b0", "convnext_tiny",
               "vit_tiny32")
#: torchvision models built with arguments of their own: a ViT for 32×32 images (4×4 patches, 64 tokens and a class
#: token; DeiT-tiny's width, heads and MLP, six blocks instead of twelve)
TORCHVISION_ARGS = {"vit_tiny32": ("VisionTransformer", dict(image_size=32, patch_size=4, num_layers=6, num_heads=3,
                                                             hidden_dim=192, mlp_dim=768))}
DATASETS = {"cnn": "mnist5k", "dropout_cnn": "mnist5k", "lstm_rows": "mnist5k", "conv1d_rows": "mnist5k",
            "resnet20_gn": "photos32", "resnet18_gn": "photos32", "resnet8_gn": "photos32",
            **{name: "photos32" for name in TORCHVISION}}
LEARNING_RATE = {"cnn": 0.05, "dropout_cnn": 0.05, "lstm_rows": 0.2, "conv1d_rows": 0.05, "resnet20_gn": 0.05,
                 "resnet18_gn": 0.05, "resnet8_gn": 0.05, **{name: 0.003 for name in TORCHVISION}}


def _task(name: str, train_steps: int, device: str, seed: int = 0):
    """(model trained unguarded, train split, test split, data) — deterministic for (name, train_steps, seed)."""
    from flguard.data import load
    from flguard.models import create

    data = load(DATASETS[name])
    train, test = data.split(0.2, seed=seed)
    torch.manual_seed(seed)
    channels, size, _ = data.shape
    if name in TORCHVISION:  # as a practitioner brings it: torchvision's model, its BatchNorms fixed
        import torchvision
        from flguard import fix_model

        builder, kwargs = TORCHVISION_ARGS.get(name, (name, {}))
        model = fix_model(getattr(torchvision.models, builder)(num_classes=data.num_classes, **kwargs)).to(device)
    else:
        model = create(name, in_channels=channels, num_classes=data.num_classes, image_size=size).to(device)
    x, y = data.normalize(train.images).to(device), train.labels.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE[name], momentum=0.9)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    for step in range(train_steps):
        idx = order[(step * 32) % (len(y) - 32):][:32]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return model, (x, y), (data.normalize(test.images).to(device), test.labels.to(device)), data


def trained_batches(parser):
    """(args, model, data, [(seed, x, y, g), …]) for the scripts that guard a few batches: ``parser`` gets
    ``_common.add_batch_arguments`` and is parsed, torch runs on one thread, and ``_task``'s trained model
    gives batches of ``args.batch`` drawn with seeds 1 … ``args.batches``, each with its batch gradient g."""
    from _common import add_batch_arguments

    add_batch_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x, y), _, data = _task(args.model, args.train_steps, "cpu", 0)
    params = list(model.parameters())
    batches = []
    for seed in range(1, args.batches + 1):
        idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:args.batch]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
        batches.append((seed, x[idx], y[idx], g))
    return args, model, data, batches


def _unguarded_seconds(model, x, y, batches, device: str, lr: float) -> list[float]:
    """Seconds of each unguarded SGD step on a copy of ``model`` over ``batches`` (after one warm-up step), in the
    guarded round's own process: the ratio's denominator there (their median). A training step timed in another
    process varied 2× between processes on a GPU (docs/results.md, H100)."""
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD(twin.parameters(), lr=lr)
    return _steps(twin, optimizer, torch.nn.CrossEntropyLoss(), x, y, [batches[0], *batches], device)[1:]


def _least_median(runs: list[list[float]]) -> float:
    """ms: the median over the steps of each step's least time over the runs (the same steps each run) — the round's
    cost with what a shared machine adds to some runs taken out (``--repeats``)."""
    return 1000 * statistics.median(min(times) for times in zip(*runs))


def _steps(model, optimizer, criterion, x, y, batches, device: str,
           record: Callable[[Exception | None], None] | None = None) -> list[float]:
    """Seconds of each step of a round — ``loss.backward(); optimizer.step()`` on each batch, a guard's withheld step
    (``GuardFailure``) passed to ``record`` after it (None: sent) — its time the step's alone."""
    from flguard import GuardFailure

    seconds = []
    for idx in batches:
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        criterion(model(x[idx]), y[idx]).backward()
        failure = None
        try:
            optimizer.step()
        except GuardFailure as withheld:
            failure = withheld
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        if record is not None:
            record(failure)
    return seconds


def _median_max(values: list[float]) -> str | None:
    """"median/max" of ``values`` (the share of each step's batch at or below its clip level C), or None."""
    return f"{statistics.median(values):.2f}/{max(values):.2f}" if values else None


def _round(name: str, batch: int, steps: int, train_steps: int, guarded: bool, device: str, seed: int,
           settings: dict, products: str = "auto", compile_mode: str | None = None, transposed: str = "default",
           shrink: str = "default", dropout: str = "train", repeats: int = 1) -> dict:
    """One local round in this (child) process; its measurements and this process's peak RSS. ``products``:
    the operator's path, "auto" (its own choice), forced "cached" / "direct" (``CACHED_UP_TO`` set here) or "ghost"
    (the batched ghost products on a CUDA device too, ``GUARD_GHOST_ON_CUDA``);
    ``compile_mode``: the K products through ``torch.compile`` in this mode (``COMPILE_PRODUCTS``); ``transposed``
    "on"/"off": the cached Jᵀ pullback built with convolutions' input gradients as transposed convolutions or not
    (``CACHED_TRANSPOSED_INPUT_GRADS``; "default": as shipped); ``shrink`` "on"/"off": the solves' products on their
    still-iterating samples or on the whole batch (``SHRINK_TO_ACTIVE``; "default": as shipped); ``dropout`` "eval": the
    model's nn.Dropout layers off in both rounds (what the guard asked before it replayed their masks); ``repeats``: the
    guarded round run that many times from the same model, each after the unguarded one timed again (the first run's
    measurements are reported; ``min_ms``/``here_min_ms``: ``_least_median`` over the runs)."""
    from flguard import GuardConfig, make_guarded
    from flguard.risk import operator, regularised, sizing

    if transposed != "default":
        operator.CACHED_TRANSPOSED_INPUT_GRADS = transposed == "on"
    if shrink != "default":
        regularised.SHRINK_TO_ACTIVE = shrink == "on"

    if products == "ghost":
        sizing.GUARD_GHOST_ON_CUDA = True
    elif products != "auto":
        sizing.CACHED_UP_TO = 2 ** 62 if products == "cached" else 0
        if products == "direct":  # a CUDA device's memory would otherwise keep the cached pullbacks
            sizing.CUDA_CACHED_SHARE = 0.0
    if compile_mode is not None:
        regularised.COMPILE_PRODUCTS = True
        regularised.COMPILE_MODE = None if compile_mode == "default" else compile_mode

    model, (x, y), test, data = _task(name, train_steps, device, seed)
    before = accuracy(model, *test)
    model.train()
    if dropout == "eval":
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE[name] / 5)
    criterion = torch.nn.CrossEntropyLoss()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + 1))[:steps * batch]
    here = [_unguarded_seconds(model, x, y, order.split(batch), device, LEARNING_RATE[name] / 5)] if guarded else []
    pristine = copy.deepcopy(model) if guarded and repeats > 1 else None
    if guarded:
        config = GuardConfig(pixel_mean=data.mean, pixel_std=data.std, **settings)
        model, optimizer, criterion = make_guarded(model, optimizer, criterion, config)
    sent, left_out, products, reasons, used, noise = 0, 0, [], [], {}, []

    def record(failure: Exception | None) -> None:
        nonlocal sent, left_out
        if failure is None:
            sent += 1
        else:
            reasons.append(str(failure)[:600])  # auto: both kinds' reasons
        if guarded:
            report = optimizer.guard_reports[-1]
            products.append(report.matvecs)
            left_out += int(report.details.get("excluded", 0)) if report.met else 0
            if report.met:
                noise.append((report.rel_noise, report.noise_norm, report.details.get("clip_share")))
            kind = report.details.get("defense_used", config.defense) if report.met else "withheld"
            used[kind] = used.get(kind, 0) + 1
    seconds = _steps(model, optimizer, criterion, x, y, order.split(batch), device, record)
    runs = [seconds]
    for _ in range(repeats - 1 if guarded else 0):  # the same round again, timed only
        here.append(_unguarded_seconds(pristine, x, y, order.split(batch), device, LEARNING_RATE[name] / 5))
        again = copy.deepcopy(pristine)
        again_optimizer = torch.optim.SGD(again.parameters(), lr=LEARNING_RATE[name] / 5)
        runs.append(_steps(*make_guarded(again, again_optimizer, torch.nn.CrossEntropyLoss(), config), x, y,
                           order.split(batch), device))
    here_ms = 1000 * statistics.median(here[0]) if guarded else None
    return dict(ms=1000 * statistics.median(seconds), mean_ms=1000 * statistics.fmean(seconds), here_ms=here_ms,
                min_ms=_least_median(runs), here_min_ms=_least_median(here) if guarded else None,
                sent=sent, left_out=left_out,
                products=statistics.median(products) if products else 0.0, reasons=reasons,
                rel_noise=statistics.median(n[0] for n in noise) if noise else None,
                noise_norm=statistics.median(n[1] for n in noise) if noise else None,
                noise_norm_max=max(n[1] for n in noise) if noise else None,
                clip_share=_median_max([n[2] for n in noise if n[2] is not None]),
                used=" ".join(f"{kind}:{count}" for kind, count in sorted(used.items())),
                rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                gpu_gb=torch.cuda.max_memory_allocated(device) / 2**30 if torch.device(device).type == "cuda" else None,
                acc_before=before, acc_after=accuracy(model, *test),
                params=sum(p.numel() for p in model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,resnet20_gn")
    parser.add_argument("--batch", default="32", help="batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--products", choices=["auto", "cached", "direct", "ghost"], default="auto",
                        help="the Jacobian products' path (default: the operator's own choice by size); ghost: the "
                             "batched ghost products on a CUDA device too (GUARD_GHOST_ON_CUDA), as on the CPU")
    parser.add_argument("--compile-mode", default=None,
                        help="the guard's K products through torch.compile in this mode (default, reduce-overhead: "
                             "CUDA graphs, …; flguard.risk.regularised.COMPILE_PRODUCTS); the first compile is in "
                             "the round's time")
    parser.add_argument("--transposed", choices=["default", "on", "off"], default="default",
                        help="the cached Jᵀ pullback with convolutions' input gradients as transposed convolutions "
                             "(CACHED_TRANSPOSED_INPUT_GRADS) or not; default: as shipped")
    parser.add_argument("--shrink", choices=["default", "on", "off"], default="default",
                        help="the solves' products on their still-iterating samples (SHRINK_TO_ACTIVE) or on the "
                             "whole batch; default: as shipped")
    parser.add_argument("--dropout", choices=["train", "eval"], default="train",
                        help="the rounds' nn.Dropout layers training (their masks replayed by the guard) or in eval "
                             "mode (both rounds)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the guarded round this many times in its process, each after the unguarded steps "
                             "timed again, and add ratio_min: the median over the steps of each step's least time "
                             "over the runs, guarded over unguarded (a shared machine's spread taken out)")
    parser.add_argument("--guard", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="GuardConfig fields beyond the normalisation (default: none, i.e. the defaults), "
                             "e.g. clip_per_sample=median max_rel_noise=40 max_excluded=0.25 rtol=0.01")
    args = parser.parse_args()
    settings = guard_settings(args.guard)
    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            plain = in_child(_round, name, batch, args.steps, args.train_steps, False, args.device, args.seed, settings,
                             "auto", None, "default", "default", args.dropout)
            guard = in_child(_round, name, batch, args.steps, args.train_steps, True, args.device, args.seed, settings,
                             args.products, args.compile_mode, args.transposed, args.shrink, args.dropout,
                             args.repeats)
            row = dict(model=name, guard=" ".join(args.guard) or "defaults", params=plain["params"], B=batch, steps=args.steps, device=args.device,
                       train_ms=plain["ms"], guard_ms=guard["ms"], ratio=guard["ms"] / plain["ms"],
                       train_ms_here=guard["here_ms"], ratio_here=guard["ms"] / guard["here_ms"],
                       ratio_mean_here=guard["mean_ms"] / guard["here_ms"],
                       products=guard["products"], sent=f"{guard['sent']}/{args.steps}", used=guard["used"],
                       left_out=guard["left_out"], rel_noise=guard["rel_noise"], noise_norm=guard["noise_norm"],
                       noise_norm_max=guard["noise_norm_max"], clip_share=guard["clip_share"],
                       rss_train_gb=plain["rss_gb"], rss_guard_gb=guard["rss_gb"],
                       acc_before=plain["acc_before"], acc_train=plain["acc_after"], acc_guard=guard["acc_after"])
            if args.repeats > 1:
                row.update(repeats=args.repeats, guard_min_ms=guard["min_ms"], train_min_ms=guard["here_min_ms"],
                           ratio_min=guard["min_ms"] / guard["here_min_ms"])
            if args.products != "auto":
                row["products_path"] = args.products
            if args.compile_mode is not None:
                row["compile_mode"] = args.compile_mode
            if args.transposed != "default":
                row["transposed"] = args.transposed
            if args.shrink != "default":
                row["shrink"] = args.shrink
            if args.dropout != "train":
                row["dropout"] = args.dropout
            if guard["gpu_gb"] is not None:  # on a CUDA device: the peak of its allocator, each round's own
                row.update(gpu_train_gb=plain["gpu_gb"], gpu_guard_gb=guard["gpu_gb"])
            rows.append(row)
            print(row, flush=True)
            for reason in guard["reasons"]:
                print("   withheld:", reason, flush=True)
    _, table = study_paths("bench_guard_models")
    print(write_table(rows, table))


if __name__ == "__main__":
    main()
