"""``flguard attack``: invert the gradient of one batch and show how much of it leaks.

It plays the malicious server on a single FedSGD upload: build the model, compute the batch
gradient a client would send, run ``flguard.attacks.reconstruct`` on it, and write the
originals-vs-reconstructions grid (``reconstruction.png``) and the scores (``metrics.json``,
``metrics.csv``).

``--defense`` (any ``GuardConfig.defense`` but ``none``) puts the client's guard between the two:
``Guard(GuardConfig(defense=..., **--guard fields)).protect`` perturbs the gradient, and the attack
sees only what the guard lets leave the client. The scores then sit beside the guard's promise:
each sample's predicted recovery RMSE (``predicted_rmse``, input units) next to the measured one
(``rmse_input``). When the guard withholds the update (its floor cannot be met within the budget:
fail closed), nothing is attacked and ``metrics.json`` says why.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

STAGES = ("load data and model", "compute the client's gradient", "run the attack", "score and save")


def _parse_hyperparameters(pairs: list[str], option: str = "--hp") -> dict[str, Any]:
    """``key=value`` pairs; values are JSON when they parse (numbers, true, lists), else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{option} {pair!r} must look like key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _client_batch(dataset: str, model_name: str, samples: int, init: str, seed: int):
    """The dataset, a seeded random batch of ``samples`` and the (seeded) model under attack."""
    from flguard.data import load
    from flguard.models import create

    data = load(dataset)
    if samples > len(data):
        raise typer.BadParameter(f"--samples {samples} exceeds the {len(data)} samples of {dataset}")
    generator = torch.Generator().manual_seed(seed)
    index = torch.randperm(len(data), generator=generator)[:samples]
    channels, size, _ = data.shape
    torch.manual_seed(seed)
    model = create(model_name, in_channels=channels, num_classes=data.num_classes, image_size=size, init=init)
    return data, data.images[index], data.labels[index], index, model


