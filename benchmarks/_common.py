"""Shared set-up for the benchmark scripts: a model and a normalised batch from an offline dataset."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from flguard.data import load
from flguard.models import create


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Percent of ``x`` (batches of 250, eval mode, no gradients) that ``model`` labels ``y``; its mode restored."""
    mode = model.training
    model.eval()
    with torch.no_grad():
        correct = sum(int(model(b).argmax(1).eq(t).sum()) for b, t in zip(x.split(250), y.split(250)))
    model.train(mode)
    return 100.0 * correct / len(y)


def model_and_batch(model_name: str, dataset: str, batch: int, *, init: str = "uniform", seed: int = 0,
                    device: str = "cpu", offset: int = 0):
    """(model, x, y, dataset) with x normalised for the model, on ``device``."""
    data = load(dataset)
    torch.manual_seed(seed)
    channels, size, _ = data.shape
    model = create(model_name, in_channels=channels, num_classes=data.num_classes, image_size=size, init=init)
    index = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[offset:offset + batch]
    x = data.normalize(data.images[index])
    return model.to(device), x.to(device), data.labels[index].to(device), data


def demo_round(config_path: str, steps: int, batch: int = 32, device: str = "cpu"):
    """(config, settings, model, batches): the demo's task (``simulations/default.toml``'s warm-started
    model, ``initial_model``) and one local epoch of ``steps`` full batches of client 0's partition,
    in the seeded order of the task — issue 12 §3's protocol, shared by the cost benchmarks. Model and
    batches on ``device``; the data and the warm start are the same on every device."""
    from flguard.compare.config import load_config
    from flguard.simulation.task import TaskSettings, initial_model, load_partition

    config = load_config(config_path)
    settings = TaskSettings.from_config(config.run_config(config.defenses[0]))
    model = initial_model(settings)  # the demo's warm start (no client data)
    train, _ = load_partition(settings, 0)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(settings.seed))
    x, y = train.normalize(train.images[order]), train.labels[order]
    batches = [(bx.to(device), by.to(device)) for bx, by in zip(x.split(batch), y.split(batch))
               if len(bx) == batch][:steps]
    if len(batches) < steps:
        raise SystemExit(f"client 0 has {len(train)} samples: fewer than {steps} batches of {batch}")
    return config, settings, model.to(device), batches


def guarded_step(model: torch.nn.Module, optimizer, criterion, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of a ``make_guarded`` loop on (x, y); a withheld step (``GuardFailure``) is a step taken too, its
    reason in the optimizer's report."""
    from flguard import GuardFailure

    optimizer.zero_grad()
    criterion(model(x), y).backward()
    try:
        optimizer.step()
    except GuardFailure:
        pass


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued kernels, so a wall-clock reading covers them (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# -- helpers of the evidence studies (issue 7) -------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def ms_per_call(fn, reps: int) -> float:
    """Milliseconds per call of ``fn`` over ``reps`` calls in a row (one CPU thread's benchmarks of products)."""
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def add_product_arguments(parser, rounds: int, reps: int) -> None:
    """``--model``, ``--batch``, ``--train-steps``, ``--rounds`` and ``--reps``: the products benchmarks' options
    (a trained model of ``bench_guard_models.py``, one batch, ``--rounds`` rounds of ``--reps`` products)."""
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--reps", type=int, default=reps)


def study_paths(study: str):
    """(figure path docs/figures/<study>.png, table path benchmarks/results/<study>.csv), folders made."""
    figure, table = ROOT / "docs" / "figures" / f"{study}.png", ROOT / "benchmarks" / "results" / f"{study}.csv"
    figure.parent.mkdir(parents=True, exist_ok=True)
    table.parent.mkdir(parents=True, exist_ok=True)
    return figure, table


def flat_gradient(model, x, y) -> torch.Tensor:
    """The FedSGD upload ∇θ L(x, θ) (cross-entropy, mean reduction), flat, trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)]).detach()


def dense_jacobian(op, chunk: int = 196) -> torch.Tensor:
    """J_i of every sample as dense rows J_iᵀ e_k: [B, dx, dθ] (dx Jᵀ products; tiny inputs only)."""
    eye = torch.eye(op.dx, dtype=op.dtype, device=op.device)
    blocks = [op.jt(eye[s:s + chunk].unsqueeze(0).expand(op.batch_size, -1, -1)) for s in range(0, op.dx, chunk)]
    return torch.cat(blocks, dim=1)


def pixel_scores(data, reconstruction: torch.Tensor, truth: torch.Tensor) -> dict:
    """Per-sample MSE / PSNR / SSIM on [0, 1] pixels (reconstruction clamped, no re-matching: B = 1
    uploads), plus the unclamped RMSE in model-input units (the unit of I2F and of the guard's τ)."""
    from flguard.attacks import metrics

    rec = data.denormalize(reconstruction.detach().cpu()).clamp(0, 1)
    ref = data.denormalize(truth.detach().cpu()).clamp(0, 1)
    scores = metrics.score(rec, ref, 1.0, matched=False, with_lpips=False)
    rmse_input = (reconstruction.detach().cpu() - truth.detach().cpu()).flatten(1).pow(2).mean(1).sqrt()
    return {"mse": scores["mse"].tolist(), "psnr": scores["psnr"].tolist(), "ssim": scores["ssim"].tolist(),
            "rmse_input": rmse_input.tolist()}


def write_table(rows: list[dict], path, columns: list[str] | None = None, digits: int = 4) -> str:
    """Write ``rows`` to CSV at ``path`` (unless None) and return them as a markdown table."""
    import csv

    keys = list(rows[0]) if rows else []
    if path is not None:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    columns = columns or keys

    def fmt(value):
        return f"{value:.{digits}g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def study_argparser(doc: str):
    """argparse with the flags every study shares: --full, --device, --seed."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="GPU scale: more samples and attack iterations")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0, help="model and sample-selection seed")
    return parser


def parse_study_args(parser, *, full: dict, cpu: dict):
    """Parse, then give every option still None its preset: ``full`` with --full, else ``cpu``.

    Also pins torch to one thread: the studies time attacks on a shared 2-core machine.
    """
    import torch

    args = parser.parse_args()
    for key, value in (full if args.full else cpu).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    torch.set_num_threads(1)
    return args


def in_child(fn, *args):
    """``fn(*args)`` in a fresh spawned process, its result returned: the child's peak RSS (``ru_maxrss``)
    is then that call's own, not the benchmark's or an earlier measurement's."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def add_batch_arguments(parser) -> None:
    """The options of the scripts that guard a few batches of ``bench_guard_models.py``'s trained model:
    ``--model``, ``--batch``, ``--batches``, ``--train-steps``."""
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--train-steps", type=int, default=150)


def guard_settings(items: list[str]) -> dict:
    """``FIELD=VALUE`` command-line items as GuardConfig keyword arguments (numbers as floats)."""
    settings = {}
    for item in items:
        field, value = item.split("=", 1)
        try:
            settings[field] = float(value)
        except ValueError:
            settings[field] = value
    return settings
