"""Why the guard withholds on a trained model (issue 12 §2): per-sample measurements, budget units, clipping.

Trains Flower's quickstart CNN (``cnn``) on MNIST-5k (Adam, B = 32, 3 epochs), floor ``--psnr`` dB
in pixels (τ = 10^(−psnr/20)/std input units, pixel box unless ``--no-bounds``), then:

1. per sample (B = ``--batch``) — confidence, loss, unscaled per-sample gradient norm ‖g_i‖,
   ‖J_i‖_F, λmax(K_i), and the noise norm that alone would put that sample on τ: with the isotropic
   draw the ``gaussian`` defense sends (c_i·‖z‖, c_i = τ√dx/‖(K_i+εI)⁻¹J_i z‖) and along the best
   eigen direction (τ√dx / max_j √λ_j/(λ_j+ε) over the Ritz values: the least any direction needs);
   each over the batch gradient norm ‖g‖ (unbounded: no box);
2. per update — the guard (``gaussian``, ``eigen``) with an unlimited budget, for each per-sample
   clipping norm C in ``--clips`` (``none``: no clipping), and the noise it needed in candidate
   budget units: ‖g‖ (the update before noise), mean‖g_i‖/√B, the batch's own SGD noise
   √(Σ‖g_i − ḡ‖²)/B, and C; the share withheld at a budget of 10 in each unit;
3. (``--round``) a local round: ``--steps`` SGD steps (lr ``--lr``) at B = ``--round-batch``,
   unguarded and guarded per (``--defenses``, C) at ``--budget``; test accuracy, updates sent,
   seconds (``none`` with a C is clipping alone, no noise).

    OMP_NUM_THREADS=1 python benchmarks/study_trained_guard.py            # parts 1-2, CPU ~3 min
    OMP_NUM_THREADS=1 python benchmarks/study_trained_guard.py --batches 0 --round --clips 1,none
    OMP_NUM_THREADS=1 python benchmarks/study_trained_guard.py --batches 0 --round --clips 1 \
        --defenses none,gaussian --steps 60                                # the withheld share
    python benchmarks/study_trained_guard.py --full --device cuda
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from _common import parse_study_args, study_argparser, study_paths, write_table
from flguard import Guard, GuardConfig
from flguard.data import load
from flguard.models import create
from flguard.risk import assess
from flguard.risk.assess import i2f_solve
from flguard.risk.lanczos import lanczos
from flguard.risk.operator import JacobianOperator


def train(data, epochs: int, seed: int, device: str):
    """The CNN trained with Adam (lr 1e-3, B = 32) on 80% of the data; (model, train, test)."""
    train_set, test_set = data.split(0.2, seed=seed)
    torch.manual_seed(seed)
    model = create("cnn", in_channels=1, image_size=28, num_classes=10).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x_all, y_all = data.normalize(train_set.images).to(device), train_set.labels.to(device)
    for _ in range(epochs):
        for idx in torch.randperm(len(y_all)).split(32):
            opt.zero_grad()
            F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            opt.step()
    return model.eval(), (x_all, y_all), (data.normalize(test_set.images).to(device), test_set.labels.to(device))


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean()) * 100


def flat_grad(model, x, y) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(F.cross_entropy(model(x), y), params)]).detach()


def per_sample_rows(model, x, y, tau: float, seed: int, batch_id: int) -> tuple[list[dict], dict]:
    """Part 1 for one batch: one row per sample, and the batch's gradient scales."""
    rep = assess(model, x, y, metrics=["grad_norm", "lambda_max", "jacobian_fro2"], seed=seed)
    op = JacobianOperator(model, x, y)
    g = flat_grad(model, x, y)
    per = op.per_sample_gradients()  # unscaled ∇θ ℓ_i
    eps = 1e-2 * rep.lambda_max
    z = torch.randn(op.dtheta, generator=torch.Generator().manual_seed(seed), dtype=g.dtype)
    shift, _, _, _ = i2f_solve(op, z, eps, 1e-3)
    root = op.dx ** 0.5
    need_gauss = tau * root / shift.norm(dim=1) * z.norm()
    spec = lanczos(lambda q: op.kmv(q.unsqueeze(1)).squeeze(1), op.batch_size, op.dx, like=op.x, rtol=1e-3,
                   ends="max", min_iter=64, seed=seed)
    lam = spec.ritz_values.clamp_min(0)
    best_gain = (lam.sqrt() / (lam + eps.unsqueeze(1))).max(1).values
    need_eigen = tau * root / best_gain
    with torch.no_grad():
        prob = F.softmax(model(x), 1)
    loss = F.cross_entropy(model(x), y, reduction="none").detach()
    gnorm = float(g.norm())
    rows = [dict(batch=batch_id, sample=i, p_true=float(prob[i, y[i]]), loss=float(loss[i]),
                 grad_norm=float(per[i].norm()), jac_fro=float(rep.jacobian_fro2[i].sqrt()),
                 lambda_max=float(rep.lambda_max[i]), need_gauss_rel=float(need_gauss[i]) / gnorm,
                 need_eigen_rel=float(need_eigen[i]) / gnorm) for i in range(op.batch_size)]
    scales = dict(batch_grad=gnorm, mean_sample=float(per.norm(dim=1).mean()) / math.sqrt(op.batch_size),
                  sgd_noise=float((per - per.mean(0)).norm(dim=1).pow(2).sum().sqrt()) / op.batch_size)
    return rows, scales