def _batch_gradient(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The FedSGD upload: the flat gradient of the mean cross-entropy of the batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def _guard(defense: str, pairs: list[str], data: Any) -> Any:
    """The client's guard for ``--defense`` and ``--guard`` fields, or None for no defense.

    ``max_psnr`` (a floor in pixel PSNR) gets the dataset's normalisation unless given.
    """
    fields = {key.replace("-", "_"): value for key, value in _parse_hyperparameters(pairs, "--guard").items()}
    if defense == "none":
        if fields:
            raise typer.BadParameter(f"--guard {', '.join(sorted(fields))}: the guard's fields need a --defense "
                                     "other than 'none'")
        return None
    from flguard import Guard, GuardConfig

    if "max_psnr" in fields:
        fields.setdefault("pixel_mean", tuple(data.mean))
        fields.setdefault("pixel_std", tuple(data.std))
    try:
        return Guard(GuardConfig(defense=defense, **fields))
    except ValueError as error:  # a ConfigError names the field, the value and the rule
        raise typer.BadParameter(str(error)) from None


def _guard_summary(report: Any, *, sent: bool) -> dict[str, Any]:
    """What the guard did to the upload: its Flower reply metrics (``guard_*``), τ and why not met."""
    return {"sent": sent, "min_rmse": report.min_rmse, "reason": report.reason, **report.metrics(dropped=not sent)}


def _write_outputs(out: Path, originals: torch.Tensor, reconstructions: torch.Tensor, per_sample: list[dict],
                   summary: dict[str, Any]) -> list[Path]:
    from flguard.server.results import save_grid

    out.mkdir(parents=True, exist_ok=True)
    grid = save_grid([originals, reconstructions], out / "reconstruction.png")
    (out / "metrics.json").write_text(json.dumps({**summary, "per_sample": per_sample}, indent=2))
    with (out / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(per_sample[0]))
        writer.writeheader()
        writer.writerows(per_sample)
    return [grid, out / "metrics.json", out / "metrics.csv"]


def attack_command(
    model: str = typer.Option("lenet", help="Model name (flguard.models)."),
    dataset: str = typer.Option("lfw-faces", help="Dataset name (flguard.data); offline: mnist5k, lfw-faces, digits."),
    method: str = typer.Option("gs", help="Attack (flguard.attacks): gs, dlg, ..."),
    defense: str = typer.Option("none", help="The guard's defense applied to the upload before the attack "
                                "(gaussian, eigen, fixed-gaussian, pruning, localdp); none: the raw gradient."),
    guard: list[str] = typer.Option([], "--guard", help="A field of the --defense's GuardConfig, key=value "
                                    "(repeatable), e.g. min_rmse=0.5, max_psnr=20, seed=0, sigma=0.01 "
                                    "(fixed-gaussian), clipping_norm/sensitivity/epsilon (localdp, required); "
                                    "a field the defense does not take is an error."),
    samples: int = typer.Option(1, min=1, help="Batch size B of the attacked upload."),
    iterations: int | None = typer.Option(None, min=1, help="Attack iterations (default: the method's published preset)."),
    restarts: int = typer.Option(1, min=1, help="Random restarts, optimised together."),
    init: str = typer.Option("uniform", help="Model initialisation (uniform = the attack-study setting)."),
    labels: str = typer.Option("recover", help="'recover' (iDLG / batch counts) or 'true' (labels known)."),
    seed: int = typer.Option(0, help="Seeds the batch choice, the model and the attack's start."),
    hp: list[str] = typer.Option([], "--hp", help="Extra attack hyperparameter key=value (repeatable), e.g. tv=0.01."),
    device: str | None = typer.Option(None, help="torch device for the attack (default: CPU)."),
    out: Path = typer.Option(Path("attack-out"), help="Directory for reconstruction.png, metrics.json/.csv."),
) -> None:
    """Attack one client batch and write the originals-vs-reconstructions grid and the metrics."""
    from flguard.attacks import hyperparameters_of, metrics, methods, reconstruct

    if labels not in ("recover", "true"):
        raise typer.BadParameter(f"--labels {labels!r} must be 'recover' or 'true'")
    if method not in methods():
        raise typer.BadParameter(f"--method {method!r} is unknown; choose one of {', '.join(sorted(methods()))}")
    extra = _parse_hyperparameters(hp)
    settings = {"model": model, "dataset": dataset, "method": method, "defense": defense, "samples": samples,
                "restarts": restarts, "init": init, "labels": labels, "seed": seed}
    console = Console()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task(STAGES[0], total=len(STAGES))
        try:
            data, pixels, true_labels, index, net = _client_batch(dataset, model, samples, init, seed)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
        client_guard = _guard(defense, guard, data)
        progress.update(bar, advance=1, description=STAGES[1])
        inputs = data.normalize(pixels)
        gradient = _batch_gradient(net, inputs, true_labels)
        predicted = None
        if client_guard is not None:  # the client's guard decides what leaves it
            output = client_guard.protect(net, inputs, true_labels, gradient)
            settings["guard"] = _guard_summary(output.report, sent=output.gradient is not None)
            if output.gradient is None:
                out.mkdir(parents=True, exist_ok=True)
                (out / "metrics.json").write_text(json.dumps(settings, indent=2))
                progress.stop()
                console.print(f"the guard withheld the upload ({output.report.reason}): nothing left the client to "
                              f"attack\nwrote {out / 'metrics.json'}")
                return
            gradient, predicted = output.gradient.reshape(-1), output.report.rmse_after
        progress.update(bar, advance=1, description=f"{STAGES[2]} ({method}, {iterations or 'preset'} iterations)")
        accepted = hyperparameters_of(method)
        if {"mean", "std"} <= accepted.keys():
            extra = {"mean": data.mean, "std": data.std, **extra}
        started = time.perf_counter()
        try:
            rec = reconstruct(net, gradient, data.shape, method=method, labels=true_labels if labels == "true" else None,
                              batch_size=samples, iterations=iterations, restarts=restarts, device=device, seed=seed,
                              **extra)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
        seconds = time.perf_counter() - started
        progress.update(bar, advance=1, description=STAGES[3])
        images = rec.images.detach().cpu()
        recovered = data.denormalize(images).clamp(0, 1)
        scores = metrics.score(recovered, pixels, data_range=1.0)
        permutation = scores["permutation"].cpu()
        recovered = recovered[permutation]
        # The guard's unit: RMSE in model-input space, unclamped (what its predicted_rmse promises).
        rmse_input = (images[permutation].to(inputs) - inputs).flatten(1).pow(2).mean(1).sqrt()
        rec_labels = rec.labels.detach().cpu().view(-1)[permutation]
        per_sample = [{"index": int(index[i]), "label": int(true_labels[i]), "recovered_label": int(rec_labels[i]),
                       **{k: float(scores[k][i]) for k in scores if k != "permutation"},
                       "rmse_input": float(rmse_input[i]),
                       **({} if predicted is None else {"predicted_rmse": float(predicted[i])})}
                      for i in range(samples)]
        summary = {**settings, "iterations": rec.extra.get("iterations", iterations),
                   "hyperparameters": {k: v for k, v in extra.items()},
                   "matching_loss": float(rec.loss), "seconds": seconds,
                   "label_accuracy": float((rec_labels == true_labels).double().mean()),
                   "lpips": metrics.lpips_status() if "lpips" not in scores else "available",
                   **{f"mean_{k}": float(v.double().mean()) for k, v in scores.items() if k != "permutation"}}
        files = _write_outputs(out, pixels, recovered, per_sample, summary)
        progress.update(bar, advance=1)
    shown = ["index", "label", "recovered_label", "psnr", "ssim", "mse", "rmse_input"]
    shown += [] if predicted is None else ["predicted_rmse"]
    table = Table(title=f"{method} on {model}/{dataset}, B={samples}, defense={defense} ({seconds:.1f} s)")
    for column in shown:
        table.add_column(column, justify="right")
    for row in per_sample:
        table.add_row(*[f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in shown])
    console.print(table)
    console.print("wrote " + ", ".join(str(f) for f in files))


def register(app: typer.Typer) -> None:
    """Attach ``flguard attack`` to the CLI."""
    app.command("attack")(attack_command)
