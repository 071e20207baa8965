"""The operator's two product paths by model size: time per product and peak memory, × a training step.

``JacobianOperator`` applies J_i and J_iᵀ either through pullbacks cached at the first product
(``products="cached"``) or directly per sample, ``vmap``-ed over chunks of samples with nothing kept
(``products="direct"``); ``"auto"`` switches at B·dθ > ``CACHED_UP_TO`` floats. Each (model, batch, path)
runs in a child process of its own so that its peak RSS is its own. Printed per row: the median time
of ``jt`` (one vector per sample), ``j``, ``kmv`` (the solvers' product) and the per-sample gradients, as
ratios to a training step (forward + backward of the mean loss, same batch), the first ``kmv`` (which
builds the cached pullbacks), the peak RSS after the training steps (``peak_train_gb``), after the
``kmv`` calls (``peak_kmv_gb``: all the solvers need) and at the end (``peak_gb``, after ``jt``/``j``
made [B, dθ] outputs), and ``jt``/``j``. ``--clip``: the guard's operator, per-sample clipped at the
median norm (``ClippedJacobian``; it keeps the per-sample gradients, [B, dθ]). ``--precision tf32`` (CUDA only): the
products with TF32 allowed for convolutions and matrix products — what the guard's certificate does not allow
(``flguard.risk.precision``), timed to say what its IEEE float32 costs on a GPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_operator_products.py
    OMP_NUM_THREADS=1 python benchmarks/bench_operator_products.py --models resnet18_gn --batch 8,32
    OMP_NUM_THREADS=1 python benchmarks/bench_operator_products.py --models resnet18_gn --batch 8,32 --paths auto --clip
    python benchmarks/bench_operator_products.py --device cuda --models cnn,resnet20_gn,resnet18_gn --batch 32

Models from the zoo with random weights (the products' cost does not depend on training); batches of
random inputs of the model's data shape. Results: benchmarks/results/bench_operator_products.csv.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from _common import in_child, study_paths, synchronize, write_table

SHAPES = {"cnn": (1, 28), "resnet8_gn": (3, 32), "resnet20_gn": (3, 32), "resnet18_gn": (3, 32)}


def _timed(fn, device: str, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        out.append(time.perf_counter() - start)
    return out


def _peak(device: str) -> float:
    return (torch.cuda.max_memory_allocated(device) / 2**30 if torch.device(device).type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


def _measure(name: str, batch: int, products: str, device: str, repeats: int, clip: bool = False,
             precision: str = "ieee") -> dict:
    """One (model, batch, path) in this (child) process; ``clip``: the guard's operator, per-sample
    clipped at the median norm (``ClippedJacobian``, which keeps the per-sample gradients); ``precision="tf32"``:
    the products with TF32 allowed (a measurement only: the certificate needs IEEE float32)."""
    import contextlib

    from flguard.models import create
    from flguard.risk import operator as operator_module, precision as precision_module, sizing
    from flguard.risk.clipped import ClippedJacobian
    from flguard.risk.operator import JacobianOperator

    if precision == "tf32":
        precision_module.ieee_float32 = contextlib.nullcontext
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    # "cached-transposed": the cached pullbacks with convolutions' input gradients as transposed convolutions
    operator_module.CACHED_TRANSPOSED_INPUT_GRADS = products == "cached-transposed"
    path = {"direct-cpu-chunks": "direct", "cached-transposed": "cached"}.get(products, products)
    if products == "direct-cpu-chunks":  # the direct path in the CPU's chunks on any device (a GPU's baseline)
        sizing.CUDA_CHUNK_SHARE = 0.0
    torch.manual_seed(0)
    channels, size = SHAPES[name]
    model = create(name, in_channels=channels, num_classes=10, image_size=size).to(device)
    x = torch.randn(batch, channels, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def train_step() -> None:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()

    train = statistics.median(_timed(train_step, device, repeats + 1)[1:])
    peak_train = _peak(device)
    op = JacobianOperator(model, x, y, products=path)
    if clip:
        op = ClippedJacobian(op, float(op.per_sample_gradients().norm(dim=1).median()))
    u = torch.randn(batch, 1, op.dx, device=device)
    first = _timed(lambda: op.kmv(u), device, 1)[0]
    kmv = statistics.median(_timed(lambda: op.kmv(u), device, repeats))
    peak_kmv = _peak(device)  # what the solvers need: their products are all kmv (before jt/j's [B, dθ] below)
    v = torch.randn(batch, 1, op.dtheta, device=device)
    times = {kind: statistics.median(_timed(fn, device, repeats)) for kind, fn in
             (("jt", lambda: op.jt(u)), ("j", lambda: op.j(v)))}
    fresh = JacobianOperator(model, x, y, products=path)
    grads = _timed(fresh.per_sample_gradients, device, 1)[0]
    inner = getattr(op, "op", op)
    return dict(model=name, params=op.dtheta, B=batch, products=products, clip=clip, precision=precision,
                path="direct" if inner.direct else "cached", chunk=inner.sample_chunk if inner.direct else batch,
                device=device, train_ms=1000 * train, kmv=kmv / train, first_kmv=first / train,
                jt=times["jt"] / train, j=times["j"] / train, jt_over_j=times["jt"] / times["j"],
                per_sample_grads=grads / train, peak_train_gb=peak_train, peak_kmv_gb=peak_kmv,
                kmv_over_train_rss=peak_kmv / peak_train, peak_gb=_peak(device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,resnet20_gn,resnet18_gn")
    parser.add_argument("--batch", default="8,32", help="batch sizes, comma-separated")
    parser.add_argument("--paths", default="cached,direct,auto",
                        help="product paths, comma-separated: cached, direct, auto, direct-cpu-chunks (the "
                             "direct path in the CPU's chunks of samples, on a GPU too), or cached-transposed (the "
                             "cached pullbacks with convolutions' input gradients as transposed convolutions)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clip", action="store_true", help="the guard's operator: clipped at the median norm")
    parser.add_argument("--precision", default="ieee",
                        help="comma-separated: ieee (the guard's), tf32 (TF32 allowed in the products; CUDA only)")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            for products in args.paths.split(","):
                for precision in args.precision.split(","):
                    row = in_child(_measure, name, batch, products, args.device, args.repeats, args.clip, precision)
                    rows.append(row)
                    print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    suffix = ("_clip" if args.clip else "") + ("_tf32" if "tf32" in args.precision else "")
    _, table = study_paths("bench_operator_products" + suffix)
    print(write_table(rows, table))


if __name__ == "__main__":
    main()
