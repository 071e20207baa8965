"""The clipped operator's projection, s_i(I − ĝ_iĝ_iᵀ)w_i, as batched dot products against batched GEMVs.

``flguard.risk.clipped.ClippedJacobian._project`` projects each sample's parameter-space vector inside every J and Jᵀ
product on the cached path (and inside every K product until the K product's projection moved to the input space,
``ClippedJacobian.kmv``: the measurements in docs/results.md were of the K product). With one vector per sample it
uses batched dot products; this times the clipped Jᵀ product on a trained model's clipped operator
(``bench_guard_models.py``'s model, batch drawn with seed 1, clipped at the median per-sample norm) with that form
and with the batched-GEMV form it replaced (``bmm``/``baddbmm``, kept for k > 1), interleaved in one process so that
the machine's drift hits both alike, and prints the medians, their ratio and the largest difference of the two
products (float32 summation order).

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_clip_projection.py --model cnn --batch 32
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_clip_projection.py --model resnet20_gn --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_guard_models import _task
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.operator import JacobianOperator


def gemv_projection(self: ClippedJacobian, w: torch.Tensor) -> torch.Tensor:
    """The former form for every k: one batched GEMV for ⟨w_i, g_i⟩ and one for the update."""
    per = self.per.dense() if self.rows is None else self.per.dense()[self.rows]
    along = torch.bmm(w, per.unsqueeze(2)) * self.inverse_norm.square().view(-1, 1, 1)
    out = torch.baddbmm(w, along, per.unsqueeze(1), alpha=-1)
    return out.mul_(self.factor.view(-1, 1, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x, y), _, _ = _task(args.model, 150, "cpu", 0)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))[:args.batch]
    base = JacobianOperator(model, x[idx], y[idx])
    op = ClippedJacobian(base, float(base.per_sample_gradients().norm(dim=1).median()))
    u = torch.randn(args.batch, 1, op.dx, generator=torch.Generator().manual_seed(2))
    forms = {"dot products (shipped)": ClippedJacobian._project, "batched GEMVs (before)": gemv_projection}
    times: dict[str, list[float]] = {name: [] for name in forms}
    outputs = {}
    try:
        for name, form in forms.items():  # warm-up, and each form's product for the comparison
            ClippedJacobian._project = form
            outputs[name] = op.jt(u)
        for repeat in range(args.repeats):
            for name in (list(forms) if repeat % 2 else list(forms)[::-1]):
                ClippedJacobian._project = forms[name]
                start = time.perf_counter()
                op.jt(u)
                times[name].append(time.perf_counter() - start)
    finally:
        ClippedJacobian._project = forms["dot products (shipped)"]
    medians = {name: 1000 * statistics.median(values) for name, values in times.items()}
    shipped, before = medians.values()
    first, second = outputs.values()
    print(f"{args.model}, B = {args.batch}, clipped Jᵀ product, median ms: "
          + ", ".join(f"{name} {ms:.2f}" for name, ms in medians.items())
          + f"; shipped ÷ before {shipped / before:.3f}; largest difference ÷ largest entry "
          f"{float((first - second).abs().max() / second.abs().max()):.1e}")


if __name__ == "__main__":
    main()
