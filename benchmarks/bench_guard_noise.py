"""P4: eigen-aware vs calibrated-Gaussian noise norm at the same floor τ, and the single-direction limit.

At equal predicted RMSE, isotropic noise of norm ‖δ‖ gives I ≈ ‖δ‖·√(Σ_j g_j²)/√dθ while the single
best direction gives I = ‖δ‖·max_j g_j (g_j = √λ_j/(λ_j+ε), the regularised gains), so no
perturbation can beat the noise-norm ratio √(Σ g²)/(max g·√dθ). The gains come from dense
eigenvalues of K_i (built from dx Jᵀ products).

    python benchmarks/bench_guard_noise.py [--tau 0.1] [--sizes 1 8] [--seeds 3]
"""

from __future__ import annotations

import argparse

import torch

from _common import model_and_batch
from flguard import Guard, GuardConfig
from flguard.defenses.eigen import regularised_gain
from flguard.risk.operator import JacobianOperator


def dense_kernel(op: JacobianOperator, chunk: int = 98) -> torch.Tensor:
    """K_i = J_iJ_iᵀ for every sample, from dx unit-vector products: [B, dx, dx]."""
    eye = torch.eye(op.dx, dtype=op.dtype)
    rows = [op.jt(eye[s:s + chunk].unsqueeze(0).expand(op.batch_size, -1, -1)) for s in range(0, op.dx, chunk)]
    jac = torch.cat(rows, dim=1)  # [B, dx, dθ]
    return jac @ jac.transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--dataset", default="mnist5k")
    args = parser.parse_args()
    print(f"P4: noise norm at equal τ={args.tau} (LeNet uniform init, {args.dataset}, ε = 1e-2·λmax)")
    print(f"{'B':>3} {'‖δ‖ gauss':>10} {'‖δ‖ eigen':>10} {'eigen/gauss':>12} {'limit':>8} {'(eigen/gauss)/limit':>20}")
    for size in args.sizes:
        model, x, y, _ = model_and_batch("lenet", args.dataset, size, offset=100)
        params = [p for p in model.parameters() if p.requires_grad]
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(
            torch.nn.functional.cross_entropy(model(x), y), params)])
        gauss, eigen = [], []
        for seed in range(args.seeds):
            for name, store in (("gaussian", gauss), ("eigen", eigen)):
                out = Guard(GuardConfig(defense=name, min_rmse=args.tau, seed=seed, max_rel_noise=1e9)).protect(model, x, y, g)
                assert out.report.met, out.report.reason
                store.append(out.report.noise_norm)
        lam = torch.linalg.eigvalsh(dense_kernel(JacobianOperator(model, x, y)).double())
        gain = regularised_gain(lam, 1e-2 * lam[:, -1:])
        limit = gain.pow(2).sum(1).sqrt() / (gain.max(1).values * g.numel() ** 0.5)
        ratio = (sum(eigen) / len(eigen)) / (sum(gauss) / len(gauss))
        hardest = float(limit.max())
        print(f"{size:>3} {sum(gauss) / len(gauss):>10.4g} {sum(eigen) / len(eigen):>10.4g} {ratio:>12.3f} "
              f"{hardest:>8.3f} {ratio / hardest:>20.2f}")
    print("limit: the single-best-direction ratio of the sample with the largest one (B > 1: max over samples)")


if __name__ == "__main__":
    main()
