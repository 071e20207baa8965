"""Could one deflation subspace, learnt on earlier steps, precondition every sample's solve? (reuse across steps)

The binding sample's I²F solve takes 11–12 CG iterations on the trained CNN (condition number ≈ (λmax+ε)/ε ≈ 100).
A subspace V shared by the samples — the leading principal directions of an earlier batch's samples' top Ritz vectors,
scaled by √θ — would fold each sample's top of the spectrum down if it spans its top eigenvectors. This measures how
far: per sample of later batches, λmax of the deflated block P·K_j·P (P = I − VVᵀ, 30 power steps) ÷ λmax(K_j), for
subspaces of 16 to 256 directions. A spectral preconditioner built on V needs each sample's VᵀK_jV, so a width w costs
w products per sample per step: useful only if a few directions fold most of the spectrum.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_shared_deflation.py --model cnn --batches 3
"""

from __future__ import annotations

import argparse

import torch

from bench_guard_models import trained_batches
from flguard.risk.operator import JacobianOperator
from flguard.risk.regularised import RegularisedK

RITZ_STEPS, POOLED_PER_SAMPLE, POWER_STEPS = 20, 8, 30
WIDTHS = (16, 64, 128, 256)


def main() -> None:
    _, model, _, batches = trained_batches(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    runs = []
    for _, x, y, _ in batches:
        op = JacobianOperator(model, x, y)
        spectrum = RegularisedK(op).lanczos(rtol=1e-3, ends="max", min_iter=RITZ_STEPS, max_iter=RITZ_STEPS,
                                            return_vectors=True, seed=0)
        runs.append((op, spectrum.ritz_values, spectrum.ritz_vectors))
    _, values, vectors = runs[0]  # the "earlier step": its samples' top Ritz vectors, pooled
    top = POOLED_PER_SAMPLE
    pooled = (vectors[:, -top:] * values[:, -top:, None].clamp_min(0).sqrt()).reshape(-1, vectors.shape[-1])
    directions = torch.linalg.svd(pooled.double(), full_matrices=False).Vh
    generator = torch.Generator().manual_seed(0)
    print("| shared directions | deflated λmax ÷ λmax: median | 90th percentile |\n|---|---|---|")
    for width in WIDTHS:
        basis = directions[:width].to(pooled)
        ratios = []
        for op, later_values, _ in runs[1:]:
            def deflated(u: torch.Tensor) -> torch.Tensor:
                u = u - (u @ basis.T) @ basis
                out = op.kmv(u.unsqueeze(1)).squeeze(1)
                return out - (out @ basis.T) @ basis

            v = torch.randn(op.batch_size, op.dx, generator=generator, dtype=pooled.dtype)
            for _ in range(POWER_STEPS):
                w = deflated(v)
                v = w / w.norm(dim=1, keepdim=True).clamp_min(1e-30)
            ratios.append((v * deflated(v)).sum(1) / later_values[:, -1])
        ratio = torch.cat(ratios)
        print(f"| {width} | {float(ratio.median()):.3f} | {float(ratio.quantile(0.9)):.3f} |", flush=True)


if __name__ == "__main__":
    main()
