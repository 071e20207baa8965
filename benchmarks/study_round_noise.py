"""What one noise per upload would buy: FedAvg from scratch with the guard's Gaussian once per round.

The guard perturbs every local step: a 24-step FedAvg upload carries 24 independent noises, each certified
for its own step's samples as if the server saw that step's gradient alone. The server sees only the upload
θ_K − θ_0 (DESIGN.md §2), and to first order (the I²F's model: later steps' Hessians dropped) sample i of step t
moves it through its own block J_i(θ_t) only. So one noise n = −lr·c·z added to the upload, with c the least
scale at which *every* kept sample of *every* step certifies (each against its own step's operator, the pixel
box and its solver error, exactly the guard's certificate) protects the round to the same first-order floor
with one noise instead of K: √K less in norm where the steps need similar scales. This study measures what
that buys in accuracy, on the frontier's task (``simulations/frontier.toml``: the quickstart CNN from its
initialisation, MNIST-5k, 4 Dirichlet-0.5 clients, 5 rounds of 24 SGD steps at B = 16, lr 0.1), in a plain
FedAvg loop (every client aggregated, weighted by its examples; no probes, fishing or attacks — the server's
one-step requests are guarded per step either way, so they would not change):

- ``none``, ``clip-only`` (the median per-sample clipping, no noise), ``localdp-e…`` (Flower's LocalDpMod
  rule: the update clipped to norm 5, then N(0, σ²) per weight);
- ``step-<row>``: the guard per step, the frontier row's GuardConfig (``auto-15dB``: the defaults);
- ``round-<row>``: the same GuardConfig (a ``gaussian`` row), its noise once per upload. Per step the guard runs
  unchanged on the round's one direction z (drawn once per client round from OS entropy), solving every sample
  to rtol (no early stop: its certificate must hold at the round's scale, not only at the step's), and the step
  applies the clipped, kept gradient without noise; at the round's end c = the largest step scale, every kept
  sample of every step is re-verified at c (``flguard.guard.box_bound.certifies``: clipped error, radius c·η_i,
  τ(1 + rtol)) and the upload gets −lr·c·z — or, if any sample fails there, the round is withheld (fail
  closed; counted). A withheld step withholds its client's round in both modes, as in the guard's mod.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_round_noise.py --seed 1 \\
        --rows none clip-only localdp-e2100 step-gaussian-15dB-median round-gaussian-15dB-median step-auto-15dB

Prints per row the accuracy after each round, the mean noise norm per upload in parameter units, withheld
client rounds and re-verification failures; writes ``results/study_round_noise_s<seed><tag>.csv``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import time
from pathlib import Path

import torch

from flguard import Guard, GuardConfig
from flguard.compare.config import load_config
from flguard.flower.guard_mod import GuardDropped
from flguard.guard import floor, perturb
from flguard.guard.box_bound import certifies
from flguard.guard.config import LocalDpConfig
from flguard.guard.session import open_session
from flguard.risk.closed_forms import to_rmse
from flguard.defenses.base import Direction
from flguard.simulation import task
from flguard.simulation.task import TaskSettings

ROOT = Path(__file__).resolve().parents[1]
#: Extra rows beside the frontier's: its gaussian row with the median clip level (the per-step kind the
#: round mode runs; ``auto``'s adaptive clip level judges each step's own noise, which round mode does not send).
EXTRA = {"gaussian-15dB-median": dict(defense="gaussian", max_psnr=15.0, clip_per_sample="median"),
         "gaussian-20dB-median": dict(defense="gaussian", max_psnr=20.0, clip_per_sample="median"),
         # a quarter and a tenth of the default budget (40 C): a step leaves out the samples that would need more,
         # which caps the round's scale (its largest step scale) at the price of more left-out samples
         "gaussian-15dB-median-10C": dict(defense="gaussian", max_psnr=15.0, clip_per_sample="median",
                                          max_rel_noise=10.0),
         "gaussian-15dB-median-4C": dict(defense="gaussian", max_psnr=15.0, clip_per_sample="median",
                                         max_rel_noise=4.0)}


def settings_for(seed: int, frontier: Path) -> tuple[TaskSettings, object]:
    config = load_config(frontier)
    t = config.task
    settings = TaskSettings(model=t.model, dataset=t.dataset, init=t.init, seed=seed, num_partitions=t.clients,
                            partitioning=t.partitioning, alpha=t.alpha, lr=t.lr, local_steps=t.local_steps,
                            batch_size=t.batch_size, public_examples=t.public_examples,
                            pretrain_epochs=t.pretrain_epochs)
    return settings, config


def guard_config(config, name: str) -> GuardConfig:
    if name in EXTRA:
        spec = dict(EXTRA[name])
        data = task.load_dataset(config.task.dataset)
        return GuardConfig(**spec, pixel_mean=float(data.mean[0]), pixel_std=float(data.std[0]))
    spec = next(s for s in config.defenses if s.name == name)
    return config.guard_config(spec)


class RoundCertificate:
    """One client round in round mode: the fixed direction, and every guarded step's per-sample data."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.z: torch.Tensor | None = None
        self.steps: list[dict] = []
        self._pending: dict = {}

    def direction(self, size: int, like: torch.Tensor) -> Direction:
        if self.z is None:  # one draw per client round, from OS entropy
            self.z = torch.randn(size, generator=torch.Generator().manual_seed(int.from_bytes(
                os.urandom(8), "little") & (2**63 - 1)), dtype=like.dtype)
        return Direction(self.z.to(like), {"kind": "isotropic"})

    def capture(self, ctx, solved, outcome) -> None:
        shift, _, usable, slack = solved[1]
        self._pending = dict(x=ctx.op.x.detach(), shift=shift.detach(), slack=slack.detach(),
                             kept=torch.isfinite(outcome.rmse_after) & usable, noise=outcome.noise.detach())

    @property
    def pending(self) -> bool:
        """Whether this step's one-run Gaussian was captured (round mode needs it on every step)."""
        return bool(self._pending)

    def step_done(self) -> torch.Tensor:
        """Files the step's data; returns the step's noise (to be taken back off the sent gradient)."""
        step, self._pending = self._pending, {}
        self.steps.append(step)
        return step["noise"]

    def scale(self) -> float:
        norm = float(self.z.norm())
        return max(float(s["noise"].norm()) / norm for s in self.steps)

    def failures(self, c: float) -> int:
        """Kept samples of the round that do not certify at scale c."""
        cfg, bad = self.cfg, 0
        target = cfg.floor * (1 + cfg.rtol)
        for s in self.steps:
            keep = s["kept"]
            if not bool(keep.any()):
                continue
            x, shift, slack = s["x"][keep], s["shift"][keep], s["slack"][keep]
            if cfg.bounds is None:
                ok = to_rmse(c * (shift.norm(dim=1) - slack), shift.shape[1]) >= target
            else:
                low, high = floor.input_bounds(cfg.bounds, x)
                ok = certifies(x, shift, low, high, c, slack, target)
            bad += int((~ok).sum())
        return bad


