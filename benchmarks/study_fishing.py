"""Fishing (issue 23): the malicious server fishes one class out of a one-step batch gradient; does the
guard's floor hold on what it then sends?

The demo's task (``--config``, ``simulations/default.toml``): Flower's quickstart CNN warm-started on
the server's 1,000 public MNIST-5k examples (≈ 91%), batches of the clients' samples (never public
ones). Per batch size B and upload: B private samples, the target class t = the class of one sample
that is alone in its class in the batch (the server rotates classes over rounds; a batch with one
target is the case fishing is built for), the server's fished model ``fish_class(model, t)`` and
the one-step batch gradient on it. Then, per defense, the server's ``attack_fished`` (strongest
mode: GS over its TV sweep and DLG, best by matching loss; the pixel box) inverts the target sample:

- ``none``: the fished gradient as it is (the attack's own count of targets, ``count_targets``);
- ``guard``: ``Guard(GuardConfig(pixel_mean, pixel_std))`` — the defaults (``auto``, 15 dB floor,
  median per-sample clipping) on the fished model the client received; the attacker is *given* the
  true number of targets (the noise may blur the bias gradient it would read it from);
- ``localdp``: Flower's LocalDpMod on the one-step update at the demo's settings (clip 5, ε 700,
  δ 1e-5, lr 0.02): clipped −lr·g plus N(0, std²) per weight, decoded back to a gradient.

A target sample is *kept* when its reconstruction's pixel PSNR ≤ the floor (15 dB), or when the guard
left it out of the upload. Printed: per B and defense, the PSNR of each target, the kept share, the
worst margin (floor − PSNR), the guard's sent share, noise in units of C and seconds.

    python benchmarks/study_fishing.py --batches 8 16 32 --uploads 6       # CPU, one thread, ~40 min
    python benchmarks/study_fishing.py --batches 8 16 32 --uploads 6 --defended-restarts 4 --device cuda
    python benchmarks/study_fishing.py --batches 8 16 32 --uploads 4 --defended-restarts 4 --adaptive   # the issue's budget
    python benchmarks/study_fishing.py --batches 16 --uploads 3 --targets 3   # three samples of the fished class per batch

``--adaptive`` also runs the adaptive attacker (``flguard.attacks.adaptive``: it knows the eigen
defense, estimates each target's weak subspace at its first reconstruction and attacks again blind
to it) on every guarded upload, warm-started from the strongest attack's reconstruction; a target
is then kept only when both stay under the floor. ``--guard-defense eigen`` forces the aimed noise
(the one the adaptive attacker is built against) instead of the default ``auto``; ``--guard
gaussian_floor=0.5`` adds eigen's isotropic part (any GuardConfig field as FIELD=VALUE).

The undefended uploads are attacked with ``--iterations`` × ``--restarts`` (1,000 × 2), the defended
ones with the stronger ``--defended-iterations`` × ``--defended-restarts`` (3,000 × 2).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from _common import ROOT, flat_gradient, guard_settings, study_argparser, study_paths, write_table
from flguard import Guard, GuardConfig
from flguard.attacks import metrics
from flguard.server.fishing import attack_fished, count_targets, fish_class


def private_batch(settings, data, public, batch: int, rng: np.random.Generator, targets: int = 1):
    """B private samples whose labels include a class with exactly ``targets`` samples; (index, that class)."""
    private = np.setdiff1d(np.arange(len(data)), public)
    while True:
        index = rng.choice(private, size=batch, replace=False)
        labels = data.labels[torch.as_tensor(index)]
        counts = torch.bincount(labels, minlength=data.num_classes)
        single = (counts == targets).nonzero()[:, 0]
        if len(single):
            return torch.as_tensor(index), int(single[int(rng.integers(len(single)))])


def target_psnrs(data, images: torch.Tensor, truth: torch.Tensor) -> list[float]:
    """Pixel PSNR of each target's reconstruction (box-clamped, as the server scores; several targets
    Hungarian-matched to the reconstructions)."""
    rec = data.denormalize(images.detach().cpu()).clamp(0, 1)
    originals = data.denormalize(truth.cpu()).clamp(0, 1)
    return [float(v) for v in metrics.score(rec[:len(originals)], originals, with_lpips=False)["psnr"]]


def scored(row: dict, psnrs: list[float]) -> dict:
    """The row with the best-reconstructed target's PSNR (``psnr``) and every target's (``psnr_targets``)."""
    return {**row, "psnr": max(psnrs), "psnr_targets": " ".join(f"{v:.2f}" for v in psnrs), "_psnrs": psnrs}


def targets_kept(row: dict, floor_psnr: float) -> int:
    """How many of the row's targets are kept: left out of the upload by the guard, or reconstructed at a pixel
    PSNR ≤ the floor (each target Hungarian-matched); none where the upload was withheld (nothing was sent)."""
    if not row["sent"]:
        return 0
    left = row.get("_left") or [False] * row["targets"]
    psnrs = row.get("_psnrs") or [float("inf")] * row["targets"]
    return sum(out or value <= floor_psnr for out, value in zip(left, psnrs))


def localdp_gradient(gradient: torch.Tensor, lr: float, dp, generator: torch.Generator) -> torch.Tensor:
    """LocalDpMod on the one-step update u = −lr·g (clip to ``clipping_norm``, add N(0, std²) per
    weight), as the gradient (θ0 − θ1)/lr the server decodes."""
    update = -lr * gradient
    update = update * min(1.0, dp.clipping_norm / float(update.norm()))
    noisy = update + dp.std * torch.randn(update.shape, generator=generator, dtype=update.dtype)
    return -noisy / lr


def demo_task(config_path: str, device: str):
    """The demo's task as its server builds it: (compare config, TaskSettings, dataset, the public
    indices, the warm-started model in eval mode on ``device``)."""
    from flguard.compare.config import load_config
    from flguard.simulation.task import TaskSettings, initial_model, load_dataset, public_indices

    config = load_config(config_path)
    settings = TaskSettings.from_config(config.run_config(config.defense("none")))
    data = load_dataset(settings.dataset)
    public = public_indices(settings.dataset, settings.public_examples, settings.seed)
    return config, settings, data, public, initial_model(settings).eval().to(device)


def run(args) -> list[dict]:
    from flguard.guard.config import LocalDpConfig

    config, settings, data, public, model = demo_task(args.config, args.device)
    dp_spec = config.defense("localdp")
    dp = LocalDpConfig(clipping_norm=dp_spec.clipping_norm, sensitivity=dp_spec.sensitivity,
                       epsilon=dp_spec.epsilon, delta=dp_spec.delta)
    floor_psnr = 15.0
    attack = dict(method="strongest", iterations=args.iterations, restarts=args.restarts, device=args.device,
                  mean=tuple(data.mean), std=tuple(data.std))
    strongest = {**attack, "iterations": args.defended_iterations, "restarts": args.defended_restarts}
    rng = np.random.default_rng(args.seed)
    rows = []
    for batch in args.batches:
        for upload in range(args.uploads):
            index, target = private_batch(settings, data, public, batch, rng, args.targets)
            x, y = data.normalize(data.images[index]).to(args.device), data.labels[index].to(args.device)
            truth = x[y == target]
            fished = fish_class(model, target)
            gradient = flat_gradient(fished, x, y)
            base = dict(B=batch, upload=upload, target_class=target, targets=args.targets, counted=count_targets(gradient, fished, target,
                                                                                           batch_size=batch))
            seed = args.seed * 1000 + batch * 10 + upload
            started = time.perf_counter()
            rec = attack_fished(fished, gradient, target, data.shape, batch_size=batch, seed=seed, **attack)
            rows.append(scored({**base, "defense": "none", "sent": True, "left_out": False, "noise_c": 0.0,
                                "guard_s": 0.0, "attack_s": time.perf_counter() - started},
                               target_psnrs(data, rec.images, truth)))
            print(rows[-1], flush=True)

            guard = Guard(GuardConfig(pixel_mean=data.mean, pixel_std=data.std, seed=seed,
                                      **({"defense": args.guard_defense} if args.guard_defense != "auto" else {}),
                                      **guard_settings(args.guard)))
            started = time.perf_counter()
            out = guard.protect(fished, x, y, gradient)
            report = out.report
            guard_s = time.perf_counter() - started
            row = {**base, "defense": "guard", "sent": out.gradient is not None, "guard_s": guard_s,
                   "used": report.details.get("defense_used", report.defense),
                   "noise_c": report.noise_norm / report.details["clip"] if report.details.get("clip") else None}
            positions = (y == target).nonzero()[:, 0]
            row["_left"] = ([not bool(v) for v in torch.isfinite(report.rmse_after[positions])]
                            if out.gradient is not None else [False] * len(positions))
            row["left_out"], row["left_out_targets"] = all(row["_left"]), sum(row["_left"])
            if out.gradient is not None and not row["left_out"]:
                started = time.perf_counter()
                rec = attack_fished(fished, out.gradient, target, data.shape, batch_size=batch, count=len(truth),
                                    seed=seed, **strongest)
                row = scored({**row, "attack_s": time.perf_counter() - started}, target_psnrs(data, rec.images, truth))
                if args.adaptive:  # the eigen-aware attacker, from the strongest attack's reconstruction
                    size = 2 * guard.config.subspace_size if hasattr(guard.config, "subspace_size") else 64
                    started = time.perf_counter()
                    rec = attack_fished(fished, out.gradient, target, data.shape, batch_size=batch, count=len(truth),
                                        seed=seed, method="adaptive", base="gs", subspace=size, krylov_steps=2 * size,
                                        base_hyperparameters={"strongest": True}, first_images=rec.images,
                                        iterations=args.defended_iterations, restarts=args.defended_restarts,
                                        device=args.device, mean=tuple(data.mean), std=tuple(data.std))
                    adaptive = target_psnrs(data, rec.images, truth)
                    row.update(psnr_strongest=row["psnr"], psnr_adaptive=max(adaptive),
                               adaptive_s=time.perf_counter() - started,
                               _psnrs=[max(a, b) for a, b in zip(row["_psnrs"], adaptive)])  # kept: both attacks
                    row["psnr"] = max(row["psnr_strongest"], row["psnr_adaptive"])
            else:
                row.update(psnr=None, reason=report.reason[:100])
            rows.append(row)
            print(rows[-1], flush=True)

            generator = torch.Generator().manual_seed(seed)
            noisy = localdp_gradient(gradient.cpu().double(), settings.lr, dp, generator).float().to(args.device)
            started = time.perf_counter()
            rec = attack_fished(fished, noisy, target, data.shape, batch_size=batch, count=len(truth), seed=seed,
                                **strongest)
            rows.append(scored({**base, "defense": "localdp", "sent": True, "left_out": False, "guard_s": 0.0,
                                "noise_c": None, "attack_s": time.perf_counter() - started},
                               target_psnrs(data, rec.images, truth)))
            print(rows[-1], flush=True)
    columns = ("B", "upload", "target_class", "targets", "counted", "defense", "used", "sent", "left_out",
               "left_out_targets", "noise_c", "guard_s", "psnr", "psnr_targets", "psnr_strongest", "psnr_adaptive",
               "attack_s", "adaptive_s", "reason")
    counts = [targets_kept(row, floor_psnr) for row in rows]
    rows = [{key: row.get(key) for key in columns} for row in rows]
    for row, kept in zip(rows, counts):
        row["kept"] = bool(row["left_out"] or (row["sent"] and row["psnr"] is not None and row["psnr"] <= floor_psnr))
        row["targets_kept"] = kept
    return rows


def summarise(rows: list[dict], floor_psnr: float = 15.0) -> list[dict]:
    table = []
    for batch in sorted({r["B"] for r in rows}):
        for defense in ("none", "guard", "localdp"):
            group = [r for r in rows if r["B"] == batch and r["defense"] == defense]
            if not group:
                continue
            sent = [r for r in group if r["sent"]]
            scored = [r["psnr"] for r in sent if r["psnr"] is not None]
            table.append({
                "B": batch, "defense": defense, "uploads": len(group), "sent": len(sent),
                "targets_counted_right": sum(r["counted"] == r.get("targets", 1) for r in group),
                "psnr_median": statistics.median(scored) if scored else None,
                "psnr_max": max(scored) if scored else None,
                "kept_share": sum(r["kept"] for r in sent) / len(sent) if sent else None,
                "targets_kept_share": (sum(r.get("targets_kept", r["kept"]) for r in sent)
                                       / sum(r.get("targets", 1) for r in sent)) if sent else None,
                "worst_margin_db": floor_psnr - max(scored) if scored else None,
                "psnr_adaptive_max": max((r["psnr_adaptive"] for r in sent if r.get("psnr_adaptive") is not None),
                                         default=None),
                "noise_c_median": statistics.median([r["noise_c"] for r in sent if r.get("noise_c") is not None])
                if defense == "guard" and sent else None,
                "guard_s_median": statistics.median([r["guard_s"] for r in group]) if defense == "guard" else None,
            })
    return table


def main() -> None:
    parser = study_argparser(__doc__)
    parser.add_argument("--config", default=str(ROOT / "simulations" / "default.toml"))
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--uploads", type=int, default=3, help="fished uploads per batch size")
    parser.add_argument("--targets", type=int, default=1, help="samples of the fished class in each batch (the "
                        "attack reconstructs them all; each is scored against its Hungarian-matched reconstruction)")
    parser.add_argument("--iterations", type=int, default=1000, help="the strongest attack's GS iterations")
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--defended-iterations", type=int, default=3000,
                        help="the attack's GS iterations on the defended (guard, localdp) uploads")
    parser.add_argument("--defended-restarts", type=int, default=2)
    parser.add_argument("--tag", default="", help="suffix of the output files")
    parser.add_argument("--adaptive", action="store_true", help="also run the adaptive attacker on guarded uploads")
    parser.add_argument("--guard-defense", default="auto", choices=["auto", "gaussian", "rowspace", "eigen"])
    parser.add_argument("--guard", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="other GuardConfig fields, e.g. gaussian_floor=0.5")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = run(args)
    write_study(f"study_fishing{args.tag}", rows, summarise(rows), started)


def write_study(study: str, rows: list[dict], summary: list[dict], started: float) -> None:
    """Per-sample rows to results/<study>_samples.csv, the summary to results/<study>.csv and printed."""
    _, table_path = study_paths(study)
    write_table(rows, table_path.with_name(f"{study}_samples.csv"))
    print(write_table(summary, table_path))
    print(f"{(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
