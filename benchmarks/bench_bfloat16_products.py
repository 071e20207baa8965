"""Whether bfloat16 could carry the guard's products on a CPU with bfloat16 matrix units (AMX): one sample's
transposed product J_iᵀv = ∇θ⟨∇ₓℓ, v⟩ (a double backward) in float32, in a bfloat16 copy of the model, and under
``torch.autocast("cpu", torch.bfloat16)``, timed (medians of five after a warm-up) with the bfloat16 product's error
relative to float32's; a training step at B = 8 in float32 for scale.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_bfloat16_products.py --model resnet18_gn
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_bfloat16_products.py --model resnet20_gn

docs/results.md, "### Left" (2026-11-28, seventh session).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _jt(model, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    inputs = x.to(dtype).requires_grad_(True)
    params = list(model.parameters())
    loss = F.cross_entropy(model(inputs).float(), y)
    (gx,) = torch.autograd.grad(loss, inputs, create_graph=True)
    return torch.autograd.grad((gx * v.to(dtype)).sum(), params)


def _median_seconds(run, repeats: int = 5) -> float:
    run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    from flguard.models import create

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_gn", choices=["resnet18_gn", "resnet20_gn"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = create(args.model, image_size=32)
    low = create(args.model, image_size=32)
    low.load_state_dict(model.state_dict())
    low = low.to(torch.bfloat16)
    x, y, v = torch.randn(1, 3, 32, 32), torch.tensor([3]), torch.randn(1, 3, 32, 32)

    def autocast() -> tuple[torch.Tensor, ...]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _jt(model, x, y, v, torch.float32)

    full = _median_seconds(lambda: _jt(model, x, y, v, torch.float32))
    half = _median_seconds(lambda: _jt(low, x, y, v, torch.bfloat16))
    mixed = _median_seconds(autocast)
    exact, rough = _jt(model, x, y, v, torch.float32), _jt(low, x, y, v, torch.bfloat16)
    error = sum(float(((a - b.float()) ** 2).sum()) for a, b in zip(exact, rough)) ** 0.5
    error /= sum(float((a ** 2).sum()) for a in exact) ** 0.5
    batch, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def train() -> None:
        model.zero_grad()
        F.cross_entropy(model(batch), labels).backward()

    print(f"{args.model}: one sample's Jᵀv  float32 {1000 * full:.1f} ms | bfloat16 model {1000 * half:.1f} ms | "
          f"autocast {1000 * mixed:.1f} ms | bfloat16's error {error:.3g} of the product | "
          f"training step at B = 8 (float32) {1000 * _median_seconds(train):.1f} ms")


if __name__ == "__main__":
    main()
