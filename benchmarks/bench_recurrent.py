"""What a guarded step of a stacked recurrent classifier costs against its training step, by sequence length.

Each model — two ``nn.GRU`` or ``nn.LSTM`` layers of 32 with dropout 0.1 between them, six input features, a linear
head on the last step, untrained — takes six unguarded SGD steps at batch 32 on random sequences of ``--length``
steps (the median timed), then four steps through ``flguard.make_guarded`` with the defaults (seeded). Printed per
cell: ms per training step, s per guarded step, their ratio, steps sent and Jacobian products per sample.

    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_recurrent.py --length 20
    cd benchmarks && OMP_NUM_THREADS=1 ../.venv/bin/python bench_recurrent.py --length 50

The guard's passes run the recurrences in plain operators (``flguard.risk.recurrent``); the training step runs
PyTorch's fused kernels. docs/results.md, "Recurrent models".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

FEATURES, HIDDEN, CLASSES, BATCH = 6, 32, 6, 32


class StackedClassifier(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = cell(FEATURES, HIDDEN, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def main() -> None:
    from flguard import GuardConfig, GuardFailure, make_guarded

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=20, help="steps per sequence")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| cell | T | training step (ms) | guarded step (s) | ratio | sent | products per sample |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for cell in (nn.GRU, nn.LSTM):
        torch.manual_seed(0)
        model = StackedClassifier(cell)
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(BATCH, args.length, FEATURES, generator=g),
                 torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(6)]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        plain = []
        for x, y in data:
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            plain.append(time.perf_counter() - start)
        model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                                   nn.CrossEntropyLoss(), GuardConfig(seed=0))
        guarded, sent = [], 0
        for x, y in data[:4]:
            start = time.perf_counter()
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            try:
                optimizer.step()
                sent += 1
            except GuardFailure:
                pass
            guarded.append(time.perf_counter() - start)
        train, step = statistics.median(plain), statistics.median(guarded)
        products = statistics.median(r.matvecs for r in optimizer.guard_reports)
        print(f"| {cell.__name__} | {args.length} | {1000 * train:.1f} | {step:.2f} | {step / train:.0f}× | "
              f"{sent} / 4 | {products:.1f} |", flush=True)


if __name__ == "__main__":
    main()
