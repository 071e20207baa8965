"""Isotropic noise shaped by a profile, against resolvent noise: the least protected sample's I²F per unit of noise.

Resolvent noise (``flguard.defenses.resolvent``) needs its own verification solve after the λmax runs, because its
direction depends on every sample's run; noise drawn before the runs — the isotropic Gaussian, or a Gaussian shaped
by a profile learnt on earlier steps — is verified inside the λmax run itself (``flguard.guard.perturb``'s one-run
solve), several products per sample cheaper. This asks whether a shaped Gaussian aims well enough to be worth it: on
a few batches of a trained model (``bench_guard_models.py``'s, median per-sample clipping, negligible samples left
out, ε_i = 1e-2·λmax from a 6-step run) each direction is normalised and every sample's I²F shift solved to 1%, as in
``study_aimed_noise.py``. Profiles: per parameter tensor (its RMS) or per coordinate (|value|) of this batch's
resolvent noise (an oracle), of the previous batch's (what reuse across steps could give), or of the batch's RMS
per-sample gradient (no run at all).

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_shaped_noise.py --model resnet20_gn --batch 8 --batches 3
"""

from __future__ import annotations

import argparse

import torch

from bench_guard_models import trained_batches
from flguard.defenses.resolvent import carried, chosen_resolvent
from flguard.risk.assess import i2f_solve
from flguard.risk.regularised import RegularisedK
from study_aimed_noise import median_clipped


def by_tensor(z: torch.Tensor, profile: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """z with each parameter tensor's block rescaled to ``profile``'s RMS on that block."""
    return torch.cat([block * (ref.square().mean().sqrt() / block.square().mean().sqrt().clamp_min(1e-30))
                      for block, ref in zip(z.split(sizes), profile.split(sizes))])


def main() -> None:
    args, model, _, batches = trained_batches(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    previous = None
    print("| batch | direction | least ‖shift‖ per unit noise | median |\n|---|---|---|---|")
    for seed, x, y, _ in batches:
        op = median_clipped(model, x, y)
        run = RegularisedK(op).lanczos(rtol=0.0, min_iter=6, max_iter=6, seed=1000 * seed)
        eps = 1e-2 * run.lambda_max

        def row(name: str, direction: torch.Tensor) -> None:
            shift = i2f_solve(op, direction / direction.norm(), eps, 1e-2)[0].norm(dim=1)
            print(f"| {seed} | {name} | {float(shift.min()):.4g} | {float(shift.median()):.4g} |", flush=True)

        resolvent = carried(op, *chosen_resolvent(run, eps, "kernel")[:2])
        z = torch.randn(op.dtheta, generator=torch.Generator().manual_seed(seed))
        gradient_rms = (op.per.dense() if op.rows is None else op.per.dense()[op.rows]).square().mean(0).sqrt()
        row("resolvent noise (the default aimed noise)", resolvent)
        row("isotropic", z)
        row("shaped per tensor by this batch's resolvent noise", by_tensor(z, resolvent, sizes))
        row("shaped per coordinate by this batch's resolvent noise", resolvent.abs() * z)
        if previous is not None:
            row("shaped per tensor by the previous batch's resolvent noise", by_tensor(z, previous, sizes))
            row("shaped per coordinate by the previous batch's resolvent noise", previous.abs() * z)
        row("shaped per tensor by the RMS per-sample gradient", by_tensor(z, gradient_rms, sizes))
        row("shaped per coordinate by the RMS per-sample gradient", gradient_rms * z)
        previous = resolvent


if __name__ == "__main__":
    main()
