"""Fishing on multi-step uploads (issue 23 §1): does the fished model still single out its target when
the client takes K local SGD steps before uploading θ_K − θ_0?

Class fishing isolates the target class in one step's gradient; the zeroed classifier rows then get
gradients (p_j − [y = j])·h and train back, so from the second step on every sample's gradient flows.
The server's answer is ``attack_fished``'s unrolled path: simulate the client's K steps from the
fished θ_0 over all K·b candidates and match the whole update (Geiping et al. 2020 §5).

The demo's task (``--config``): its warm-started quickstart CNN, the clients' private MNIST-5k
samples, its local learning rate. Per K and upload: K·b private samples in which one class occurs
exactly once (the target, put in the first step's batch, where the fishing isolates it), then two
uploads of the same K steps — from the fished θ_0 (``fish_class``) and from the honest θ_0 — each
attacked by the same unrolled strongest attack (GS over its TV sweep and DLG, the pixel box; the
labels are given to the attacker, the strongest assumption), and the target's pixel PSNR. K = 1 is
the one-step case for reference: ``attack_fished`` on the isolated target against the passive
attack on all b samples. Undefended uploads only: what fishing buys the server, not the guard.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_fishing_multistep.py --steps 1 2 4 --uploads 3
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from _common import ROOT, study_argparser
from flguard.attacks import reconstruct
from flguard.attacks.base import split_gradient
from flguard.attacks.unroll import simulate_update
from flguard.server.fishing import attack_fished, fish_class
from flguard.server.uploads import ClientUpdate
from study_fishing import demo_task, private_batch, target_psnr, write_study


def upload_of(model, x, y, steps: int, lr: float) -> ClientUpdate:
    """The client's K-step upload on (x, y) in consecutive batches of K·b / K, decoded as the server does."""
    flat = simulate_update(model, x, y, local_steps=steps, local_lr=lr, local_batch_size=len(y) // steps)
    update = split_gradient(model, flat)
    return ClientUpdate([u / (-lr * steps) for u in update], update, len(y), steps, lr)


def attack(model, upload: ClientUpdate, y: torch.Tensor, target: int, fished: bool, data, kwargs: dict):
    """The server's reconstruction of the target: ``attack_fished`` on a fished upload (one step: the
    isolated target alone; K steps: unrolled over all samples), the same unrolled attack on an honest one."""
    if fished or upload.local_steps > 1:
        rec = attack_fished(model, upload, target, data.shape, labels=y.tolist() if upload.local_steps > 1 else None,
                            count=1, **kwargs)
    else:  # the passive one-step attack on all b samples
        rec = reconstruct(model, upload.gradient, data.shape, labels=y, batch_size=len(y), **kwargs)
    return rec.images[rec.labels.cpu() == target] if len(rec.images) > 1 else rec.images


def run(args) -> list[dict]:
    _, settings, data, public, model = demo_task(args.config, args.device)
    kwargs = dict(method="strongest", iterations=args.iterations, restarts=args.restarts, device=args.device,
                  mean=tuple(data.mean), std=tuple(data.std))
    rng = np.random.default_rng(args.seed)
    rows = []
    for steps in args.steps:
        for number in range(args.uploads):
            index, target = private_batch(settings, data, public, steps * args.batch, rng)
            labels = data.labels[index]
            index = torch.cat([index[labels == target], index[labels != target]])  # the target in step 1's batch
            x, y = data.normalize(data.images[index]).to(args.device), data.labels[index].to(args.device)
            for fished in (True, False):
                sent = fish_class(model, target) if fished else model
                upload = upload_of(sent, x, y, steps, settings.lr)
                started = time.perf_counter()
                images = attack(sent, upload, y.cpu(), target, fished, data, {**kwargs, "seed": args.seed + number})
                rows.append(dict(K=steps, b=args.batch, upload=number, target_class=target, fished=fished,
                                 psnr=target_psnr(data, images, x[:1]), attack_s=time.perf_counter() - started))
                print(rows[-1], flush=True)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    table = []
    for steps in sorted({r["K"] for r in rows}):
        group = {f: [r["psnr"] for r in rows if r["K"] == steps and r["fished"] == f] for f in (True, False)}
        table.append({"K": steps, "uploads": len(group[True]),
                      "fished: median PSNR": statistics.median(group[True]), "fished: max": max(group[True]),
                      "fished ≥ 18 dB": sum(p >= 18 for p in group[True]),
                      "honest: median PSNR": statistics.median(group[False]), "honest: max": max(group[False]),
                      "fished − honest (median of pairs)": statistics.median(
                          a - b for a, b in zip(group[True], group[False]))})
    return table


def main() -> None:
    parser = study_argparser(__doc__)
    parser.add_argument("--config", default=str(ROOT / "simulations" / "default.toml"))
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4], help="local steps K")
    parser.add_argument("--batch", type=int, default=8, help="the client's batch size b per step")
    parser.add_argument("--uploads", type=int, default=3, help="uploads per K")
    parser.add_argument("--iterations", type=int, default=1000, help="the strongest attack's GS iterations")
    parser.add_argument("--restarts", type=int, default=1)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = run(args)
    write_study(f"study_fishing_multistep{args.tag}", rows, summarise(rows), started)


if __name__ == "__main__":
    main()
