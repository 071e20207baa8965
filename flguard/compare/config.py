"""The comparison config: one TOML file, validated by pydantic, with errors that name the field.

A config says what to train (``[task]``), how the malicious server attacks (``[attack]``) and which
defenses to compare (``[[defenses]]``, one Flower simulation each). ``run_config`` turns it into
the run-config keys of ``flguard.apps`` — the same keys ``flwr run simulations/ --run-config``
takes, so one config drives the Ray simulation and the deployment engine alike.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from flguard.config import ConfigError, StrictModel
from flguard.simulation.localdp import LocalDpConfig, localdp_run_config
from flguard.flower.guard_mod import guard_run_config
from flguard.guard.config import DEFENSES, GuardConfig, defense_fields, guard_config_model

#: GuardConfig fields a comparison does not take: without ``acknowledge_unguarded``, ``on_unmet =
#: "send"`` is refused, so a comparison never sends an update that missed its floor.
NOT_IN_COMPARISONS = ("acknowledge_unguarded",)
#: The config shipped as ``flguard demo``.
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "simulations" / "default.toml"


class TaskSection(StrictModel):
    """The federated task every defense's run shares (same seeds, partitions, initial model)."""

    dataset: Literal["mnist5k", "lfw-faces", "digits", "photos32", "mnist", "fashion-mnist", "cifar10"] = "mnist5k"
    model: str = Field("lenet", description="a flguard.models name (lenet, cnn2_v1 … cnn4_v2, mlp, linear, resnet18)")
    init: Literal["default", "uniform", "normal", "kaiming", "xavier"] = "uniform"
    clients: int = Field(4, ge=2, le=64, description="simulated SuperNodes, one partition each")
    partitioning: Literal["iid", "dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0.0, description="Dirichlet concentration (smaller = more skewed)")
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of each client's data kept for its test split")
    rounds: int = Field(5, ge=1)
    local_steps: int = Field(1, ge=1, description="guarded SGD steps per round")
    batch_size: int = Field(8, ge=1)
    lr: float = Field(0.1, gt=0.0)
    public_examples: int = Field(0, ge=0, description="examples held out as the server's public data (in no "
                                                      "client's partition)")
    pretrain_epochs: int = Field(0, ge=0, description="epochs the server pre-trains the initial model on its public "
                                                      "data (a warm start: FL from a model that has learned)")
    train_layers: Literal["all", "head"] = Field("all", description="'head': fine-tuning — the backbone pre-trained "
                                                 "on the public data is frozen (its BatchNorms as trained) and the "
                                                 "federation trains a fresh last linear layer")

    @field_validator("model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        from flguard.models.zoo import MODEL_NAMES

        if name not in MODEL_NAMES:
            raise ValueError(f"unknown model; choose one of {', '.join(MODEL_NAMES)}")
        return name


Method = Literal["gs", "dlg", "rgap", "hybrid", "adaptive", "strongest"]


class AttackSection(StrictModel):
    """The malicious server: which attack, on how many clients per round, with what knowledge."""

    method: Method | list[Method] = Field("gs", description="one attack, or several (each upload gets each; "
                                                             "the tables keep the best reconstruction)")
    iterations: int | list[int] = Field(300, description="one count for all methods, or one per method")
    restarts: int = Field(1, ge=1)
    labels: Literal["recover", "true"] = "recover"
    clients_per_round: int = Field(1, ge=1, description="clients attacked per round, taken in turn by partition id")
    victim_batch_size: int = Field(0, ge=0, description=">0: the server asks its victims for this batch size")
    victim_local_steps: int = Field(0, ge=0, description=">0: ... and this many local steps")
    hyperparameters: dict[str, float | int | str | bool] = Field(default_factory=dict)
    strongest: bool = Field(False, description="strongest-attack mode: GS sweeps its TV weight (0, 1e-4, 1e-2, 0.1) "
                                               "and keeps the best by matching loss (method 'strongest' also runs "
                                               "DLG and keeps the better of the two)")
    uploads: int | None = Field(None, ge=0, description="honest clients' real FedAvg uploads attacked per round, "
                                                        "beside the probes (unrolling their local steps); default "
                                                        "1 when the server probes (victim_*), else 0")
    upload_iterations: int = Field(50, ge=1, description="at most this many iterations per attack on a real "
                                                          "upload (K·B images, K unrolled steps: the cost bound)")
    fishing: Literal["none", "class", "feature"] = Field(
        "none", description="'class': each round the server also sends fishing_clients clients (not the probed "
                            "ones) a model whose classifier isolates one class's samples (Wen et al. 2022; the "
                            "class rotates per round) and asks for one local step; it attacks their replies and "
                            "does not aggregate them. 'feature' is refused: feature fishing is the library "
                            "function flguard.server.fishing.fish_feature, not a round move")
    fishing_clients: int = Field(1, ge=1, description="clients fished per round (with fishing = 'class'); each "
                                                       "fished reply gets every attack at the full iterations")

    @property
    def methods(self) -> list[str]:
        return [self.method] if isinstance(self.method, str) else list(self.method)

    @property
    def counts(self) -> list[int]:
        counts = [self.iterations] if isinstance(self.iterations, int) else list(self.iterations)
        return counts * len(self.methods) if len(counts) == 1 else counts

    @model_validator(mode="after")
    def _iterations_per_method(self) -> "AttackSection":
        if not self.methods:
            raise ValueError("method: give at least one attack")
        if len(self.counts) != len(self.methods) or min(self.counts) < 1:
            raise ValueError(f"iterations={self.iterations!r}: give one positive count, or one per method "
                             f"({len(self.methods)})")
        return self

    @field_validator("fishing")
    @classmethod
    def _round_move(cls, kind: str) -> str:
        if kind == "feature":
            raise ValueError("'feature' is not a move of the malicious server's rounds (it fishes by class: "
                             "fishing = 'class'); feature fishing needs thresholds the server estimates from its "
                             "own data and is the library function flguard.server.fishing.fish_feature")
        return kind


def compare_fields(defense: str) -> tuple[str, ...]:
    """The keys a ``[[defenses]]`` table of ``defense`` may set besides ``name`` and ``defense``, derived
    from the models: none for ``none`` (no guard runs), ``LocalDpConfig``'s for ``localdp`` (Flower's
    LocalDpMod), else the defense's own GuardConfig fields (``defense_fields``) less
    NOT_IN_COMPARISONS."""
    if defense == "none":
        return ()
    if defense == "localdp":
        return tuple(LocalDpConfig.model_fields)
    return tuple(name for name in defense_fields(defense) if name not in NOT_IN_COMPARISONS)


#: Every key some ``[[defenses]]`` table may set (DefenseSpec's fields besides name and defense).
SPEC_FIELDS = tuple(dict.fromkeys(name for defense in DEFENSES for name in compare_fields(defense)))


class _DefenseSpec(StrictModel):
    """One defense to compare: a guard defense (its GuardConfig fields) or Flower's LocalDpMod
    (``localdp``: LocalDpConfig's fields); ``DefenseSpec`` adds one optional field per SPEC_FIELDS."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="a label; also the run directory's name")
    defense: Literal["none", "auto", "gaussian", "rowspace", "resolvent", "eigen", "fixed-gaussian", "pruning", "localdp"]

    def values(self) -> dict[str, Any]:
        """The fields this table sets (its defense's, the unset ones left out)."""
        return {name: getattr(self, name) for name in compare_fields(self.defense) if getattr(self, name) is not None}

    @model_validator(mode="after")
    def _fits_its_defense(self) -> "_DefenseSpec":
        allowed = compare_fields(self.defense)
        given = {name: getattr(self, name) for name in SPEC_FIELDS if getattr(self, name) is not None}
        foreign = [name for name in given if name not in allowed]
        if foreign:
            own = [name for name in allowed if name not in GuardConfig.model_fields]
            takes = ("runs no guard and takes no other key" if not allowed else f"takes {', '.join(own)}"
                     if self.defense == "localdp" else "takes the common guard fields"
                     + (f" and {', '.join(own)}" if own else ""))
            raise ValueError(f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to defense="
                             f"{self.defense!r}" + (" (Flower's LocalDpMod)" if self.defense == "localdp" else "")
                             + f", which {takes}")
        listed = [name for name, value in given.items() if not isinstance(value, (bool, int, float, str))]
        if listed:
            raise ValueError(f"{', '.join(listed)}: a comparison passes its defenses as run-config values, which "
                             "are numbers, strings or booleans (per-channel values need your own app)")
        if self.defense == "localdp":
            LocalDpConfig(**given)
        elif self.defense != "none":  # a PSNR floor's normalisation comes from the dataset (run_config)
            stand_in = {"pixel_mean": 0.0, "pixel_std": 1.0} if self.max_psnr is not None else {}
            GuardConfig(defense=self.defense, **{**stand_in, **given})
        return self


def _spec_field(name: str) -> tuple[Any, Any]:
    """DefenseSpec's field ``name``: optional, described as in the model of the defenses taking it."""
    takers = [d for d in DEFENSES if name in compare_fields(d)]
    model = LocalDpConfig if takers == ["localdp"] else guard_config_model(takers[0])
    return Any, Field(None, description=f"{', '.join(takers)}: {model.model_fields[name].description or name}")


DefenseSpec = create_model("DefenseSpec", __base__=_DefenseSpec, __module__=__name__,
                           __doc__=_DefenseSpec.__doc__, **{name: _spec_field(name) for name in SPEC_FIELDS})


class CompareConfig(StrictModel):
    """A whole comparison (see docs/configuration.md for every field)."""

    name: str = "comparison"
    seed: int = 0
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="the attacks' device: auto (CUDA when present), cpu, cuda, cuda:N")
    round_timeout: float = Field(3600.0, gt=0.0)
    task: TaskSection = Field(default_factory=TaskSection)
    attack: AttackSection = Field(default_factory=AttackSection)
    defenses: list[DefenseSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> "CompareConfig":
        names = [d.name for d in self.defenses]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"defense names must be unique; repeated: {', '.join(duplicates)}")
        return self

    @model_validator(mode="after")
    def _room_to_fish(self) -> "CompareConfig":
        attack, clients = self.attack, self.task.clients
        if attack.fishing != "none" and attack.clients_per_round + attack.fishing_clients > clients:
            raise ValueError(f"attack.fishing_clients={attack.fishing_clients}: the server fishes clients it does "
                             f"not attack otherwise, and only {clients} - {attack.clients_per_round} "
                             f"(attack.clients_per_round) = {clients - attack.clients_per_round} of task.clients "
                             "are left per round")
        return self

    def defense(self, name: str) -> DefenseSpec:
        """The defense called ``name`` (a ConfigError naming the known ones otherwise)."""
        for spec in self.defenses:
            if spec.name == name:
                return spec
        raise ConfigError(f"CompareConfig.defenses: no defense named {name!r} "
                          f"(have {', '.join(d.name for d in self.defenses)})")

    def run_config(self, spec: DefenseSpec) -> dict[str, bool | float | int | str]:
        """The run-config keys of ``flguard.apps`` for one defense's run."""
        task, attack = self.task, self.attack
        config: dict[str, bool | float | int | str] = {
            "num-server-rounds": task.rounds, "model": task.model, "dataset": task.dataset, "init": task.init,
            "seed": self.seed, "num-partitions": task.clients, "partitioning": task.partitioning,
            "alpha": task.alpha, "test-fraction": task.test_fraction, "lr": task.lr,
            "local-steps": task.local_steps, "batch-size": task.batch_size, "min-nodes": task.clients,
            "public-examples": task.public_examples, "pretrain-epochs": task.pretrain_epochs,
            "train-layers": task.train_layers,
            "round-timeout": self.round_timeout, "malicious": True,
            "attack-method": ",".join(attack.methods), "attack-iterations": ",".join(map(str, attack.counts)),
            "attack-restarts": attack.restarts, "attack-labels": attack.labels,
            "attack-targets": attack.clients_per_round, "attack-rotate": True, "attack-device": self.device,
            "victim-batch-size": attack.victim_batch_size, "victim-local-steps": attack.victim_local_steps,
        }
        config.update({f"attack-hp-{k.replace('_', '-')}": v for k, v in attack.hyperparameters.items()})
        if attack.strongest:
            config["attack-hp-strongest"] = True
        if attack.uploads is not None:
            config["attack-uploads"] = attack.uploads
        config["attack-upload-iterations"] = attack.upload_iterations
        config["attack-fishing"] = attack.fishing
        config["attack-fishing-clients"] = attack.fishing_clients
        # Every guard-* and localdp-* key, "" where unset: the app's pyproject defaults cannot leak in.
        config.update(guard_run_config(self.guard_config(spec)))
        config.update(localdp_run_config(LocalDpConfig(**spec.values()) if spec.defense == "localdp" else None))
        return config

    def guard_config(self, spec: DefenseSpec) -> GuardConfig | None:
        """The GuardConfig the clients of ``spec``'s run build (None for ``none`` and ``localdp``)."""
        if spec.defense in ("none", "localdp"):
            return None
        return GuardConfig(defense=spec.defense, **self.guard_values(spec))

    def guard_values(self, spec: DefenseSpec) -> dict[str, Any]:
        """The defense's GuardConfig fields; a PSNR floor gets the task dataset's own normalisation
        (the one the clients' inputs went through) unless the config gives it."""
        values = spec.values()
        if spec.max_psnr is not None and (spec.pixel_mean is None or spec.pixel_std is None):
            from flguard.simulation.task import load_dataset

            dataset = load_dataset(self.task.dataset)
            if len(dataset.std) != 1:
                raise ConfigError(f"CompareConfig.defenses[{spec.name}]: max_psnr on the {len(dataset.std)}-channel "
                                  f"dataset {self.task.dataset!r} needs pixel_mean and pixel_std given per channel "
                                  "in code (the run config carries scalars)")
            values.setdefault("pixel_mean", float(dataset.mean[0]))
            values.setdefault("pixel_std", float(dataset.std[0]))
        return values

    def fingerprint(self, spec: DefenseSpec) -> str:
        """A hash of everything that defines one defense's run (a changed config is rerun)."""
        return hashlib.sha256(json.dumps(self.run_config(spec), sort_keys=True).encode()).hexdigest()[:16]


def load_config(path: str | Path) -> CompareConfig:
    """Read and validate a comparison TOML file; errors name the file and the field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    try:
        return CompareConfig(**data)
    except ConfigError as error:
        raise ConfigError(f"{path}:\n{error}") from None


def run_config_string(config: dict[str, Any]) -> str:
    """The ``--run-config`` argument of ``flwr run`` for a run-config mapping."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in config.items())
