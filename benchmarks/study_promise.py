"""Promise check (issue 7, study 8): does the guard's per-sample floor τ hold against real attacks?

The guard promises that every sample's predicted recovery RMSE (I2F, model-input units) is at
least τ. Here the promise is measured: FedSGD uploads of B = 1 and B = 8 samples are guarded with
the ``gaussian`` and ``eigen`` defenses at several τ, and the server attacks what was sent —
DLG, GS, and for B = 1 (invertible activations) R-GAP and the hybrid attack — with the true labels.
Per sample, the best attack is the one with the lowest RMSE to the truth (model-input units,
Hungarian-matched for B = 8 as ``flguard.server.score_batch`` does); the promise is
kept for that sample when this RMSE ≥ τ. The adaptive attacker (``flguard.attacks.adaptive``,
knowing the defense) is scored on its own line, and against all attacks together.

The model is Chen & Campbell's CNN2 V1 (tanh, default init) on MNIST-5k: every attack here
reconstructs an unguarded upload almost exactly (the "none" control row), so an error ≥ τ is the
guard's doing, not an attack failure. ``--full`` adds the I2F LeNet (uniform init), 3 restarts and
longer attacks.

``--model cnn --trained`` (issue 12) checks the promise where the demo makes it: Flower's
quickstart CNN (ReLU) warm-started exactly as the demo's server does (``flguard.simulation.task``:
``initial_model`` on ``public_indices`` — 1,000 public MNIST-5k examples, 6 epochs of Adam,
≈ 91.6% on the rest), uploads of samples that are NOT in the public split (the clients' data), and
the demo's own guard configs, built from ``--config`` (``simulations/default.toml``) with
``flguard.compare.config.load_config`` / ``guard_values``: a 15 dB pixel-PSNR floor (τ ≈ 0.576
input units), pixel box, ``clip_per_sample`` 1, gaussian ``max_rel_noise`` 40, eigen 10 with
``krylov_steps`` 8 / ``subspace_size`` 4, ``rtol`` 1e-2, ``max_excluded`` 0.25. In this mode:
- GS runs in the server's strongest-attack mode (``strongest=True``: the TV sweep 0 / 1e-4 / 1e-2 /
  0.1, the candidate with the lowest matching loss kept, as ``attack-hp-strongest`` makes
  ``flguard.server`` do), DLG beside it; the adaptive attacker runs on strongest GS as well;
- R-GAP and the hybrid attack are skipped: they need invertible activations, the CNN uses ReLU;
- every reconstruction is clipped to the pixel box before scoring (a projection onto a set that
  holds the truth: it never hurts the attacker, and the floor is stated against box-clipping
  attackers);
- samples the guard leaves out (``max_excluded``; ``report.rmse_after`` = +inf) have no gradient
  in the upload: the attacker is told how many samples remain (the ``guard_excluded`` reply
  metric) and attacks a batch of that size with the kept samples' labels; the left-out samples
  are reported apart (with the nearest reconstruction of any attack, as a sanity check), never
  mixed into the kept share;
- at B = 8 a ``clip`` control (per-sample clipping to C, no noise) separates what clipping alone
  does to batch attacks from what the noise does;
- the ``none`` control is scored at the demo's τ, so its "kept" column is the share of samples
  the attacks fail to bring within τ even unguarded (the attacks' weakness, not the guard's work);
  the adaptive attacker is not run on it (no defense to adapt to).

    python benchmarks/study_promise.py                              # CPU, ~8 min
    python benchmarks/study_promise.py --full --device cuda
    python benchmarks/study_promise.py --subspace-size 8 --krylov-steps 32 --no-bounds   # the guard before issue 7
    python benchmarks/study_promise.py --model cnn --trained        # issue 12: the demo's model and guards, CPU ≤ 12 min
    python benchmarks/study_promise.py --model cnn --trained --defaults --tag _defaults   # issue 22: the defaults
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from _common import guard_settings, model_and_batch
from _promise_tables import STANDARD, figure, read_rows, report, summarise, write_csv
from flguard import Guard, GuardConfig
from flguard.guard.clipping import lower_quantile, retained_clip_level
from flguard.attacks import metrics, reconstruct

ROOT = Path(__file__).resolve().parents[1]


def batch_gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])


def per_sample_rmse(images: torch.Tensor, truth: torch.Tensor, data) -> torch.Tensor:
    """RMSE per true sample in model-input units after Hungarian matching on clamped pixels."""
    permutation = metrics.match(data.denormalize(images).clamp(0, 1), data.denormalize(truth).clamp(0, 1))
    return (images[permutation] - truth).flatten(1).pow(2).mean(1).sqrt()


def attacks(model, gradient, x, y, data, args, guard_subspace: int, adaptive: bool = True) -> dict[str, torch.Tensor]:
    """Every attack's per-sample RMSE on one upload; the adaptive one reuses GS as its first pass.

    With ``args.trained`` (issue 12): GS in the strongest-attack mode, no R-GAP / hybrid (ReLU),
    reconstructions clipped to the pixel box before scoring; ``extra`` images are returned under
    ``"_images"`` (every attack's reconstruction, for the left-out samples' sanity check)."""
    batch = x.shape[0]
    common = dict(labels=y, batch_size=batch, restarts=args.restarts, device=args.device, seed=0)
    base_hp = {"strongest": True} if args.trained else {"tv": args.tv}
    gs_hp = dict(mean=data.mean, std=data.std, **base_hp)
    gs_iterations = args.gs_iterations if batch == 1 else args.gs_iterations_batch
    out, images = {}, {}
    runs = [("dlg", dict(iterations=args.dlg_steps)), ("gs", dict(iterations=gs_iterations, **gs_hp))]
    if batch == 1 and not args.trained:
        runs += [("rgap", {}), ("hybrid", dict(iterations=args.hybrid_iterations))]
    box = args.box if args.trained else None

    def score(rec: torch.Tensor) -> torch.Tensor:
        rec = rec.detach()
        return per_sample_rmse(rec.clamp(*box) if box else rec, x, data)

    for name, hp in runs:
        kw = dict(common, restarts=1) if name in ("rgap", "hybrid") else common
        try:
            rec = reconstruct(model, gradient, x.shape[1:], method=name, **kw, **hp)
            images[name] = rec.images.detach()
            out[name] = score(images[name])
        except ValueError as error:  # an architecture the method does not support
            print(f"    {name} skipped: {error}", file=sys.stderr)
    if adaptive:
        # It knows the defense's subspace_size and covers it with margin (a smaller factor for B = 8,
        # whose 8 subspaces are estimated together, to bound the CPU cost).
        factor = args.adaptive_factor if batch == 1 else max(1, args.adaptive_factor // 2)
        size = factor * guard_subspace
        rec = reconstruct(model, gradient, x.shape[1:], method="adaptive", iterations=gs_iterations, base="gs",
                          subspace=size, krylov_steps=2 * size, mean=data.mean, std=data.std,
                          base_hyperparameters=base_hp, first_images=images["gs"], **common)
        images["adaptive"] = rec.images.detach()
        out["adaptive"] = score(images["adaptive"])
    out["_images"] = torch.cat([v.clamp(*box) if box else v for v in images.values()])
    return out


def clipped_upload(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float | str,
                   quantile: float = 0.5, retention: float = 0.25) -> torch.Tensor:
    """The ``clip`` control: Σ_i min(1, C/‖g_i‖)·g_i / B — per-sample clipping, no noise (C = the lower
    median of the per-sample norms for ``"median"``, as the guard's default; their lower ``quantile``
    quantile for ``"quantile"``: ``flguard.guard.clipping.lower_quantile``, as the guard's ``clip_level``; for
    ``"retention"`` ``flguard.guard.clipping.retained_clip_level`` from the median up)."""
    rows = [batch_gradient(model, x[i:i + 1], y[i:i + 1]) for i in range(x.shape[0])]
    if isinstance(clip, str):
        per = torch.stack(rows)
        level = lower_quantile(per.norm(dim=1), quantile if clip == "quantile" else 0.5)
        clip = retained_clip_level(per, level, retention) if clip == "retention" else level
    return sum(g * min(1.0, clip / float(g.norm().clamp_min(1e-30))) for g in rows) / x.shape[0]


def trained_setup(args) -> None:
    """``--trained``: the demo's task and guard configs from ``args.config`` (issue 12)."""
    from flguard.compare.config import load_config
    from flguard.simulation.task import TaskSettings

    config = load_config(args.config)
    if config.task.model != args.model:
        raise SystemExit(f"--trained uses {args.config}'s model {config.task.model!r}; give --model {config.task.model}")
    args.demo = config
    args.settings = TaskSettings.from_config(config.run_config(config.defense("none")))
    args.dataset = config.task.dataset
    if args.defaults:  # issue 22: GuardConfig with only the data's normalisation, every other field the default
        from flguard.simulation.task import load_dataset

        data = load_dataset(args.dataset)
        args.defenses = ["auto"]
        one = len(data.mean) == 1  # one channel: scalars, as the demo's config gives them
        args.guard_values = {"auto": dict(pixel_mean=data.mean[0] if one else data.mean,
                                          pixel_std=data.std[0] if one else data.std, **guard_settings(args.guard))}
    else:
        args.guard_values = {spec.defense: config.guard_values(spec) for spec in config.defenses
                             if spec.defense in args.defenses}
    missing = sorted(set(args.defenses) - set(args.guard_values))
    if missing:
        raise SystemExit(f"{args.config} has no defense {', '.join(missing)}")
    configs = [GuardConfig(defense=d, **v) for d, v in args.guard_values.items()]
    floors = {round(c.floor, 12) for c in configs}
    if len(floors) != 1:
        raise SystemExit(f"the demo's defenses state different floors {sorted(floors)}")
    args.taus = [configs[0].floor]
    low, high = configs[0].bounds
    if isinstance(low, tuple):
        raise SystemExit("--trained supports one-channel data (MNIST): the box must be a scalar pair")
    args.box = (float(low), float(high))
    args.clip, args.clip_quantile, args.clip_retention = (configs[0].clip_per_sample, configs[0].clip_quantile,
                                                         configs[0].clip_retention)
    args.data_std = float(configs[0].pixel_std)  # one channel: the pixel RMSE is the input RMSE × std


