"""A deployed client's import path carries nothing of the simulation: checked by module name in a
fresh interpreter, where nothing was imported before (the import-linter contracts in pyproject.toml
check the same statically; this checks what Python really loads, lazy imports included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What a client must never load: the simulated federation (task, the true-batch recording channel),
#: the apps that run it, the malicious server (its scoring included), the attacks and the applications.
NOT_ON_CLIENT_PATH = ("flguard.simulation", "flguard.apps", "flguard.server", "flguard.attacks", "flguard.compare",
                      "flguard.audit", "flguard.commands", "flguard.cli", "flguard.data", "flguard.models")

CLIENT = """
import sys
import torch
import flguard, flguard.flower
from flguard import Guard, GuardConfig, check_model, fix_model, make_guarded
from flguard.flower import GuardedNumPyClient, guard_mod, guard_step
from flwr.clientapp import ClientApp

# the user's own ClientApp with the guard, and one guarded step of an unchanged training loop
app = ClientApp(mods=[guard_mod(GuardConfig())])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 2), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4, 3))
model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           torch.nn.CrossEntropyLoss(), GuardConfig(defense="gaussian", seed=0))
optimizer.zero_grad()
criterion(model(torch.rand(4, 3, 2, 2)), torch.tensor([0, 1, 2, 0])).backward()
try:
    optimizer.step()
    print("STEP sent")
except flguard.GuardFailure as failure:  # withheld is fine here: the step ran the whole guard
    print("STEP withheld")
print("\\n".join(sorted(sys.modules)))
"""


def _loaded(probe: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                          cwd=ROOT, timeout=300).stdout.split()


def _under(names: list[str], packages: tuple[str, ...]) -> list[str]:
    return [n for n in names if any(n == p or n.startswith(p + ".") for p in packages)]


def test_the_client_import_path_loads_no_simulation_server_attack_or_scoring_module() -> None:
    loaded = _loaded(CLIENT)
    # the probe did load the client and run a guarded step: the guard's engine, its defense, the Flower mod
    assert "STEP" in loaded
    assert {"flguard.guard.perturb", "flguard.guard.floor", "flguard.guard", "flguard.guard.engine", "flguard.guard.training", "flguard.flower.guard_mod"} <= set(loaded)
    assert _under(loaded, NOT_ON_CLIENT_PATH) == []
    named = [n for n in loaded if n.startswith("flguard") and any(w in n for w in ("truth", "scoring", "metrics",
                                                                                     "fishing", "malicious"))]
    assert named == [], named
    import flguard.flower

    assert not {"record_batch", "TRUTH_DIR_KEY", "MaliciousServer", "AttackSpec", "TruthReader",
                "score_batch"} & set(flguard.flower.__all__)


def test_the_simulations_client_app_records_batches_but_loads_no_server() -> None:
    """The simulation's ClientApp (``flguard.apps.client``) adds the true-batch channel — it is where
    recording belongs — and still loads neither the malicious server nor the attacks (one per Ray actor)."""
    loaded = _loaded("import sys\nfrom flguard.apps.client import make_client_app\nmake_client_app()\n"
                     "print('\\n'.join(sorted(sys.modules)))")
    assert {"flguard.apps.client", "flguard.simulation.truth", "flguard.simulation.task"} <= set(loaded)
    assert _under(loaded, ("flguard.server", "flguard.attacks", "flguard.apps.server", "flguard.compare")) == []
