"""Issue 12 §3: the least a certified guard can cost per local round, from measured parts.

The guard's promise is checked on the noise actually sent: for every sample of every step it
needs how that noise moves the sample's reconstruction, so at least one product with the sample's
Jacobian block J_i, on an operator built for that step (parameters and batch change every step).
In one process, on the demo's trained CNN and one local epoch of client 0's batches (B = 32,
``torch.set_num_threads(1)``, medians over the batches) this times:

- a training step (forward, backward, SGD update), as the unguarded round runs it (20 steps back to
  back: the median of three rounds' per-step times): the unit;
- a new ``JacobianOperator`` on the batch with the products the guard takes on this device
  (``flguard.risk.sizing.guard_products``: on a CPU the batched ghost products, whose graphs the operator builds;
  ``--products`` for another path), wrapped in the demo's per-sample clipping (``ClippedJacobian``: per-sample
  gradients);
- its first and a later J product on one vector shared by the samples, as the guard applies J_i to the noise it
  sends (the first also takes the clipping's images J̃_ig̃_i, once an operator; on the cached path it builds the
  pullback of the gradient map), and a first and a later K = JJᵀ product;
- a Hessian-vector product of the batch loss for B vectors at once (``vmap``): what each later step
  of a round adds to one product with the exact multi-step Jacobian of the round's update,
  ∂(θ_T − θ_0)/∂x_i = −η Π_{s>t}(I − ηH_s) ∂g_t/∂x_i (plain SGD; J̃ᵀ and J̃ each pass T − t steps);

then runs the shipped guard (``bench_guard_round.measure_round``, the demo's GuardConfig) on the
same batches and prints the round ratio (guarded / unguarded round) of certificates of increasing
strength — each a floor computed from the parts, except the shipped guard's, which is measured:

1. any certificate on the sent noise: a new operator and one J product per step;
2. the cheapest I²F bound on the sent noise — CG's first iterate (‖x₁‖ ≤ ‖x*‖ for x₀ = 0) — the J
   product of its right-hand side and one K product, plus ε = eps·λmax from Lanczos (at least two K products:
   one step cannot converge);
3. the guard as shipped (measured round);
4. the round's update guarded once with the exact multi-step Jacobian: the shipped guard's
   products per step, each also carrying T − 1 B-vector HVPs on average.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_cost_floor.py [--steps 20] [--defenses gaussian eigen] [--device cuda]
        [--products guard|auto|cached|ghost]

Until 2026-12-01 the parts were timed on the operator's default products (the cached pullbacks on the CPU) with J
applied to a vector per sample, and row 2 took a first Jᵀ and a first J product for the iterate's K product; the guard
has taken the ghost products on a CPU since 2026-11-29, so rows 1 and 2 were floors of another implementation.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
from torch.func import functional_call, grad, jvp, vmap

from _common import demo_round, synchronize
from bench_guard_round import HEADER, measure_round, run_round
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator
from flguard.risk.sizing import guard_products


def _ms(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def hvp_batch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> Callable[[], torch.Tensor]:
    """A call that applies the batch loss's Hessian H = ∇²_θ L(x, θ) to ``k`` random vectors at once."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    tangents = {n: torch.randn(k, *p.shape, device=p.device) for n, p in params.items()}

    def loss(p):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    gradient = grad(loss)
    return lambda: vmap(lambda t: jvp(gradient, (params,), (t,))[1])(tangents)


def parts(model: torch.nn.Module, batches, lr: float, clip: float | None, products: str) -> dict[str, float]:
    """Median ms per batch of each part (see module doc) on the operator's ``products``; ``train``: per step of an
    unguarded round."""
    times: dict[str, list[float]] = {key: [] for key in ("operator", "j_first", "j", "k_first", "k", "hvp")}
    rounds = [run_round(copy.deepcopy(model), batches, lr)[0] * 1e3 / len(batches) for _ in range(3)]
    device = batches[0][0].device
    for x, y in batches:
        holder: dict = {}

        def build():
            op = JacobianOperator(model, x, y, products=products)
            holder["op"] = ClippedJacobian(op, clip) if clip is not None else op
        times["operator"].append(_ms(build, device))
        op, b = holder["op"], x.shape[0]
        # one vector for every sample, as the guard's noise (a stride-0 view: the batched path takes it once)
        v = torch.randn(1, 1, op.dtheta, device=device).expand(b, 1, op.dtheta)
        u = torch.randn(b, 1, op.dx, device=device)
        times["j_first"].append(_ms(lambda: op.j(v), device))
        times["j"].append(_ms(lambda: op.j(v), device))
        times["k_first"].append(_ms(lambda: op.kmv(u), device))
        times["k"].append(_ms(lambda: op.kmv(u), device))
        times["hvp"].append(_ms(hvp_batch(model, x, y, b), device))
    return {"train": statistics.median(rounds), **{key: statistics.median(values) for key, values in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="../simulations/default.toml")
    parser.add_argument("--defenses", nargs="+", default=["gaussian", "eigen"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: model, batches, parts and guard there")
    parser.add_argument("--products", choices=["guard", "auto", "cached", "ghost"], default="guard",
                        help="the parts' products: the guard's on this device (default), or a path of the operator's")
    args = parser.parse_args()
    products = guard_products(torch.device(args.device)) if args.products == "guard" else args.products
    torch.set_num_threads(args.threads)
    config, settings, model, batches = demo_round(args.config, args.steps, device=args.device)
    guard_configs = {name: config.guard_config(config.defense(name)) for name in args.defenses}
    clip = next(iter(guard_configs.values())).clip_per_sample
    run_round(copy.deepcopy(model), batches[:2], settings.lr)  # warm-up
    parts(model, batches[:2], settings.lr, clip, products)
    t = parts(model, batches, settings.lr, clip, products)
    steps, train = len(batches), t["train"]
    print(f"demo ({args.config}): {settings.model} on {settings.dataset}, client 0, B={batches[0][0].shape[0]}, "
          f"{steps} steps, clip C={clip}, {args.device}, torch threads={args.threads}, parts on products={products}")
    print("median ms per batch (÷ training step): " + ", ".join(
        f"{key} {value:.1f} ({value / train:.2f})" for key, value in t.items()))
    print(HEADER)
    rows = {name: measure_round(name, cfg, model, batches, settings.lr) for name, cfg in guard_configs.items()}

    # per guarded step, ms beyond the training step
    one_j = t["operator"] + t["j_first"]
    first_iterate = t["operator"] + t["j_first"] + t["k_first"] + 2 * t["k"]  # the rhs's J, Lanczos 2, the iterate's K
    print(f"\n{'certificate (per step, on the sent noise)':<62} {'guard ms/step':>13} {'round ×':>8}")
    print(f"{'1. any: a new operator + one J product':<62} {one_j:>13.1f} {1 + one_j / train:>8.1f}")
    print(f"{'2. cheapest I2F bound: CG first iterate + 2 Lanczos K products':<62} {first_iterate:>13.1f} "
          f"{1 + first_iterate / train:>8.1f}")
    for name, row in rows.items():
        print(f"{'3. shipped guard, ' + name + ' (measured round)':<62} {row['guard_ms']:>13.1f} "
              f"{row['round_ratio']:>8.1f}")
    for name, row in rows.items():
        multi = row["guard_ms"] + row["products"] / 2 * (steps - 1) * t["hvp"]
        print(f"{'4. round once, exact multi-step Jacobian, ' + name:<62} {multi:>13.1f} {1 + multi / train:>8.1f}")


if __name__ == "__main__":
    main()