def guard_rows(model, x, y, cfg_kw: dict, scales: dict, batch_id: int, clips: list) -> list[dict]:
    """Part 2 for one batch: each defense's needed noise in each candidate unit, per clipping norm C
    (None: no clipping; with C the noise is also given relative to C and to the clipped update)."""
    rows = []
    for clip in clips:
        for defense in ("gaussian", "eigen"):
            guard = Guard(GuardConfig(defense=defense, max_rel_noise=1e6, clip_per_sample=clip, **cfg_kw))
            start = time.perf_counter()
            out = guard.protect(model, x, y, flat_grad(model, x, y))
            rep = out.report
            sent = rep.noise_norm / rep.rel_noise if rep.rel_noise else float("nan")  # ‖update before noise‖
            rows.append(dict(batch=batch_id, clip=clip or "-", defense=defense, met=rep.met,
                             seconds=time.perf_counter() - start, min_rmse_after=float(rep.rmse_after.min()),
                             noise=rep.noise_norm, rel_update=rep.rel_noise,
                             rel_clip=rep.noise_norm / clip if clip else float("nan"),
                             **{f"rel_{k}": rep.noise_norm / v for k, v in scales.items()},
                             update_norm=sent, reason=rep.reason[:50]))
    return rows


def local_round(model, train_xy, test_xy, cfg_kw: dict | None, steps: int, batch: int, lr: float, seed: int):
    """``steps`` SGD steps from a copy of ``model``; guarded (dropped updates skipped) when cfg_kw."""
    import copy

    local = copy.deepcopy(model)
    params = [p for p in local.parameters() if p.requires_grad]
    guard = Guard(GuardConfig(**cfg_kw)) if cfg_kw is not None else None
    gen = torch.Generator().manual_seed(seed)
    sent, start = 0, time.perf_counter()
    for idx in torch.randperm(len(train_xy[1]), generator=gen)[:steps * batch].split(batch):
        x, y = train_xy[0][idx], train_xy[1][idx]
        g = flat_grad(local, x, y)
        if guard is not None:
            out = guard.protect(local, x, y, g)
            g = out.gradient
        if g is None:
            print(f"    withheld: {out.report.reason[:110]}", flush=True)
            continue
        sent += 1
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= lr * g[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
    return accuracy(local, *test_xy), sent, time.perf_counter() - start


def main() -> None:
    parser = study_argparser(__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--psnr", type=float, default=20.0, help="floor in pixel PSNR (dB); τ = 10^(−psnr/20)/std")
    parser.add_argument("--clips", default="none,1,5", help="per-sample clipping norms C to compare")
    parser.add_argument("--no-bounds", action="store_true", help="guard without the pixel box")
    parser.add_argument("--round", action="store_true", help="also run a guarded local round (part 3)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--round-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--defenses", default="gaussian,eigen", help="defenses in the local round")
    parser.add_argument("--budget", type=float, default=10.0, help="max_rel_noise in the local round")
    args = parse_study_args(parser, full=dict(batches=16), cpu=dict(batches=3))
    data = load("mnist5k")
    t0 = time.perf_counter()
    model, train_xy, test_xy = train(data, args.epochs, args.seed, args.device)
    print(f"trained cnn: test accuracy {accuracy(model, *test_xy):.1f}% ({time.perf_counter() - t0:.0f} s)")
    std, mean = data.std[0], data.mean[0]
    tau = 10 ** (-args.psnr / 20) / std
    box = ((0 - mean) / std, (1 - mean) / std)
    cfg_kw = dict(min_rmse=tau, input_bounds=None if args.no_bounds else box, seed=args.seed)
    print(f"floor {args.psnr} dB pixel PSNR → τ = {tau:.4g} input units; pixel box {box[0]:.3f}..{box[1]:.3f}")
    samples, guarded = [], []
    clips = [None if c == "none" else float(c) for c in args.clips.split(",")]
    for b in range(args.batches):
        idx = torch.arange(b * args.batch, (b + 1) * args.batch) + 1000
        x, y = train_xy[0][idx], train_xy[1][idx]
        rows, scales = per_sample_rows(model, x, y, tau, args.seed + b, b)
        samples += rows
        guarded += guard_rows(model, x, y, cfg_kw, scales, b, clips)
        print(f"batch {b}: ‖g‖={scales['batch_grad']:.3g} mean‖g_i‖/√B={scales['mean_sample']:.3g} "
              f"sgd-noise={scales['sgd_noise']:.3g}")
    _, table = study_paths("trained_guard")
    if samples:
        report_batches(samples, guarded, clips, table)
    if args.round:
        run_round(model, train_xy, test_xy, cfg_kw, clips, args, table)


def report_batches(samples: list, guarded: list, clips: list, table) -> None:
    print("\n## per sample\n" + write_table(samples, table, digits=3))
    print("\n## per update (unlimited budget; noise in candidate units)\n"
          + write_table(guarded, table.with_name("trained_guard_updates.csv"), digits=3))
    for clip in clips:
        for defense in ("gaussian", "eigen"):
            rows = [r for r in guarded if r["defense"] == defense and r["clip"] == (clip or "-")]
            units = ("batch_grad", "mean_sample", "sgd_noise") + (("clip",) if clip else ())
            shares = {u: sum(r[f"rel_{u}"] > 10 or not r["met"] for r in rows) / len(rows) for u in units}
            print(f"C={clip} {defense}: withheld at budget 10× — "
                  + ", ".join(f"{u}: {s:.0%}" for u, s in shares.items()))


def run_round(model, train_xy, test_xy, cfg_kw: dict, clips: list, args, table) -> None:
    """Part 3: the same local round unguarded and guarded per (defense, C), each row as it finishes."""
    unguarded = local_round(model, train_xy, test_xy, None, args.steps, args.round_batch, args.lr, args.seed)
    rows = [dict(policy="start", acc=accuracy(model, *test_xy), sent="", seconds=""),
            dict(policy="unguarded", acc=unguarded[0], sent=unguarded[1], seconds=unguarded[2])]
    print(rows)
    for clip in clips:
        for defense in args.defenses.split(","):
            res = local_round(model, train_xy, test_xy,
                              dict(cfg_kw, defense=defense, clip_per_sample=clip, max_rel_noise=args.budget),
                              args.steps, args.round_batch, args.lr, args.seed)
            rows.append(dict(policy=f"{defense} C={clip}", acc=res[0], sent=res[1], seconds=res[2]))
            print(rows[-1], flush=True)
    print("\n## local round\n" + write_table(rows, table.with_name("trained_guard_round.csv"), digits=4))

if __name__ == "__main__":
    main()
