"""Which of torchvision's classification networks the guard measures on its batched products, after ``fix_model``.

A practitioner brings torchvision's model, fixes its BatchNorm (``flguard.fix_model``) and keeps the defaults. On a CPU
the guard's operator then takes the batched K products (``flguard.risk.ghost_products``) where the model allows them,
else the one-sample-at-a-time products (2–5× dearer, as exact). For each model this builds it with 10 classes, fixes
it, and in train mode on a batch of two random images records: ``check_model``'s problems (0: guardable), the
path its operator takes (the batched products, or one sample at a time with the reason the batched ones refused
the model) and one K product's time on that path. No training: the path is a property of the architecture.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python survey_torchvision_paths.py
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python survey_torchvision_paths.py --models swin_t,resnet50

Writes ``benchmarks/results/survey_torchvision_paths.csv`` and prints the table.
"""

from __future__ import annotations

import argparse

import torch

from _common import ms_per_call, write_table

#: The networks surveyed by default, and the input size each is run at (the others: 64×64).
MODELS = ("resnet18,resnet50,resnext50_32x4d,wide_resnet50_2,densenet121,mobilenet_v2,mobilenet_v3_small,"
          "efficientnet_b0,efficientnet_v2_s,mnasnet0_5,regnet_x_400mf,regnet_y_400mf,shufflenet_v2_x0_5,"
          "squeezenet1_1,googlenet,alexnet,vgg11,convnext_tiny,vit_tiny,swin_t,maxvit_t")
SIZES = {"swin_t": 224, "maxvit_t": 224, "vit_tiny": 32}


def _model(name: str) -> torch.nn.Module:
    import torchvision

    if name == "vit_tiny":  # torchvision's VisionTransformer, small enough for 32×32 images
        return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                    hidden_dim=32, mlp_dim=64, num_classes=10)
    extra = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    return getattr(torchvision.models, name)(num_classes=10, **extra)


def _product_ms(op, u: torch.Tensor) -> float:
    op.kmv(u)  # the first builds what the path keeps for the step
    return ms_per_call(lambda: op.kmv(u), 1)


def survey(name: str) -> dict:
    """One model's row (module doc): the guard's operator on a CPU (``products="ghost"``, what the guard asks)."""
    from flguard import check_model, fix_model
    from flguard.risk.operator import JacobianOperator

    torch.manual_seed(0)
    model = fix_model(_model(name)).train()
    size = SIZES.get(name, 64)
    x, y = torch.randn(2, 3, size, size), torch.tensor([0, 1])
    op = JacobianOperator(model, x, y, products="ghost")
    batched = op.direct and op.__dict__.get("_ghost") is not None
    refusal = getattr(op, "ghost_refused", None) or op.__dict__.get("_ghost_support")
    u = torch.randn(2, 1, 3 * size * size)
    return {"model": name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "input": size,
            "check_model": len(check_model(model)), "path": "batched" if batched else "one sample at a time",
            "refused_by": "" if batched else str(refusal), "k_product_ms": _product_ms(op, u)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS,
                        help="torchvision builders, comma-separated (vit_tiny: a small ViT)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        rows.append(survey(name))
        print(rows[-1], flush=True)
    print(write_table(rows, "results/survey_torchvision_paths.csv"))


if __name__ == "__main__":
    main()
