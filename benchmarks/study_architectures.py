"""Which models a practitioner brings does the guard take: torchvision's architectures through ``check_model``,
``fix_model`` and ``make_guarded`` with the defaults (only the normalisation given), one guarded step each.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_architectures.py [--batch 4] [--models a,b]

Each model is built untrained for 10 classes (ConvNeXt with two stages of 16 and 32 channels, stochastic depth 0.1;
the ViT with 8×8 patches, two layers of width 32; torchvision's own configurations otherwise, so that one CPU step takes
seconds), fixed (BatchNorm → GroupNorm), the layers ``check_model`` still lists put in eval mode (what its message
tells the user to do), and given one step of a ``photos32`` batch (offline colour crops). Printed: the problems
``check_model`` lists by kind before and after ``fix_model``, and the step's outcome — sent, or withheld with its
reason. An untrained model on a few samples may well need more noise than the budget: the point is that every
model runs to an answer the guard can stand behind, not that each sends (docs/results.md, "Models beyond ResNets").
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from torch import nn


def _builders() -> dict:
    import torchvision.models as tvm
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    from torchvision.models.vision_transformer import VisionTransformer

    return {
        "resnet18": lambda: tvm.resnet18(num_classes=10),
        "squeezenet1_1": lambda: tvm.squeezenet1_1(num_classes=10),
        "shufflenet_v2_x0_5": lambda: tvm.shufflenet_v2_x0_5(num_classes=10),
        "mobilenet_v3_small": lambda: tvm.mobilenet_v3_small(num_classes=10),
        "efficientnet_b0": lambda: tvm.efficientnet_b0(num_classes=10),
        "convnext_2stage": lambda: ConvNeXt(
            [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], stochastic_depth_prob=0.1, num_classes=10),
        "vit_2layer": lambda: VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10),
    }


def _kinds(problems: list[str]) -> str:
    kinds = Counter(p.split(": ", 1)[1].split(" ")[0].split("(")[0] for p in problems)
    return ", ".join(f"{n}× {k}" for k, n in sorted(kinds.items())) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
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
        listed = {p.split(":")[0] for p in after}
        for path, module in model.named_modules():
            if path in listed:
                module.eval()
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


if __name__ == "__main__":
    main()
