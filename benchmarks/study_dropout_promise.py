"""Promise check with dropout: does the floor hold against an attacker who knows the upload's masks?

The guard certifies a dropout model's update on the map with the masks of the pass that made it held fixed
(``flguard.risk.dropout_draws``). Here a server attacks guarded FedSGD uploads (B = 1) of Chen & Campbell's CNN2 V1
(tanh, default init) with a ``Dropout(p)`` on its convolution's features, on MNIST-5k — the model of study 8, whose
unguarded uploads every attack inverts — with DLG and GS, the true label and every forward pass replaying the upload's
own masks: the strongest attacker, the one I²F describes. Controls: the unguarded upload attacked with the masks
known, and with them unknown (the dropout in eval mode: the attacker's natural guess). Per sample, the best attack's
RMSE (model-input units, reconstructions clipped to the pixel box) against τ; the guard is study 8's (``gaussian``
and ``eigen`` at τ, the pixel box), given the pass's masks.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_dropout_promise.py [--uploads 9] [--p 0.25]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from _common import model_and_batch
from flguard import Guard, GuardConfig
from flguard.attacks import reconstruct
from flguard.guard import DropoutDraws


class WithMasks(nn.Module):
    """``model`` with its dropouts' masks fixed to ``draws`` in every forward pass (the attacker who knows them)."""

    def __init__(self, model: nn.Module, draws: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.model, self.draws = model, draws

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with DropoutDraws(self.draws) as replay:
            out = self.model(x)
        replay.finish()
        return out


def best_rmse(model: nn.Module, gradient: torch.Tensor, x: torch.Tensor, y: torch.Tensor, data, box,
              args) -> float:
    """The lowest RMSE to ``x`` of DLG and GS on ``gradient`` (model-input units, clipped to the pixel box)."""
    common = dict(labels=y, batch_size=1, restarts=1, seed=0)
    runs = (("dlg", dict(iterations=args.dlg_steps)),
            ("gs", dict(iterations=args.gs_iterations, tv=1e-4, mean=data.mean, std=data.std)))
    errors = []
    for method, hp in runs:
        images = reconstruct(model, gradient, x.shape[1:], method=method, **common, **hp).images.detach()
        errors.append(float((images.clamp(*box) - x).pow(2).mean().sqrt()))
    return min(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploads", type=int, default=9)
    parser.add_argument("--p", type=float, default=0.25, help="the dropout's probability")
    parser.add_argument("--taus", type=float, nargs="+", default=[0.1, 0.3, 0.6])
    parser.add_argument("--defenses", nargs="+", default=["gaussian", "eigen"])
    parser.add_argument("--dlg-steps", type=int, default=20)
    parser.add_argument("--gs-iterations", type=int, default=300)
    parser.add_argument("--offset", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base, xs, ys, data = model_and_batch("cnn2_v1", "mnist5k", args.uploads, init="default", offset=args.offset)
    torch.manual_seed(0)
    model = nn.Sequential(base[0], base[1], nn.Dropout(args.p), *base[2:]).train()
    box = tuple(float((v - data.mean[0]) / data.std[0]) for v in (0.0, 1.0))
    blind = copy.deepcopy(model).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    rows: dict[str, list[float]] = {}
    start = time.perf_counter()
    for u in range(args.uploads):
        x, y = xs[u:u + 1], ys[u:u + 1]
        with DropoutDraws() as drawing:
            loss = nn.functional.cross_entropy(model(x), y)
        gradient = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
        draws = drawing.finish()
        knows = WithMasks(model, draws)
        rows.setdefault("none, masks known", []).append(best_rmse(knows, gradient, x, y, data, box, args))
        rows.setdefault("none, masks unknown", []).append(best_rmse(blind, gradient, x, y, data, box, args))
        for defense in args.defenses:
            for tau in args.taus:
                config = GuardConfig(defense=defense, min_rmse=tau, seed=1000 * u, input_bounds=box)
                out = Guard(config).protect(model, x, y, gradient, draws=draws)
                key = f"{defense} τ={tau:g}"
                rows.setdefault(key, [])
                rows.setdefault(key + " sent", []).append(float(out.gradient is not None))
                if out.gradient is not None:
                    rows[key].append(best_rmse(knows, out.gradient, x, y, data, box, args) / tau)
        print(f"  upload {u} done, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\nCNN2 V1 + Dropout({args.p:g}), B = 1, {args.uploads} uploads; DLG {args.dlg_steps}×20, "
          f"GS {args.gs_iterations}; attacker knows the masks unless said\n")
    print("| upload guarded with | sent | best RMSE (controls) or best RMSE / τ: median | min | kept (≥ τ) |")
    print("| --- | --- | --- | --- | --- |")
    for key, values in rows.items():
        if key.endswith(" sent"):
            continue
        sent = rows.get(key + " sent")
        share = f"{int(sum(sent))} / {len(sent)}" if sent else "—"
        kept = f"{sum(v >= 1.0 for v in values)} / {len(values)}" if sent and values else "—"
        body = (f"{statistics.median(values):.3g} | {min(values):.3g}" if values else "— | —")
        print(f"| {key} | {share} | {body} | {kept} |")


if __name__ == "__main__":
    main()
