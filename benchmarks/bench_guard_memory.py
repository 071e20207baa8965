"""Peak memory of one guarded step against an unguarded training step, by model and batch size (issue 22 §3).

Each (model, B) runs in two child processes of their own, so each peak RSS is its own: one takes
``--steps`` plain training steps (forward + backward of the mean loss, an SGD update), the other the
same steps through ``Guard.protect`` with the defaults and the data's normalisation
(``GuardConfig(pixel_mean, pixel_std)``). Printed: both peaks, their ratio (the issue's goal at
ResNet-18-GN, B = 32: ≤ 3×), seconds per guarded step, Jacobian products per sample, which kind sent
and the reasons of withheld steps. The model is the zoo's at its seeded initialisation and the batch
is ``photos32`` (``mnist5k`` for the CNN): memory is a property of the architecture and the batch
size, not of training.

    OMP_NUM_THREADS=1 python benchmarks/bench_guard_memory.py --models resnet18_gn --batch 8,32
    OMP_NUM_THREADS=1 python benchmarks/bench_guard_memory.py --models resnet18_gn --batch 32 --defense rowspace
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F

from _common import in_child, study_paths, write_table

DATASETS = {"cnn": "mnist5k", "resnet8_gn": "photos32", "resnet20_gn": "photos32", "resnet18_gn": "photos32"}


def _step(name: str, batch: int, steps: int, guarded: bool, seed: int, defense: str = "auto") -> dict:
    from flguard import Guard, GuardConfig
    from flguard.data import load
    from flguard.models import create

    torch.manual_seed(seed)
    data = load(DATASETS[name])
    model = create(name, in_channels=data.shape[0], num_classes=data.num_classes, image_size=data.shape[1])
    guard = Guard(GuardConfig(defense=defense, pixel_mean=data.mean, pixel_std=data.std, seed=seed)) if guarded else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(seed)
    seconds, products, sent, used, reasons = [], [], 0, [], []
    for _ in range(steps):
        index = torch.randint(0, len(data), (batch,), generator=generator)
        x, y = data.normalize(data.images[index]), data.labels[index]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        start = time.perf_counter()
        if guard is not None:
            gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            out = guard.protect(model, x, y, gradient)
            products.append(out.report.matvecs)  # applications per sample (each counts its k vectors)
            used.append(out.report.details.get("defense_used", out.report.defense))
            if out.gradient is None:
                reasons.append(out.report.reason[:300])
                optimizer.zero_grad()
                seconds.append(time.perf_counter() - start)
                continue
            sent += 1
            offset = 0
            for p in model.parameters():
                p.grad.copy_(out.gradient[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return dict(rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, seconds=seconds,
                products=products, sent=sent, used=used, reasons=reasons,
                params=sum(p.numel() for p in model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18_gn")
    parser.add_argument("--batch", default="8,32", help="batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--defense", default="auto", help="the threshold defense (default: the default, auto)")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            plain = in_child(_step, name, batch, args.steps, False, args.seed)
            guard = in_child(_step, name, batch, args.steps, True, args.seed, args.defense)
            row = dict(model=name, params=plain["params"], B=batch, steps=args.steps, defense=args.defense, rss_train_gb=plain["rss_gb"],
                       rss_guard_gb=guard["rss_gb"], ratio=guard["rss_gb"] / plain["rss_gb"],
                       guard_s=sum(guard["seconds"]) / args.steps, products=sum(guard["products"]) / args.steps,
                       sent=f"{guard['sent']}/{args.steps}", used=",".join(guard["used"]))
            rows.append(row)
            print(row, flush=True)
            for reason in guard["reasons"]:
                print("   withheld:", reason, flush=True)
    _, table = study_paths("bench_guard_memory" + ("" if args.defense == "auto" else f"_{args.defense}"))
    print(write_table(rows, table))


if __name__ == "__main__":
    main()