def trained_model_and_batch(args, count: int, offset: int):
    """(model, x, y, data): the demo's warm-started initial model and ``count`` samples outside the
    public split (a seeded permutation of the clients' examples, from ``offset``)."""
    import numpy as np

    from flguard.simulation.task import initial_model, load_dataset, public_indices

    settings = args.settings
    data = load_dataset(settings.dataset)
    public = public_indices(settings.dataset, settings.public_examples, settings.seed)
    private = np.setdiff1d(np.arange(len(data)), public)
    chosen = np.random.default_rng(args.sample_seed).permutation(private)[offset:offset + count]
    assert not set(chosen.tolist()) & set(public.tolist())
    model = initial_model(settings).eval()
    index = torch.as_tensor(chosen)
    x = data.normalize(data.images[index])
    return model.to(args.device), x.to(args.device), data.labels[index].to(args.device), data, chosen


def guard_for(args, defense: str, tau: float, seed: int) -> GuardConfig:
    if args.trained:
        return GuardConfig(defense=defense, seed=seed, **args.guard_values[defense])
    own = dict(subspace_size=args.subspace_size, krylov_steps=args.krylov_steps,
               gaussian_floor=args.gaussian_floor) if defense == "eigen" else {}
    bounds = None if args.no_bounds else tuple(float((v - args.data_mean) / args.data_std) for v in (0.0, 1.0))
    return GuardConfig(defense=defense, min_rmse=tau, seed=seed, eps=args.eps, input_bounds=bounds, **own)


