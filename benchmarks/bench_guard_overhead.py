"""P3: guard time / local training time, FedSGD (one step of B=32) and one local epoch of FedAvg.

Training a step = forward, backward and an SGD update of LeNet on B samples. Guarding a step =
``Guard.protect`` on that batch's gradient (measurement, perturbation, verification). The FedAvg
epoch runs every step of a 4-client partition of MNIST-5k (1,250 samples); guarding is timed on
``--guarded-steps`` of its steps and scaled to the epoch (the per-step cost is what varies).

    python benchmarks/bench_guard_overhead.py [--batch 32] [--guarded-steps 3]

``--demo`` (issue 12 §3's protocol): the demo's own trained model and guard configs —
``simulations/default.toml``'s task (the warm-started quickstart CNN, ``initial_model``) and its
``gaussian`` and ``eigen`` GuardConfigs (``guard_values``) — one local epoch of ``--steps`` ≥ 20 SGD
steps at B = 32 on client 0's partition, CPU, 1 thread (``--device cuda``: the same on a GPU); per row the round ratio (guarded / unguarded
round wall time) beside the per-step one, and the cost model (Jacobian products per guarded step
by solver, ms per product against ms per training step), from ``bench_guard_round.measure_round``.
``--precondition off on`` runs each defense with plain CG and with the spectral PCG
(``flguard.guard.PRECONDITION_CG``); ``--compile off on`` without and with compiled K products;
``--shrink off on`` with the solves' products on the whole batch and on the still-iterating samples
only (``flguard.risk.regularised.SHRINK_TO_ACTIVE``, the default); ``--one-run off on`` gaussian with a
Lanczos run then (P)CG, and with λmax and the solve from one Lanczos run (``flguard.guard.LANCZOS_SOLVE``,
the default; with it ``--precondition`` does not apply to gaussian).

    python benchmarks/bench_guard_overhead.py --demo [--steps 20] [--precondition off on] [--device cuda]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from _common import model_and_batch
from flguard import Guard, GuardConfig


def step_gradient(model, x, y) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def train_step(model, x, y, lr: float = 0.05) -> None:
    g = step_gradient(model, x, y)
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p -= lr * g[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def demo(args) -> None:
    """The round and step ratios and the cost model on the demo's trained CNN and guard configs."""
    import copy

    import flguard.guard.floor as floor_module
    import flguard.guard.perturb as perturb_module
    import flguard.risk.regularised as regularised_module
    from _common import demo_round
    from bench_guard_round import HEADER, measure_round, run_round

    torch.set_num_threads(args.threads)
    config, settings, model, batches = demo_round(args.config, args.steps, args.batch, args.device)
    specs = [config.defense(name) for name in args.defenses]
    run_round(copy.deepcopy(model), batches[:2], settings.lr)  # warm-up
    print(f"demo ({args.config}): warm-started {settings.model} on {settings.dataset}, client 0, B={args.batch}, "
          f"{len(batches)} steps, lr {settings.lr}, {_device_name(args.device)}, torch threads={args.threads}")
    print(HEADER)
    for spec in specs:
        one_run = args.one_run if spec.defense == "gaussian" else ["on"]  # eigen's directions need the spectrum first
        for mode, compiled, shrink, joint in itertools.product(args.precondition, args.compile, args.shrink, one_run):
            floor_module.PRECONDITION_CG = mode == "on"
            perturb_module.LANCZOS_SOLVE = joint == "on"
            regularised_module.COMPILE_PRODUCTS = compiled == "on"
            regularised_module.COMPILE_MODE = args.compile_mode
            regularised_module.SHRINK_TO_ACTIVE = shrink == "on"
            label = (f"{spec.name}{'+1run' if joint == 'on' and spec.defense == 'gaussian' else ''}"
                     f"{'+pcg' if mode == 'on' else ''}{'+compile' if compiled == 'on' else ''}"
                     f"{'+shrink' if shrink == 'on' else ''}")
            measure_round(label, config.guard_config(spec), model, batches, settings.lr)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--demo", action="store_true", help="the demo's trained CNN and guard configs (issue 12 §3)")
    parser.add_argument("--config", default="simulations/default.toml")
    parser.add_argument("--defenses", nargs="+", default=["gaussian", "eigen"], help="--demo: defense names")
    parser.add_argument("--steps", type=int, default=20, help="--demo: local steps (one epoch)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="--demo: cpu or cuda (model, batches and guard there)")
    parser.add_argument("--precondition", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--compile", nargs="+", choices=["off", "on"], default=["off"],
                        help="--demo: K products through torch.compile (flguard.risk.regularised.COMPILE_PRODUCTS), "
                             "per row in turn; the first compile is inside the first compiled round's time")
    parser.add_argument("--compile-mode", default=None,
                        help="--demo: torch.compile's mode for --compile on (flguard.risk.regularised.COMPILE_MODE), "
                             "e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--shrink", nargs="+", choices=["off", "on"], default=["on"],
                        help="--demo: the solves' products on the still-iterating samples only "
                             "(flguard.risk.regularised.SHRINK_TO_ACTIVE), per row in turn")
    parser.add_argument("--one-run", nargs="+", choices=["off", "on"], default=["on"],
                        help="--demo, gaussian: λmax and the I²F solve from one Lanczos run "
                             "(flguard.guard.LANCZOS_SOLVE, the default) or a Lanczos run then (P)CG, per row in turn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--guarded-steps", type=int, default=3)
    parser.add_argument("--epoch-samples", type=int, default=1250)
    args = parser.parse_args()
    if args.demo:
        return demo(args)
    model, x, y, _ = model_and_batch("lenet", "mnist5k", args.epoch_samples, init="default")
    batches = list(zip(x.split(args.batch), y.split(args.batch)))
    train_step(model, *batches[0])  # warm-up
    start = time.perf_counter()
    for bx, by in batches:
        train_step(model, bx, by)
    epoch_train = time.perf_counter() - start
    step_train = epoch_train / len(batches)
    print(f"P3: LeNet (default init), MNIST-5k, B={args.batch}, τ={args.tau}; training: {step_train * 1e3:.1f} ms/step, "
          f"{epoch_train:.2f} s/epoch ({len(batches)} steps)")
    print(f"{'defense':<10} {'guard s/step':>13} {'FedSGD ratio':>13} {'epoch guard s':>14} {'FedAvg ratio':>13} {'met':>5}")
    for defense in ("gaussian", "eigen"):
        guard = Guard(GuardConfig(defense=defense, min_rmse=args.tau, seed=0, max_rel_noise=1e9))
        times, met = [], []
        for bx, by in batches[:args.guarded_steps]:
            g = step_gradient(model, bx, by)
            start = time.perf_counter()
            out = guard.protect(model, bx, by, g)
            times.append(time.perf_counter() - start)
            met.append(out.report.met)
        per_step = sum(times) / len(times)
        print(f"{defense:<10} {per_step:>13.2f} {per_step / step_train:>13.0f} {per_step * len(batches):>14.1f} "
              f"{per_step * len(batches) / epoch_train:>13.0f} {sum(met)}/{len(met)}")


if __name__ == "__main__":
    main()
