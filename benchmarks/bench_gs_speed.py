"""P6: GS iterations per second, restarts batched (one vmap-ed problem) vs a naive Python loop.

For LeNet and ResNet18 on 32×32×3 inputs it times

- ``batched R=1``   one GS candidate (plain autograd),
- ``batched R=8``   8 restarts as one batch (``torch.func.vmap`` over candidates),
- ``naive R=8``     the same 8 restarts as 8 independent GS runs in a Python loop,

and prints candidate-iterations per second and the speed-up of batching over the naive loop,
all from one run. Usage::

    python benchmarks/bench_gs_speed.py [--device cuda] [--lenet-iterations 30] [--resnet-iterations 4]

Timings exclude one warm-up run per configuration; on CUDA the device is synchronised.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from flguard.attacks import reconstruct
from flguard.models import create


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _target(model: torch.nn.Module, device: torch.device) -> list[torch.Tensor]:
    x = torch.rand(1, 3, 32, 32, device=device)
    y = torch.tensor([3], device=device)
    return [g.detach() for g in torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))]


def _run(model, target, iterations: int, restarts: int, naive: bool, device: torch.device) -> float:
    """Seconds for ``iterations`` GS iterations of ``restarts`` candidates."""
    kwargs = dict(method="gs", labels=[3], iterations=iterations, device=device, tv=1e-1, log_every=0)
    _sync(device)
    start = time.perf_counter()
    if naive:
        for r in range(restarts):
            reconstruct(model, target, (3, 32, 32), restarts=1, seed=r, **kwargs)
    else:
        reconstruct(model, target, (3, 32, 32), restarts=restarts, seed=0, **kwargs)
    _sync(device)
    return time.perf_counter() - start


def bench(name: str, iterations: int, restarts: int, device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    model = create(name, in_channels=3, num_classes=10, image_size=32,
                   init="uniform" if name == "lenet" else "default").to(device)
    model.eval()  # ResNet18: BatchNorm with running statistics, no cross-sample coupling
    target = _target(model, device)
    rates = {}
    for label, r, naive in (("batched R=1", 1, False), (f"batched R={restarts}", restarts, False),
                            (f"naive R={restarts}", restarts, True)):
        _run(model, target, 1, r, naive, device)  # warm-up (allocations, vmap tracing caches)
        seconds = _run(model, target, iterations, r, naive, device)
        rates[label] = r * iterations / seconds
        print(f"{name:9s} {label:13s} {iterations:4d} its  {seconds:8.2f} s  "
              f"{rates[label]:9.2f} candidate-its/s  {iterations / seconds:8.2f} its/s", flush=True)
    batched, naive_rate = rates[f"batched R={restarts}"], rates[f"naive R={restarts}"]
    print(f"{name:9s} speed-up of batching {restarts} restarts over the naive loop: {batched / naive_rate:.2f}x; "
          f"R={restarts} batch costs {rates['batched R=1'] / batched * restarts:.2f}x one R=1 iteration", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--restarts", type=int, default=8)
    parser.add_argument("--lenet-iterations", type=int, default=30)
    parser.add_argument("--resnet-iterations", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}", flush=True)
    bench("lenet", args.lenet_iterations, args.restarts, device)
    bench("resnet18", args.resnet_iterations, args.restarts, device)


if __name__ == "__main__":
    main()
