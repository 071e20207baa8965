"""ε study (seed 003 App. G): how the Tikhonov ε of I2F changes the fit to measured attack error.

For B = 1 FedSGD uploads of LeNet (uniform init) on MNIST-5k, Gaussian noise of several scales is
added to the gradient; DLG and GS reconstruct; each ε (relative to λmax) predicts the RMSE as
I2F/√dx. Reported per ε and attack: the share of uploads whose measured RMSE is at least the
prediction (the promise direction) and the median measured/predicted ratio.

    python benchmarks/study_eps.py [--samples 6] [--sigmas 0.01 0.03 0.1]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _common import model_and_batch
from flguard.attacks import reconstruct
from flguard.risk import assess

EPS = (1e-3, 1e-2, 1e-1, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.01, 0.03, 0.1],
                        help="noise std relative to the gradient's RMS entry")
    parser.add_argument("--gs-iterations", type=int, default=400)
    parser.add_argument("--dlg-steps", type=int, default=20)
    args = parser.parse_args()
    model, xs, ys, data = model_and_batch("lenet", "mnist5k", args.samples, offset=200)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []  # (attack, eps, measured, predicted)
    for i in range(args.samples):
        x, y = xs[i:i + 1], ys[i:i + 1]
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)])
        lam = assess(model, x, y, metrics=("lambda_max",)).lambda_max
        for sigma in args.sigmas:
            noise = sigma * g.norm() / g.numel() ** 0.5 * torch.randn(g.numel(), generator=torch.Generator().manual_seed(i))
            predicted = {e: float(assess(model, x, y, delta=noise, eps=e * lam, metrics=("rmse_i2f",)).rmse_i2f) for e in EPS}
            attacks = {
                "dlg": reconstruct(model, g + noise, x.shape[1:], method="dlg", labels=y, iterations=args.dlg_steps, seed=0),
                "gs": reconstruct(model, g + noise, x.shape[1:], method="gs", labels=y, iterations=args.gs_iterations,
                                  seed=0, mean=data.mean, std=data.std, tv=0.0),
            }
            for name, rec in attacks.items():
                measured = float((rec.images.detach() - x).pow(2).mean().sqrt())
                rows += [(name, e, measured, predicted[e]) for e in EPS]
    print(f"ε study: LeNet uniform init, MNIST-5k, B=1, {args.samples} samples × σ {args.sigmas} (× gradient RMS)")
    print(f"{'attack':<6} {'ε/λmax':>8} {'measured ≥ predicted':>21} {'median measured/predicted':>26}")
    for name in ("dlg", "gs"):
        for e in EPS:
            pairs = [(m, p) for a, ee, m, p in rows if a == name and ee == e]
            share = sum(m >= p for m, p in pairs) / len(pairs)
            ratio = statistics.median(m / p for m, p in pairs)
            print(f"{name:<6} {e:>8.0e} {share:>21.0%} {ratio:>26.2f}")


if __name__ == "__main__":
    main()
