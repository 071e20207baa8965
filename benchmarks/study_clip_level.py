"""How much of the batch gradient each clip level keeps, on the trained models of ``bench_guard_models.py``.

For the first ``--batches`` batches of the round that ``bench_guard_models.py`` runs (the same trained model,
seed and batch order), at C = the batch's median, 75th and 90th percentile of per-sample gradient norms, and at the
``"retention"`` rule's C for each ``--retention``: the clipped sum s = Σ_i min(1, C/‖g_i‖)·g_i against the batch
gradient g = Σ_i g_i — its length ‖s‖/‖g‖, its cosine with g, and ⟨s, g⟩/‖g‖² (what ``"retention"`` bounds from
below) — the share of the batch at or below C (the quantile picked) and C over the batch's median norm. Medians over
the batches. Why: the median clip level stalled the trained CNN's guarded rounds even without noise
(docs/results.md, "A clip level that keeps the step").

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_clip_level.py --model cnn --seed 2
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_clip_level.py --model resnet20_gn
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _common import study_paths, write_table
from bench_guard_models import _task


def clipped_sum_shares(op, clip: float) -> dict:
    """‖s‖/‖g‖, cos(s, g) and ⟨s, g⟩/‖g‖² for s the batch's clipped sum at ``clip`` (``ClippedJacobian``'s upload)."""
    from flguard.risk.clipped import ClippedJacobian

    clipped = ClippedJacobian(op, clip)
    s, g = clipped.gradient.double(), clipped.unclipped_gradient.double()
    return {"length": float(s.norm() / g.norm()), "cosine": float(s @ g / (s.norm() * g.norm())),
            "along": float(s @ g / (g @ g))}


def main() -> None:
    from flguard.guard.clipping import clip_level
    from flguard.risk.operator import JacobianOperator

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--retention", default="0.25,0.5", help="the rule's clip_retention values, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x, y), _, _ = _task(args.model, args.train_steps, "cpu", args.seed)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed + 1))[:args.batches * args.batch]
    levels = [("median", "median", 0.5, None), ("q75", "quantile", 0.75, None), ("q90", "quantile", 0.9, None)]
    levels += [(f"retention {r}", "retention", 0.5, float(r)) for r in args.retention.split(",")]
    cells: dict[str, list[dict]] = {name: [] for name, *_ in levels}
    for idx in order.split(args.batch):
        op = JacobianOperator(model, x[idx], y[idx])
        norms = op.per_sample_gradients().norm(dim=1)
        median = clip_level("median", op)
        for name, setting, quantile, retention in levels:
            clip = clip_level(setting, op, quantile, retention if retention is not None else 0.5)
            cells[name].append({**clipped_sum_shares(op, clip), "picked": float((norms <= clip).float().mean()),
                                "over_median": clip / median})
    rows = [{"model": args.model, "seed": args.seed, "B": args.batch, "clip level": name,
             **{key: statistics.median(c[key] for c in found) for key in ("length", "cosine", "along", "picked",
                                                                            "over_median")},
             "C / median, range": f"{min(c['over_median'] for c in found):.3g}–{max(c['over_median'] for c in found):.3g}",
             "along, range": f"{min(c['along'] for c in found):.3g}–{max(c['along'] for c in found):.3g}"}
            for name, found in cells.items()]
    _, table = study_paths(f"study_clip_level_{args.model}_s{args.seed}")
    print(write_table(rows, table, digits=3))


if __name__ == "__main__":
    main()
