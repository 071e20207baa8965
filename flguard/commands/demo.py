"""``flguard demo``: the main job — measure, guard and attack real digits, offline."""

from __future__ import annotations

import csv
import time
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def demo_command(
    out: Path = typer.Option(Path("demo-out"), help="Directory for demo.csv and reconstructions.png."),
    samples: int = typer.Option(3, min=1, help="MNIST-5k digits to attack."),
    min_rmse: float = typer.Option(0.3, min=0.0, help="Guard floor τ (model-input units)."),
    attack_steps: int = typer.Option(30, min=1, help="DLG L-BFGS steps (20 inner iterations each)."),
    seed: int = typer.Option(0),
) -> None:
    """Measure each digit's risk, guard its gradient, and let a malicious server run DLG on it."""
    from flguard.demo import run_demo, save_grid

    console = Console(width=None if Console().is_terminal else 120)
    start = time.perf_counter()
    defenses = ("none", "gaussian", "eigen")
    with console.status("running") as status:
        rows, tiles = run_demo(samples=samples, min_rmse=min_rmse, attack_steps=attack_steps, seed=seed,
                               defenses=defenses, progress=lambda text: status.update(text))
    table = Table(title=f"LeNet (uniform init) on MNIST-5k, FedSGD B=1, DLG attack; guard floor τ={min_rmse}")
    for column in ("sample", "label", "defense", "noise ‖δ‖", "‖δ‖/‖g‖", "predicted RMSE ≥", "measured RMSE", "PSNR dB", "met"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r.sample), str(r.label), r.defense, f"{r.noise_norm:.3g}", f"{r.rel_noise:.3g}", f"{r.predicted_rmse:.3g}",
                      f"{r.measured_rmse:.3g}", f"{r.psnr:.1f}", "yes" if r.met else "no")
    console.print(table)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "demo.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    save_grid(tiles, 1 + len(defenses), out / "reconstructions.png")
    console.print(
        f"What this did: for {samples} real MNIST digits it measured each digit's leakage (I2F), sent the "
        f"gradient unguarded and through flguard's calibrated-Gaussian and eigen-aware guards at τ={min_rmse}, "
        f"and ran the DLG attack on every upload. RMSEs are in model-input units (× {0.3086} for pixels). "
        f"Wrote {out / 'demo.csv'} and {out / 'reconstructions.png'} (original | none | gaussian | eigen) "
        f"in {time.perf_counter() - start:.0f} s.")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
