"""A guarded round with a module switch off and on, in lockstep in one process: the paired measure of a change to
the guard's code path (two rounds a few percent apart are within a CPU's drift from one run to the next).

A trained model of ``bench_guard_models.py`` is copied twice and each copy guarded with the defaults
(``GuardConfig(pixel_mean, pixel_std, seed)``, its own guard); the copies take the same batches, step by step, the
switch (a module's boolean, ``--switch flguard.risk.ghost_forward.CLOSED_FORM_GROUP_NORM``) set off before the first
copy's step and on before the second's, which goes first alternating. ``--rounds`` rounds of ``--steps`` steps, each
from the trained model with its own batches and guard seed.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_switch_round.py \\
        --switch flguard.risk.ghost_forward.CLOSED_FORM_GROUP_NORM --model resnet20_gn --batch 8 --steps 8

Printed per round: whether both copies took the same decisions (products a step, steps sent), the largest parameter
difference after the round (float rounding where the code paths differ in it), products a step; then on ÷ off for the
rounds' total time, the median and mean of the steps' paired ratios, and the median step each way.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import time

import torch

from _common import guarded_step
from bench_guard_models import LEARNING_RATE, _task
from flguard import GuardConfig, make_guarded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", required=True,
                        help="module.ATTRIBUTE, a boolean: off for one copy, on for the other")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=150)
    args = parser.parse_args()
    module_name, attribute = args.switch.rsplit(".", 1)
    module = importlib.import_module(module_name)
    shipped = getattr(module, attribute)
    if not isinstance(shipped, bool):
        raise SystemExit(f"{args.switch} is {shipped!r}, not a boolean")
    torch.set_num_threads(1)
    trained, (x, y), _, data = _task(args.model, args.train_steps, "cpu", 0)
    trained.train()
    ratios: list[float] = []
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        copies = {}
        for switch in (False, True):
            model = copy.deepcopy(trained)
            optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE[args.model] / 5)
            copies[switch] = make_guarded(model, optimizer, torch.nn.CrossEntropyLoss(),
                                          GuardConfig(pixel_mean=data.mean, pixel_std=data.std, seed=1 + round_))
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1 + round_))
        for step, index in enumerate(order[:args.steps * args.batch].split(args.batch)):
            took = {}
            for switch in ((False, True) if step % 2 == 0 else (True, False)):
                setattr(module, attribute, switch)
                model, optimizer, criterion = copies[switch]
                start = time.perf_counter()
                guarded_step(model, optimizer, criterion, x[index], y[index])  # a withheld step timed as well
                took[switch] = time.perf_counter() - start
            for switch, seconds in took.items():
                times[switch].append(seconds)
            ratios.append(took[True] / took[False])
        setattr(module, attribute, shipped)
        reports = {switch: copies[switch][1].guard_reports for switch in copies}
        products = {switch: sum(r.matvecs for r in reports[switch]) / len(reports[switch]) for switch in reports}
        sent = {switch: sum(r.met for r in reports[switch]) for switch in reports}
        same = products[False] == products[True] and sent[False] == sent[True]
        with torch.no_grad():
            difference = max(float((a - b).abs().max()) for a, b in zip(copies[False][0].parameters(),
                                                                         copies[True][0].parameters()))
        print(f"round {round_}: same decisions {same}; largest parameter difference {difference:.2g}; products a "
              f"step off {products[False]:.2f} on {products[True]:.2f}; sent off {sent[False]} on {sent[True]} "
              f"of {args.steps}")
    total = {switch: sum(seconds) for switch, seconds in times.items()}
    print(f"{args.model} B={args.batch}, {args.switch} (one CPU thread), {len(ratios)} paired steps:")
    print(f"on ÷ off: total {total[True] / total[False]:.3f}, paired steps' median {statistics.median(ratios):.3f} "
          f"and mean {statistics.mean(ratios):.3f}; median step off {1e3 * statistics.median(times[False]):.0f} ms, "
          f"on {1e3 * statistics.median(times[True]):.0f} ms")


if __name__ == "__main__":
    main()
