"""Issue 12 §3: guarded local round / unguarded local round, with the guard's cost model.

One process, CPU, ``torch.set_num_threads(1)`` (stable ratios on a shared machine). The quickstart
CNN (``create("cnn", in_channels=1, image_size=28, num_classes=10)``) is first trained for
``--pretrain`` SGD steps on MNIST-5k so the guard sees a realistic model; then one local epoch of
``--steps`` SGD steps at B=32 is run unguarded and, back to back on the same batches and starting
parameters, guarded (each step's gradient passes through ``Guard.protect`` before the update). The
round-level ratio is guarded round wall time / unguarded round wall time.

Cost model: Jacobian products (operator applications per sample) per guarded step, split into
Lanczos (λmax, sets ε), CG (I²F solves, incl. verification; for gaussian with
``flguard.guard.LANCZOS_SOLVE`` the one Lanczos run that gives both) and other (eigen directions, …),
ms per product and ms per training step. The split is taken by wrapping the Lanczos behind
``RegularisedK.lanczos`` and ``flguard.guard.i2f_solve`` (timing only; results untouched).
``measure_round`` is the one measurement; ``bench_guard_overhead.py --demo`` reuses it.

    python benchmarks/bench_guard_round.py [--steps 20] [--pretrain 100] [--defenses gaussian eigen]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import flguard.guard.floor as floor_module
import flguard.guard.perturb as perturb_module
import flguard.risk.regularised as regularised_module
from _common import synchronize
from flguard import Guard, GuardConfig
from flguard.data import load
from flguard.models import create

COUNTS = {"lanczos": 0, "cg": 0, "lanczos_s": 0.0, "cg_s": 0.0}


def _wrap() -> None:
    """Count products and time spent in the guard's Lanczos and CG calls (idempotent)."""
    if getattr(floor_module.i2f_solve, "counted", False):
        return
    lanczos, i2f_solve = regularised_module.lanczos, floor_module.i2f_solve

    def lanczos_counted(*a, **k):
        start = time.perf_counter()
        result = lanczos(*a, **k)
        COUNTS["lanczos_s"] += time.perf_counter() - start
        COUNTS["lanczos"] += 2 * result.matvecs  # each K product = Jᵀ then J: two applications
        return result

    i2f_counted = _counted(i2f_solve)
    i2f_counted.counted = True
    regularised_module.lanczos, floor_module.i2f_solve = lanczos_counted, i2f_counted
    # the gaussian guard's one-run λmax + solve (flguard.guard.perturb.LANCZOS_SOLVE) has no separate Lanczos: "cg"
    perturb_module.i2f_solve_with_lambda_max = _counted(perturb_module.i2f_solve_with_lambda_max)


def _counted(solver):
    def counted(op, *a, **k):
        before, start = op.applications, time.perf_counter()
        out = solver(op, *a, **k)
        COUNTS["cg_s"] += time.perf_counter() - start
        COUNTS["cg"] += op.applications - before
        return out
    return counted


