"""One config per defense: each takes its own fields, rejects another defense's by name, survives
pickling, copies and the run-config / comparison round trips; "localdp" has one set of names and
one noise formula."""

from __future__ import annotations

import math
import pickle
import tomllib

import pytest
import torch
from pydantic import TypeAdapter
from torch import nn

from flguard import Guard, GuardConfig
from flguard.compare.config import CompareConfig, compare_fields
from flguard.config import ConfigError
from flguard.defenses.baselines import gaussian_mechanism_std
from flguard.simulation.localdp import LocalDpConfig, localdp_run_config
from flguard.flower.guard_mod import guard_config_from_run_config, guard_run_config, prefixed_config
from flguard.guard.config import (DEFENSES, DEFENSE_MODELS, AnyGuardConfig, EigenGuardConfig, ThresholdGuardConfig,
                                  all_guard_fields, defense_fields, parse_guard_config)
from conftest import SIMULATIONS

#: Each defense's own fields, at values other than their defaults (localdp's are required).
OWN = {
    "none": {},
    "gaussian": {"input_bounds": "batch"},
    "rowspace": {"input_bounds": (-2.0, 3.0)},
    "resolvent": {"input_bounds": (-1.5, 2.5)},
    "eigen": {"input_bounds": (-1.0, 2.0), "subspace_size": 4, "krylov_steps": 8, "gaussian_floor": 0.5},
    "auto": {"input_bounds": "batch", "subspace_size": 8, "krylov_steps": 16, "fallback": "resolvent"},
    "fixed-gaussian": {"sigma": 0.3},
    "pruning": {"keep_ratio": 0.25},
    "localdp": {"clipping_norm": 5.0, "sensitivity": 2.0, "epsilon": 700.0, "delta": 1e-6},
}
COMMON = {"min_rmse": 0.2, "eps": 0.02, "rtol": 1e-2, "seed": 3, "clip_per_sample": 1.0, "max_rel_noise": 40.0}
FOREIGN = [(defense, name) for defense in DEFENSES for name in all_guard_fields()
           if name != "defense" and name not in defense_fields(defense)]
#: A valid value for every field (its default, or OWN's), so that a rejection can only be about the defense.
VALUE = {**{name: info.default for model in DEFENSE_MODELS.values() for name, info in model.model_fields.items()},
         **{name: value for fields in OWN.values() for name, value in fields.items()}}


@pytest.mark.parametrize("defense", DEFENSES)
def test_each_defense_takes_its_own_fields(defense):
    config = GuardConfig(defense=defense, **COMMON, **OWN[defense])
    assert type(config) is DEFENSE_MODELS[defense] and isinstance(config, GuardConfig)
    assert config.defense == defense and config.floor == 0.2
    assert {name: getattr(config, name) for name in OWN[defense]} == OWN[defense]
    assert isinstance(config, ThresholdGuardConfig) == (defense in ("auto", "gaussian", "rowspace", "resolvent", "eigen"))


def test_the_default_is_auto_and_subclasses_build_directly():
    assert GuardConfig().defense == "auto" and GuardConfig().bounds is None
    assert GuardConfig().subspace_size == GuardConfig(defense="eigen").subspace_size  # auto carries eigen's fields (fallback="eigen")
    assert EigenGuardConfig(subspace_size=4) == GuardConfig(defense="eigen", subspace_size=4)


@pytest.mark.parametrize("defense, field", FOREIGN)
def test_a_field_of_another_defense_is_an_error_naming_it(defense, field):
    with pytest.raises(ConfigError) as error:
        GuardConfig(defense=defense, **{field: VALUE[field]})
    message = str(error.value)
    assert f"{field} does not apply to defense={defense!r}" in message, message
    assert "unknown field" not in message


def test_eigen_with_sigma_says_whose_field_it_is():
    with pytest.raises(ConfigError, match=r"sigma does not apply to defense='eigen' \(it is a field of "
                                          r"'fixed-gaussian'\)"):
        GuardConfig(defense="eigen", sigma=0.1)
    with pytest.raises(ConfigError, match=r"AutoGuardConfig.sigmaa: .*unknown field"):  # a typo stays a typo
        GuardConfig(sigmaa=0.1)


@pytest.mark.parametrize("old, new", [("clip_norm", "clipping_norm"), ("dp_epsilon", "epsilon"),
                                      ("dp_delta", "delta")])
def test_old_localdp_names_are_errors_naming_the_new_one(old, new):
    for build in (lambda: GuardConfig(defense="localdp", **OWN["localdp"], **{old: 1.0}),
                  lambda: LocalDpConfig(**OWN["localdp"], **{old: 1.0}),
                  lambda: GuardConfig(defense="gaussian", **{old: 1.0})):
        with pytest.raises(ConfigError, match=f"{old} is now {new}"):
            build()


def test_the_noise_std_is_the_gaussian_mechanism_closed_form():
    # s = Δ·√(2 ln(1.25/δ))/ε; δ = 1.25·e⁻² gives √(2·2) = 2, δ = 1.25·e⁻⁸ gives √16 = 4.
    assert gaussian_mechanism_std(3.0, 2.0, 1.25 * math.exp(-2)) == pytest.approx(3.0, rel=1e-12)
    assert gaussian_mechanism_std(1.0, 4.0, 1.25 * math.exp(-8)) == pytest.approx(1.0, rel=1e-12)
    # the demo's LocalDpMod: 5·√(2 ln 125000)/700 = 5·4.84481/700 ≈ 0.0346058
    assert LocalDpConfig(clipping_norm=5.0, sensitivity=5.0, epsilon=700.0).std == pytest.approx(0.0346058, rel=1e-5)
    guard = GuardConfig(defense="localdp", clipping_norm=9.0, sensitivity=3.0, epsilon=2.0, delta=1.25 * math.exp(-2))
    assert guard.std == pytest.approx(3.0, rel=1e-12)


