"""How far the calibrated Gaussian's noise moves the parameters per step: trained vs from scratch.

``auto``'s choice between the Gaussian and eigen (``flguard.guard.perturb.AUTO_MAX_MOVE``) rests on one
quantity: the move a step of the Gaussian's noise makes, m = lr·‖noise‖/‖θ‖, as a share of the
parameters' norm. This study prints it per guarded step, ``defense="gaussian"`` with the data's
normalisation only (every other setting the default), in the two regimes the defaults must serve:

- ``trained-<model>``: ``bench_guard_models``' model trained 150 steps (the quickstart CNN by default,
  ``--trained resnet20_gn`` for the ResNet-20-GN on photos32), then its round at B = 32, lr 0.01;
- ``scratch-N``: the quickstart CNN from PyTorch's initialisation (the frontier's model), N unguarded
  SGD steps at B = 16, lr 0.1 (the frontier's client step), then 12 guarded steps at that lr.

Each row: the setting, the guarded step, ‖θ‖, the Gaussian's ‖noise‖ ÷ ‖g‖ and its move m; the summary
prints each setting's median, largest and root-mean-square move, and the largest exponential running
root mean square over AUTO_MOVE_STEPS steps (what ``auto`` compares with AUTO_MAX_MOVE).

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_gaussian_move.py
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python study_gaussian_move.py --trained resnet20_gn \
        --trained-steps 10 --scratch                                       # the ResNet-20-GN's round only

``--guard FIELD=VALUE …`` guards with other settings instead (e.g. ``defense=auto clip_per_sample=retention``: what the
noise ``auto`` sends at a raised clip level does to the weights; docs/results.md, "A clip level for both regimes"); each
row then also names the kind sent and the step's C over the batch's median per-sample norm.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections import Counter

import torch

from _common import guard_settings, study_paths, write_table
from bench_guard_models import _task


def _moves(setting: str, model, batches, lr: float, data, guard: dict) -> list[dict]:
    """Guard each batch (the Gaussian unless ``guard`` says otherwise) and apply the guarded SGD step; one
    row per step, with the kind sent and the step's clip level over the batch's median per-sample norm."""
    from flguard import GuardConfig, GuardFailure, make_guarded

    plain = copy.deepcopy(model)  # for the batch's median norm: a forward of the guarded model would count as a step's
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    config = GuardConfig(**{"defense": "gaussian", **guard}, pixel_mean=data.mean, pixel_std=data.std)
    model, optimizer, criterion = make_guarded(model, optimizer, torch.nn.CrossEntropyLoss(), config)
    rows = []
    for step, (x, y) in enumerate(batches):
        theta = float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).norm())
        optimizer.zero_grad()
        plain.load_state_dict(model.state_dict())
        median = _median_norm(plain, x, y)
        criterion(model(x), y).backward()
        try:
            optimizer.step()
        except GuardFailure:
            rows.append(dict(setting=setting, step=step, theta=theta, rel_noise=None, move=None))
            continue
        report = optimizer.guard_reports[-1]
        clip = report.details.get("clip")
        rows.append(dict(setting=setting, step=step, theta=theta, rel_noise=report.rel_noise,
                         move=lr * report.noise_norm / theta, kind=report.details.get("defense_used", config.defense),
                         over_median=None if clip is None else clip / median))
    return rows


def _median_norm(model, x: torch.Tensor, y: torch.Tensor) -> float:
    """The batch's lower-median per-sample gradient norm (the "median" clip level), unscaled."""
    from flguard.guard.clipping import lower_quantile
    from flguard.risk.operator import JacobianOperator

    return lower_quantile(JacobianOperator(model, x, y).per_sample_gradients().norm(dim=1), 0.5)


def _scratch(pre_steps: int, guard: dict, guarded_steps: int = 12) -> list[dict]:
    from flguard.data import load
    from flguard.models import create

    torch.manual_seed(1)
    data = load("mnist5k")
    model = create("cnn", in_channels=1, num_classes=10, image_size=28)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))

    def batch(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """16 samples of one fixed permutation from ``start`` (mod 4,000), as a shuffled loader gives them."""
        idx = order[start % 4000:start % 4000 + 16]
        return data.normalize(data.images[idx]), data.labels[idx]

    params = list(model.parameters())
    for step in range(pre_steps):
        x, y = batch(16 * step)
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(0.1 * g)
    return _moves(f"scratch-{pre_steps}", model, [batch(16 * (pre_steps + s)) for s in range(guarded_steps)], 0.1, data,
                  guard)


def _trained(name: str, steps: int, guard: dict, seed: int) -> list[dict]:
    """``bench_guard_models``' round: the model trained 150 steps, then ``steps`` steps at B = 32, lr 0.01."""
    model, (x, y), _, data = _task(name, 150, "cpu", seed)
    model.train()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))[:steps * 32]
    return _moves(f"trained-{name}", model, [(x[idx], y[idx]) for idx in order.split(32)], 0.01, data, guard)


def _running_rms(moves: list[float], steps: int) -> float:
    """The largest exponential running root mean square (``flguard.guard.perturb.Perturber._moved_too_far``)."""
    from flguard.guard.perturb import averaged_square

    square, largest = None, 0.0
    for m in moves:
        square = averaged_square(square, m, steps)
        largest = max(largest, square ** 0.5)
    return largest


def main() -> None:
    from flguard.guard.perturb import AUTO_MAX_MOVE, AUTO_MOVE_STEPS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", type=int, nargs="*", default=[0, 40, 150, 400],
                        help="unguarded steps before the guarded ones, from initialisation")
    parser.add_argument("--trained", nargs="*", default=["cnn"], help="bench_guard_models' trained models (cnn, resnet20_gn)")
    parser.add_argument("--trained-steps", type=int, default=20, help="guarded steps of each trained model's round")
    parser.add_argument("--guard", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="GuardConfig fields (default: defense=gaussian, every other setting the default), "
                             "e.g. defense=auto clip_per_sample=retention")
    parser.add_argument("--seed", type=int, default=0, help="the trained models' task seed (bench_guard_models')")
    parser.add_argument("--tag", default="", help="suffix of the output tables' names")
    args = parser.parse_args()
    guard = guard_settings(args.guard)
    rows = [row for name in args.trained for row in _trained(name, args.trained_steps, guard, args.seed)]
    rows += [row for pre in args.scratch for row in _scratch(pre, guard)]
    summary = []
    for setting in dict.fromkeys(row["setting"] for row in rows):
        moves = [row["move"] for row in rows if row["setting"] == setting and row["move"] is not None]
        summary.append(dict(setting=setting, steps=len(moves), median=statistics.median(moves), largest=max(moves),
                            rms=(sum(m * m for m in moves) / len(moves)) ** 0.5,
                            running_rms_max=_running_rms(moves, AUTO_MOVE_STEPS), auto_limit=AUTO_MAX_MOVE,
                            kinds=" ".join(f"{k}:{n}" for k, n in Counter(
                                row["kind"] for row in rows if row["setting"] == setting and row["move"] is not None).items()),
                            over_median=statistics.median(
                                [row["over_median"] for row in rows if row["setting"] == setting
                                 and row["over_median"] is not None] or [float("nan")])))
    _, path = study_paths(f"study_gaussian_move{args.tag}")
    write_table(rows, path)
    print(write_table(summary, path.with_name(f"study_gaussian_move{args.tag}_summary.csv")))


if __name__ == "__main__":
    main()