def run(args) -> list[dict]:
    rows = []
    for model_name, init in args.models:
        offset = args.offset
        for batch, uploads in ((1, args.samples_b1), (8, args.batches_b8)):
            if args.trained:
                model, xs, ys, data, indices = trained_model_and_batch(args, batch * uploads, offset)
                offset += batch * uploads  # B = 1 and B = 8 uploads hold different samples
            else:
                model, xs, ys, data = model_and_batch(model_name, args.dataset, batch * uploads, init=init,
                                                      offset=args.offset, device=args.device)
                indices = [None] * (batch * uploads)
            args.data_mean, args.data_std = data.mean[0], data.std[0]
            for u in range(uploads):
                x, y = xs[u * batch:(u + 1) * batch], ys[u * batch:(u + 1) * batch]
                g = batch_gradient(model, x, y)
                control = [("none", args.taus[0] if args.trained else 0.0)]
                if args.trained and batch > 1:
                    control.append(("clip", args.taus[0]))
                cells = control + [(d, t) for d in args.defenses for t in args.taus]
                for defense, tau in cells:
                    start = time.perf_counter()
                    keep = torch.ones(batch, dtype=torch.bool)
                    subspace = args.guard_values["eigen"]["subspace_size"] if args.trained and "eigen" in args.guard_values \
                        else args.subspace_size
                    if defense in ("none", "clip"):  # the controls: every attack on the unguarded (clipped) upload
                        sent = g if defense == "none" else clipped_upload(
                            model, x, y, args.clip, args.clip_quantile, args.clip_retention)
                        result = attacks(model, sent, x, y, data, args, subspace, adaptive=not args.trained)
                        report = None
                    else:
                        guarded = Guard(guard_for(args, defense, tau, 1000 * u + batch)).protect(model, x, y, g)
                        sent, report = guarded.gradient, guarded.report
                        keep = torch.isfinite(report.rmse_after)
                        result = {}
                        if sent is not None:  # the attacker knows how many samples were kept (guard_excluded)
                            part = attacks(model, sent, x[keep], y[keep], data, args, subspace)
                            for k, v in part.items():
                                if k == "_images":
                                    result[k] = v
                                    continue
                                full = torch.full((batch,), float("nan"))
                                full[keep] = v.cpu()
                                result[k] = full
                    for i in range(batch):
                        excluded = sent is not None and not bool(keep[i])
                        row = {"model": model_name, "batch": batch, "upload": u, "sample": i,
                               "index": None if indices[u * batch + i] is None else int(indices[u * batch + i]),
                               "label": int(y[i]), "defense": defense, "tau": tau, "sent": sent is not None,
                               "excluded": excluded,
                               "rel_noise": report.rel_noise if report else 0.0,
                               "predicted": float(report.rmse_after[i]) if report else 0.0}
                        row.update({f"rmse_{k}": float(v[i]) for k, v in result.items() if k != "_images"})
                        standard = [float(result[k][i]) for k in STANDARD if k in result]
                        row["best"] = min(standard) if standard else float("nan")
                        row["adaptive"] = float(result["adaptive"][i]) if "adaptive" in result else float("nan")
                        row["best_all"] = min(row["best"], row["adaptive"]) if "adaptive" in result else row["best"]
                        if excluded:  # sanity check: the nearest of every reconstruction sent back
                            row["nearest_any"] = float((result["_images"] - x[i]).flatten(1).pow(2).mean(1).sqrt().min())
                        rows.append(row)
                    left = int((~keep).sum()) if sent is not None else 0
                    print(f"  {model_name} B={batch} upload {u} {defense:<8} τ={tau:<.3g} "
                          f"{'sent' if sent is not None else 'DROPPED'}{f' ({left} left out)' if left else ''} "
                          f"{time.perf_counter() - start:5.1f}s", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="GPU scale: LeNet too, 3 restarts, longer attacks")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--model", default="cnn2_v1", help="cnn2_v1 (untrained, the issue-7 study) or, with "
                        "--trained, the demo config's model (cnn)")
    parser.add_argument("--trained", action="store_true",
                        help="issue 12: the demo's warm-started model, its guard configs and its τ (from --config)")
    parser.add_argument("--config", default=str(ROOT / "simulations" / "default.toml"),
                        help="with --trained: the compare TOML whose task and defenses are used")
    parser.add_argument("--sample-seed", type=int, default=0, help="with --trained: the clients' samples' permutation")
    parser.add_argument("--taus", type=float, nargs="+", default=[0.1, 0.3, 0.6])
    parser.add_argument("--defenses", nargs="+", default=["gaussian", "eigen"])
    parser.add_argument("--defaults", action="store_true",
                        help="with --trained: one defense, the guard's defaults (auto) given only the normalisation")
    parser.add_argument("--guard", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="with --defaults: GuardConfig fields beyond the normalisation, e.g. "
                             "clip_per_sample=quantile clip_quantile=0.9")
    parser.add_argument("--samples-b1", type=int, default=None, help="B=1 uploads (each guarded per defense and τ; "
                        "default 9, --trained 6)")
    parser.add_argument("--batches-b8", type=int, default=1, help="B=8 uploads (each guarded per defense and τ)")
    parser.add_argument("--offset", type=int, default=300)
    parser.add_argument("--subspace-size", type=int, default=GuardConfig(defense="eigen").subspace_size)
    parser.add_argument("--krylov-steps", type=int, default=GuardConfig(defense="eigen").krylov_steps)
    parser.add_argument("--no-bounds", action="store_true", help="guard without input_bounds")
    parser.add_argument("--gaussian-floor", type=float, default=GuardConfig(defense="eigen").gaussian_floor)
    parser.add_argument("--eps", type=float, default=GuardConfig().eps, help="the guard's ε relative to λmax")
    parser.add_argument("--adaptive-factor", type=int, default=None,
                        help="attacker subspace / defense subspace at B=1 (default 2; 4 with --full)")
    parser.add_argument("--gs-iterations", type=int, default=None,
                        help="GS iterations at B=1 (300; --full 2400; --trained 1000)")
    parser.add_argument("--gs-iterations-batch", type=int, default=None,
                        help="GS iterations at B=8 (as B=1; --trained 300)")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    parser.add_argument("--from-csv", default=None, help="print the tables of a finished run's per-sample CSV "
                        "(same mode flags) instead of running")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.trained:
        trained_setup(args)
        args.models = [(args.model, args.demo.task.init)]
        args.offset = 0
    else:
        if args.model != "cnn2_v1":
            raise SystemExit("--model other than cnn2_v1 needs --trained (the demo's warm-started model)")
        args.models = [("cnn2_v1", "default")] + ([("lenet", "uniform")] if args.full else [])
    args.restarts = 3 if args.full else 1
    args.dlg_steps, gs_iterations, args.hybrid_iterations = (50, 2400, 1000) if args.full else (20, 300, 100)
    if args.trained:  # DLG's L-BFGS is cheap on the CNN; GS needs ~1000 steps to converge on it unguarded
        args.dlg_steps, gs_iterations = 50, (2400 if args.full else 1000)
    args.gs_iterations = args.gs_iterations or gs_iterations
    args.gs_iterations_batch = args.gs_iterations_batch or (300 if args.trained and not args.full else args.gs_iterations)
    if args.samples_b1 is None:
        args.samples_b1 = 6 if args.trained else 9
    if args.adaptive_factor is None:
        args.adaptive_factor = 4 if args.full else 2
    args.tv = 1e-4
    if args.full:
        args.samples_b1, args.batches_b8 = max(args.samples_b1, 20), max(args.batches_b8, 3)
    start = time.perf_counter()
    if args.from_csv:  # the tables again from a finished run's rows (no attack is rerun)
        rows, minutes = read_rows(Path(args.from_csv)), float("nan")
        table = summarise(rows)
        figure(rows, ROOT / "docs" / "figures" / f"{Path(args.from_csv).stem}.png")
        report(args, rows, table, minutes)
        return
    rows = run(args)
    minutes = (time.perf_counter() - start) / 60
    stem = ("promise-trained-" + args.model if args.trained else "promise") + (f"-{args.tag}" if args.tag else "")
    write_csv(ROOT / "benchmarks" / "results" / f"{stem}.csv", rows)
    table = summarise(rows)
    write_csv(ROOT / "benchmarks" / "results" / f"{stem}_summary.csv", table)
    figure(rows, ROOT / "docs" / "figures" / f"{stem}.png")
    report(args, rows, table, minutes)


if __name__ == "__main__":
    main()