def local_round(model, data, settings, generator, mode: str, cfg: GuardConfig | None, dp: LocalDpConfig | None,
                stats: dict) -> bool:
    """One client's local training in place; False when its round is withheld."""
    if mode == "none":
        before = [p.detach().clone() for p in model.parameters()]
        task.local_sgd(model, data, lr=settings.lr, steps=settings.local_steps, batch_size=settings.batch_size,
                       generator=generator)
        if dp is not None:
            with torch.no_grad():
                update = [p - b for p, b in zip(model.parameters(), before)]
                norm = float(torch.sqrt(sum(u.pow(2).sum() for u in update)))
                scale = min(1.0, dp.clipping_norm / norm) if norm > 0 else 1.0
                noise_sq = 0.0
                for p, b, u in zip(model.parameters(), before, update):
                    noise = torch.randn_like(p) * dp.std
                    p.copy_(b + scale * u + noise)
                    noise_sq += float(noise.pow(2).sum())
                stats["noise"].append(math.sqrt(noise_sq))
        return True
    guard = Guard(cfg)
    certificate = RoundCertificate(cfg) if mode == "round" else None
    original_step, original_isotropic, original_meet = task.guard_step, perturb.isotropic, floor.FloorCalibrator.meet

    def meet(self, ctx, solved=None, kind="gaussian"):
        outcome = original_meet(self, ctx, solved, kind)
        if certificate is not None and solved is not None:
            certificate.capture(ctx, solved, outcome)
        return outcome

    def step(model_, x, y, grads, loss_fn=None, step_size=None):
        out = original_step(model_, x, y, grads, loss_fn=loss_fn, step_size=step_size)
        if certificate is None:
            return out
        if not certificate.pending:
            raise RuntimeError("round mode needs the one-run Gaussian on every step (a gaussian row)")
        noise = certificate.step_done()
        flat = torch.cat([g.reshape(-1) for g in out]) - noise  # the step's clipped, kept gradient, no noise
        return [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in out]), out)]

    task.guard_step = step
    floor.FloorCalibrator.meet = meet
    stop = floor.STOP_WHEN_SUFFICIENT
    if certificate is not None:
        perturb.isotropic = lambda size, generator_, like: certificate.direction(size, like)
        floor.STOP_WHEN_SUFFICIENT = False
    try:
        with open_session(guard) as session:
            task.local_sgd(model, data, lr=settings.lr, steps=settings.local_steps, batch_size=settings.batch_size,
                           generator=generator)
        noises = [r.noise_norm for r in session.reports]
    except GuardDropped:
        stats["withheld"] += 1
        return False
    finally:
        task.guard_step, perturb.isotropic, floor.FloorCalibrator.meet = original_step, original_isotropic, original_meet
        floor.STOP_WHEN_SUFFICIENT = stop
    stats["left_out"] += sum(int(r.details.get("excluded", 0)) for r in session.reports)
    if certificate is None:
        stats["noise"].append(settings.lr * math.sqrt(sum(n * n for n in noises)))
        return True
    c = certificate.scale()
    failures = certificate.failures(c)
    stats["failures"] += failures
    if failures:
        stats["withheld"] += 1
        return False
    with torch.no_grad():
        z = certificate.z
        offset = 0
        for p in model.parameters():
            p.sub_(settings.lr * c * z[offset:offset + p.numel()].view_as(p).to(p))
            offset += p.numel()
    stats["noise"].append(settings.lr * c * float(z.norm()))
    stats["scale_ratio"].append(c / max(min(float(s["noise"].norm()) for s in certificate.steps) / float(z.norm()),
                                        1e-30))
    return True