def test_the_guards_localdp_clips_to_clipping_norm_and_draws_that_std():
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 3).double(), torch.randn(2, 4, dtype=torch.float64), torch.tensor([0, 1])
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(nn.functional.cross_entropy(model(x), y),
                                                               list(model.parameters()))])
    config = GuardConfig(defense="localdp", clipping_norm=0.5 * float(g.norm()), sensitivity=3.0, epsilon=2.0,
                         delta=1.25 * math.exp(-2), seed=0)
    out = Guard(config).protect(model, x, y, g)
    assert out.report.details["dp_std"] == pytest.approx(3.0, rel=1e-12)
    clean = Guard(config.model_copy(update={"epsilon": 1e12})).protect(model, x, y, g).gradient  # ~no noise
    torch.testing.assert_close(clean, 0.5 * g, rtol=1e-6, atol=1e-9)


def test_pickle_copy_dump_and_the_discriminated_union():
    config = GuardConfig(defense="eigen", min_rmse=0.1, subspace_size=4)
    assert pickle.loads(pickle.dumps(config)) == config
    assert type(config.model_copy()) is EigenGuardConfig and config.model_copy() == config
    changed = config.model_copy(update={"min_rmse": 0.3})
    assert type(changed) is EigenGuardConfig and changed.min_rmse == 0.3 and changed.subspace_size == 4
    with pytest.raises(ConfigError, match="subspace_size does not apply to defense='gaussian'"):
        config.model_copy(update={"defense": "gaussian"})  # eigen's own field set here
    with pytest.raises(ConfigError, match="sigma does not apply"):
        config.model_copy(update={"sigma": 0.1})
    assert parse_guard_config(config.model_dump()) == config
    union = TypeAdapter(AnyGuardConfig).validate_python({"defense": "pruning", "keep_ratio": 0.3})
    assert type(union) is DEFENSE_MODELS["pruning"] and union.keep_ratio == 0.3


@pytest.mark.parametrize("defense", DEFENSES)
def test_run_config_round_trip(defense):
    own = {k: v for k, v in OWN[defense].items() if not isinstance(v, tuple)}  # run configs carry scalars
    config = GuardConfig(defense=defense, **COMMON, **own)
    keys = guard_run_config(config)
    assert set(keys) == {f"guard-{name.replace('_', '-')}" for name in all_guard_fields()}
    assert guard_config_from_run_config(keys) == config
    assert guard_config_from_run_config(guard_run_config(None)) is None


def test_a_run_config_key_of_another_defense_names_it():
    assert guard_config_from_run_config({"guard-defense": "eigen", "guard-sigma": ""}).defense == "eigen"
    with pytest.raises(ConfigError, match="sigma does not apply to defense='eigen'"):
        guard_config_from_run_config({"guard-defense": "eigen", "guard-sigma": 0.1})


def test_the_flower_app_declares_exactly_the_models_keys():
    declared = tomllib.loads((SIMULATIONS / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert {k for k in declared if k.startswith("guard-")} == set(guard_run_config(None))
    assert {k for k in declared if k.startswith("localdp-")} == set(localdp_run_config(None))


TOML = """
[task]
dataset = "digits"
model = "mlp"
[[defenses]]
name = "none"
defense = "none"
[[defenses]]
name = "dp"
defense = "localdp"
clipping_norm = 10.0
sensitivity = 1.0
epsilon = 20.0
[[defenses]]
name = "eigen"
defense = "eigen"
min_rmse = 0.2
input_bounds = "batch"
krylov_steps = 8
[[defenses]]
name = "pruning"
defense = "pruning"
keep_ratio = 0.3
seed = 1
"""


def test_compare_config_round_trip():
    data = tomllib.loads(TOML)
    config = CompareConfig(**data)
    for table, spec in zip(data["defenses"], config.defenses):
        run = config.run_config(spec)
        values = {k: v for k, v in table.items() if k not in ("name", "defense")}
        guard, localdp = guard_config_from_run_config(run), prefixed_config(run, "localdp-")
        if spec.defense in ("none", "localdp"):
            assert guard is None and run["guard-defense"] == ""
        else:
            assert guard == GuardConfig(defense=spec.defense, **values) and not localdp
        if spec.defense == "localdp":
            assert LocalDpConfig(**localdp) == LocalDpConfig(**values)
        assert set(values) <= set(compare_fields(spec.defense))


@pytest.mark.parametrize("defense, line, field", [
    ("eigen", "sigma = 0.1", "sigma"), ("pruning", 'input_bounds = "batch"', "input_bounds"),
    ("eigen", "epsilon = 1.0", "epsilon"), ("none", "min_rmse = 0.1", "min_rmse"),
    ("localdp", "min_rmse = 0.1", "min_rmse"), ("eigen", "acknowledge_unguarded = true", "acknowledge_unguarded"),
    ("localdp", "clip_norm = 1.0", "clip_norm"),
])
def test_compare_rejects_a_key_of_another_defense_by_name(defense, line, field):
    text = TOML.replace(f'defense = "{defense}"', f'defense = "{defense}"\n{line}', 1)
    with pytest.raises(ConfigError, match=field):
        CompareConfig(**tomllib.loads(text))