def step_gradient(model, x, y) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def apply_update(model, g, lr) -> None:
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p -= lr * g[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def run_round(model, batches, lr, guard=None):
    """(seconds, per-step report list) of one local round; guard None = unguarded. On a GPU the
    clock is read after the device's queue is drained, at both ends."""
    device = next(model.parameters()).device
    reports = []
    synchronize(device)
    start = time.perf_counter()
    for bx, by in batches:
        g = step_gradient(model, bx, by)
        if guard is not None:
            out = guard.protect(model, bx, by, g)
            reports.append(out.report)
            if out.gradient is None:  # withheld: nothing is uploaded, no update
                continue
            g = out.gradient
        apply_update(model, g, lr)
    synchronize(device)
    return time.perf_counter() - start, reports


#: round × = guarded round / unguarded round (wall); step × = Guard.protect per step / training step.
HEADER = (f"{'defense':<9} {'plain s':>8} {'guarded s':>10} {'round ×':>8} {'step ×':>7} {'step ms':>8} "
          f"{'guard ms/step':>13} {'prod/step':>9} {'lanczos':>8} {'cg':>6} {'other':>6} {'ms/prod':>8} "
          f"{'prod/train step':>15} {'lanczos s':>9} {'cg s':>6} {'met':>6}")


def measure_round(label: str, config: GuardConfig, base, rnd, lr: float) -> dict:
    """One unguarded and one guarded local round from ``base`` on batches ``rnd``, back to back;
    the row's figures (printed as in HEADER) in a dict."""
    _wrap()
    plain, _ = run_round(copy.deepcopy(base), rnd, lr)
    for key in COUNTS:
        COUNTS[key] = 0
    guarded, reports = run_round(copy.deepcopy(base), rnd, lr, Guard(config))
    n = len(rnd)
    products = sum(r.matvecs for r in reports) / n
    lz, cg = COUNTS["lanczos"] / n, COUNTS["cg"] / n
    # per step: Guard.protect's own time (its report) against an unguarded training step
    step_ms, guard_ms = plain / n * 1e3, sum(r.seconds for r in reports) / n * 1e3
    ms_product = guard_ms / max(products, 1)
    row = dict(defense=label, plain_s=plain, guarded_s=guarded, round_ratio=guarded / plain,
               step_ratio=guard_ms / step_ms, step_ms=step_ms, guard_ms=guard_ms, products=products,
               lanczos=lz, cg=cg, other=products - lz - cg, ms_product=ms_product,
               product_steps=ms_product / step_ms, lanczos_s=COUNTS["lanczos_s"], cg_s=COUNTS["cg_s"],
               met=sum(bool(r.met) for r in reports), steps=n,
               rel_noise=sorted(r.rel_noise for r in reports)[n // 2])
    print(f"{label:<9} {plain:>8.2f} {guarded:>10.2f} {row['round_ratio']:>8.1f} {row['step_ratio']:>7.1f} "
          f"{step_ms:>8.1f} {guard_ms:>13.0f} {products:>9.1f} {lz:>8.1f} {cg:>6.1f} {row['other']:>6.1f} "
          f"{ms_product:>8.2f} {row['product_steps']:>15.1f} {COUNTS['lanczos_s']:>9.1f} {COUNTS['cg_s']:>6.1f} "
          f"{row['met']}/{n}  rel_noise median {row['rel_noise']:.3g}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pretrain", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--defenses", nargs="+", default=["gaussian", "eigen"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rtol", type=float, default=None, help="GuardConfig.rtol (default: the config's)")
    parser.add_argument("--krylov-steps", type=int, default=None, help="GuardConfig.krylov_steps (eigen)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = load("mnist5k")
    model = create("cnn", in_channels=1, image_size=28, num_classes=10)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    x, y = data.normalize(data.images[order]), data.labels[order]
    batches = list(zip(x.split(args.batch), y.split(args.batch)))
    for i in range(args.pretrain):  # "trained a bit"
        bx, by = batches[i % len(batches)]
        apply_update(model, step_gradient(model, bx, by), args.lr)
    rnd = batches[args.pretrain:args.pretrain + args.steps]
    base = copy.deepcopy(model)
    run_round(copy.deepcopy(base), rnd[:2], args.lr)  # warm-up
    print(f"round: quickstart CNN ({args.pretrain} pre-training steps), MNIST-5k, B={args.batch}, {len(rnd)} steps, "
          f"τ={args.tau}, CPU, torch threads={args.threads}")
    print(HEADER)
    for defense in args.defenses:
        extra = {} if args.rtol is None else {"rtol": args.rtol}
        if args.krylov_steps is not None and defense == "eigen":  # an eigen field: the others reject it
            extra["krylov_steps"] = args.krylov_steps
        config = GuardConfig(defense=defense, min_rmse=args.tau, seed=0, max_rel_noise=1e9, **extra)
        measure_round(defense, config, base, rnd, args.lr)


if __name__ == "__main__":
    main()