def run(settings: TaskSettings, config, row: str, rounds: int) -> dict:
    mode, cfg, dp = "none", None, None
    if row.startswith("localdp"):
        spec = next(s for s in config.defenses if s.name == row)
        dp = LocalDpConfig(**spec.values())
    elif row.startswith(("step-", "round-")):
        mode, name = row.split("-", 1)
        cfg = guard_config(config, name)
    elif row == "clip-only":
        mode, cfg = "step", guard_config(config, "clip-only")
    elif row != "none":
        raise SystemExit(f"unknown row {row!r}")
    global_model = task.initial_model(settings)
    tests = [task.load_partition(settings, pid)[1] for pid in range(settings.num_partitions)]
    stats = {"withheld": 0, "failures": 0, "left_out": 0, "noise": [], "scale_ratio": []}
    accuracies, start = [], time.perf_counter()
    for server_round in range(1, rounds + 1):
        states, weights = [], []
        for pid in range(settings.num_partitions):
            train, _ = task.load_partition(settings, pid)
            model = copy.deepcopy(global_model)
            if local_round(model, train, settings, task.batch_generator(settings, server_round, pid), mode, cfg, dp,
                           stats):
                states.append([p.detach() for p in model.parameters()])
                weights.append(len(train))
        if states:
            total = sum(weights)
            with torch.no_grad():
                for i, p in enumerate(global_model.parameters()):
                    p.copy_(sum(w * s[i] for w, s in zip(weights, states)) / total)
        correct = sum(task.evaluate_model(global_model, t)[1] * len(t) for t in tests)
        accuracies.append(correct / sum(len(t) for t in tests))
        print(f"  {row} round {server_round}: {accuracies[-1]:.1%}", flush=True)
    noise = stats["noise"]
    return {"row": row, **{f"round_{i + 1}": f"{a:.4f}" for i, a in enumerate(accuracies)},
            "final_accuracy": f"{accuracies[-1]:.4f}", "withheld": stats["withheld"],
            "reverify_failures": stats["failures"], "left_out": stats["left_out"],
            "noise_per_upload": f"{sum(noise) / len(noise):.4g}" if noise else "",
            "noise_per_upload_max": f"{max(noise):.4g}" if noise else "",
            "round_scale_over_least_step": (f"{sum(stats['scale_ratio']) / len(stats['scale_ratio']):.3g}"
                                            if stats["scale_ratio"] else ""),
            "seconds": f"{time.perf_counter() - start:.0f}"}


ROUNDS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rows", nargs="+", required=True)
    parser.add_argument("--config", default=str(ROOT / "simulations" / "frontier.toml"))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings, config = settings_for(args.seed, Path(args.config))
    out = ROOT / "benchmarks" / "results" / f"study_round_noise_s{args.seed}{args.tag}.csv"
    rows = []
    for row in args.rows:
        rows.append(run(settings, config, row, args.rounds))
        print(rows[-1], flush=True)
        with out.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
