"""Generate the reference parts of the docs from the code, so that they cannot drift from it.

    python docs/generate_reference.py          # rewrite docs/configuration.md's tables and docs/api.md
    python docs/generate_reference.py --check  # exit 1 if either file is out of date (CI)

``docs/configuration.md``: the text between ``<!-- generated:begin NAME -->`` and
``<!-- generated:end NAME -->`` is replaced by a field table built from the pydantic model NAME
(type, default, constraint, description), or — for ``error-example`` — by the message that
``load_config`` really raises for a bad file. Everything outside the markers is hand-written.

``docs/api.md``: written whole, from the signatures (``inspect``) and docstrings of the public API
listed in ``API`` below. A missing docstring is shown as such, not invented.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import re
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

# ---- helpers ------------------------------------------------------------------------------------


def md(text: str) -> str:
    """reST inline literals (``x``) as Markdown code (`x`)."""
    return text.replace("``", "`")


def cell(text: str) -> str:
    return md(text).replace("|", "\\|").replace("\n", " ")


def type_name(annotation: Any) -> str:
    """A short, readable rendering of a field's type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a!r}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple of {type_name(args[0])}"
        return "(" + ", ".join(type_name(a) for a in args) + ")"
    if origin in (list, tuple, set):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {type_name(args[0])} → {' or '.join(type_name(a) for a in typing.get_args(args[1])) or type_name(args[1])}"
    if annotation is type(None):
        return "none"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return f"`[{annotation.__name__}]`"
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def constraints(info: Any) -> str:
    parts = []
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    for item in info.metadata:
        for attr, symbol in symbols.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value:g}" if isinstance(value, float) else f"{symbol} {value}")
        if getattr(item, "min_length", None) is not None:
            parts.append(f"at least {item.min_length} entry" + ("" if item.min_length == 1 else "s"))
        if getattr(item, "pattern", None) is not None:
            parts.append(f"matches `{item.pattern}`")
    return ", ".join(parts)


def default_text(info: Any) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
        if isinstance(value, BaseModel):
            return "all defaults"
        return f"`{value!r}`"
    if info.default is PydanticUndefined:
        return "**required**"
    value = info.default
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value!r}`"


#: Meanings for fields whose model gives no ``description`` (a description in the code wins).
FALLBACK_MEANINGS = {
    "CompareConfig.name": "title of the report and of the summary printed at the end",
    "CompareConfig.seed": "seeds every run's initial model, partitions, batch order and attack starts "
                          "(not the guard's noise)",
    "CompareConfig.round_timeout": "seconds the server waits for one round's replies",
    "CompareConfig.task": "the `[task]` table",
    "CompareConfig.attack": "the `[attack]` table",
    "CompareConfig.defenses": "one `[[defenses]]` table per defense, one Flower simulation each",
    "TaskSection.dataset": "the image dataset (offline: mnist5k, lfw-faces, digits)",
    "TaskSection.model": "a `flguard.models` name: lenet, cnn2_v1 … cnn4_v2, mlp, linear, resnet18",
    "TaskSection.init": "initialisation of the shared initial model",
    "TaskSection.partitioning": "how the samples are split among the clients",
    "TaskSection.rounds": "FedAvg rounds",
    "TaskSection.batch_size": "samples per local step",
    "TaskSection.lr": "learning rate of the clients' plain SGD",
    "AttackSection.method": "the inversion attack the malicious server runs",
    "AttackSection.iterations": "attack iterations per attacked upload",
    "AttackSection.restarts": "random starts optimised together; the best by matching loss wins",
    "AttackSection.labels": "recover: the attack recovers the labels; true: the server is given them (simulation only)",
    "AttackSection.hyperparameters": "extra attack hyperparameters, passed as run-config keys `attack-hp-<name>`",
    "DefenseSpec.defense": "a guard defense, or `localdp` for Flower's LocalDpMod",
    "GuardConfig.defense": "the perturbation: calibrated `gaussian`, `eigen`-aware, or a baseline",
    "GuardConfig.eps_mode": "relative: ε = eps·λmax per sample; absolute: ε = eps",
    "GuardConfig.on_unmet": "when the floor cannot be met: drop (nothing leaves), max-noise (full-budget "
                            "isotropic noise), send (the unguarded gradient)",
}
#: Fields that fell back to FALLBACK_MEANINGS (reported, so that their descriptions can move into the code).
USED_FALLBACKS: set[str] = set()


def meaning(model: type[BaseModel], name: str, info: Any) -> str:
    if info.description:
        return info.description
    key = f"{model.__name__}.{name}"
    if model.__name__.endswith("GuardConfig"):  # the per-defense models share the base's fallbacks
        key = f"GuardConfig.{name}"
    if key in FALLBACK_MEANINGS:
        USED_FALLBACKS.add(key)
        return FALLBACK_MEANINGS[key]
    return ""


def field_table(model: type[BaseModel], only: tuple[str, ...] | None = None) -> str:
    rows = ["| field | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, info in model.model_fields.items():
        if only is not None and name not in only:
            continue
        rows.append(f"| `{name}` | {type_name(info.annotation)} | {default_text(info)} | "
                    f"{constraints(info) or '—'} | {cell(meaning(model, name, info))} |")
    return "\n".join(rows)


def guard_field_table(names: tuple[str, ...]) -> str:
    """A field table of GuardConfig fields with the defenses that take each one (from the models)."""
    from flguard.guard.config import DEFENSES, defense_fields, guard_config_model

    rows = ["| field | defenses | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        takers = [d for d in DEFENSES if name in defense_fields(d)]
        model = guard_config_model(takers[0])
        info = model.model_fields[name]
        who = "all" if len(takers) == len(DEFENSES) else ", ".join(f"`{d}`" for d in takers)
        rows.append(f"| `{name}` | {who} | {type_name(info.annotation)} | {default_text(info)} | "
                    f"{constraints(info) or '—'} | {cell(meaning(model, name, info))} |")
    return "\n".join(rows)


def defense_keys_table() -> str:
    """Which keys each ``defense`` of a ``[[defenses]]`` table takes (``compare_fields``)."""
    from flguard.compare.config import compare_fields
    from flguard.guard.config import DEFENSES, GuardConfig

    common = [k for k in compare_fields("gaussian") if k in GuardConfig.model_fields]
    rows = ["| `defense` | keys it may set besides `name` and `defense` |", "| --- | --- |"]
    for defense in DEFENSES:
        keys, own = compare_fields(defense), [f"`{k}`" for k in compare_fields(defense) if k not in common]
        text = ("none (no guard runs)" if not keys else ", ".join(own) + " (Flower's LocalDpMod)"
                if defense == "localdp" else "the common guard fields" + (" and " + ", ".join(own) if own else ""))
        rows.append(f"| `{defense}` | {text} |")
    return "\n".join(rows) + "\n\nThe common guard fields: " + ", ".join(f"`{k}`" for k in common) + "."


def error_example() -> str:
    """What ``flguard compare`` prints for a config with two mistakes (produced, not typed)."""
    from flguard.compare.config import load_config
    from flguard.config import ConfigError

    bad = ('[task]\nrounds = 0\n\n[[defenses]]\nname = "guarded"\ndefense = "gaussian"\n'
           'min_rmse = 1.0\nepsilon = 5.0\n')
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad.toml"
        path.write_text(bad, encoding="utf-8")
        try:
            load_config(path)
        except ConfigError as error:
            message = str(error).replace(str(path), "bad.toml")
        else:  # pragma: no cover - the example must fail
            raise RuntimeError("the error example validated")
    return ("```toml\n# bad.toml\n" + bad + "```\n\n```text\n$ flguard compare bad.toml\nconfiguration error\n"
            + message + "\n```")


def generated_blocks() -> dict[str, str]:
    from flguard.compare.config import (NOT_IN_COMPARISONS, AttackSection, CompareConfig, DefenseSpec, TaskSection,
                                        compare_fields)
    from flguard.simulation.localdp import LocalDpConfig
    from flguard.guard.config import DEFENSES

    in_defenses = tuple(dict.fromkeys(n for d in DEFENSES if d != "localdp" for n in compare_fields(d)))
    return {
        "CompareConfig": field_table(CompareConfig),
        "TaskSection": field_table(TaskSection),
        "AttackSection": field_table(AttackSection),
        "DefenseSpec": field_table(DefenseSpec, ("name", "defense")),
        "defense-keys": defense_keys_table(),
        "GuardConfig-in-defenses": guard_field_table(in_defenses),
        "GuardConfig-not-in-defenses": ", ".join(f"`{name}`" for name in NOT_IN_COMPARISONS) + ".",
        "LocalDpConfig": field_table(LocalDpConfig),
        "error-example": error_example(),
    }


def fill_markers(text: str, blocks: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in blocks:
            raise KeyError(f"docs/configuration.md: no generator for marker {name!r}")
        return f"<!-- generated:begin {name} -->\n{blocks[name]}\n<!-- generated:end {name} -->"

    pattern = re.compile(r"<!-- generated:begin (\S+) -->.*?<!-- generated:end \1 -->", re.S)
    found = set(pattern.findall(text))
    missing = set(blocks) - found
    if missing:
        raise KeyError(f"docs/configuration.md lacks markers for {', '.join(sorted(missing))}")
    return pattern.sub(replace, text)


# ---- API reference --------------------------------------------------------------------------------

#: (module, heading, names): documented in this order.
API: list[tuple[str, str, list[str]]] = [
    ("flguard", "The guard", ["make_guarded", "GuardConfig", "Guard", "GuardReport", "GuardOutput", "GuardFailure",
                              "check_model", "fix_model", "UnsupportedModel"]),
    ("flguard.guard.config", "One config per defense", [
        "GaussianGuardConfig", "EigenGuardConfig", "NoneGuardConfig", "FixedGaussianGuardConfig", "PruningGuardConfig",
        "LocalDpGuardConfig", "ThresholdGuardConfig", "LocalDpConfig", "AnyGuardConfig", "parse_guard_config",
        "guard_config_model", "defense_fields", "all_guard_fields"]),
    ("flguard.guard.training", "Guarding an unchanged training loop", ["GuardedOptimizer", "GuardedCriterion",
                                                                       "GuardMisuse"]),
    ("flguard.guard.clipping", "The clipping level", ["clip_level", "AdaptiveClip"]),
    ("flguard.risk", "Risk metrics", ["assess", "RiskReport", "architecture_index", "JacobianOperator", "RegularisedK",
                                     "lanczos", "conjugate_gradient"]),
    ("flguard.attacks", "Attacks", ["reconstruct", "Reconstruction", "hyperparameters_of", "methods",
                                    "recover_labels"]),
    ("flguard.flower", "Flower integration, client side", [
        "guard_mod", "guard_mod_from_run_config", "guard_run_config", "guard_config_from_run_config", "weaker_fields", "client_minimum", "guard_step", "round_metrics",
        "GuardDropped", "GuardedNumPyClient", "UnguardedUpdate"]),
    ("flguard.flower.round_check", "Refusing a round whose parameters are out of scale", [
        "suspicious_round", "tensor_scales", "parameter_jumps", "outlier_tensors"]),
    ("flguard.simulation", "The simulated federation's true-batch channel (never on a client's path)", [
        "record_batch", "TruthChannelRefused", "in_simulation_runtime"]),
    ("flguard.server", "The malicious server", [
        "MaliciousServer", "AttackSpec", "UploadAttack", "ClientUpdate", "delta_to_gradient",
        "upload_attack_from_config", "every_client", "first_clients", "honest_targets", "AttackRunner",
        "CapturedUpload", "Scorer", "score_batch", "ResultWriter", "save_grid", "TruthReader", "TrueBatch", "Fishing",
        "fish_class", "fish_feature", "count_targets", "attack_fished"]),
    ("flguard.apps", "The apps every run uses", ["make_client_app", "make_server_app", "config_mods",
                                                 "run_server"]),
    ("flguard.simulation.localdp", "Flower's LocalDpMod, measured", ["localdp_mod_from_config", "measured_local_dp",
                                                                     "localdp_run_config"]),
    ("flguard.compare", "Comparisons", ["CompareConfig", "TaskSection", "AttackSection", "DefenseSpec",
                                        "compare_fields", "load_config", "run_config_string"]),
    ("flguard.compare.runner", "Running a comparison", ["run_comparison", "run_defense", "is_finished",
                                                        "RunOutcome"]),
    ("flguard.compare.tables", "Tables", ["build_tables", "defense_rows", "summary_row", "tau_of"]),
    ("flguard.compare.classes", "Per-class risk", ["class_risk", "write_class_risk"]),
    ("flguard.compare.report", "The report", ["write_report"]),
    ("flguard.compare.figures", "Figures", ["build_figures"]),
]

#: Methods worth listing for these classes (others are Flower's Strategy interface or private).
METHODS = {
    "Guard": ["protect"],
    "GuardedOptimizer": ["step"],
    "MaliciousServer": ["start", "flush", "close", "attack_upload"],
    "AttackRunner": ["specs", "submit", "run", "flush", "close", "attack_inputs"],
    "Scorer": ["score"],
    "ResultWriter": ["save", "append"],
    "TruthReader": ["read"],
    "CompareConfig": ["defense", "run_config", "fingerprint"],
}


def _resolve(module_name: str, name: str) -> Any:
    import importlib

    module = importlib.import_module(module_name)
    if hasattr(module, name):
        return getattr(module, name)
    for submodule in ("config",):  # flguard.compare re-exports only a few names
        candidate = importlib.import_module(f"{module_name}.{submodule}")
        if hasattr(candidate, name):
            return getattr(candidate, name)
    raise AttributeError(f"{module_name}.{name}")


def _value(value: Any) -> str:
    if inspect.isfunction(value) or inspect.isclass(value):
        return value.__name__
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    text = repr(value)
    return re.sub(r"<function (\S+) at 0x[0-9a-f]+>", r"\1", text)


def _annotation(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation).replace("typing.", "")


def signature(obj: Any, name: str) -> str:
    """``name(params) -> return`` with string annotations unquoted, one parameter per line when long."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    sig = inspect.signature(target)
    params = []
    star_done = False
    for param in sig.parameters.values():
        if param.name == "self":
            continue
        if param.kind is param.KEYWORD_ONLY and not star_done:
            params.append("*")
            star_done = True
        prefix = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(param.kind, "")
        if param.kind is param.VAR_POSITIONAL:
            star_done = True
        text = prefix + param.name
        annotation = _annotation(param.annotation)
        if annotation:
            text += f": {annotation}"
        if param.default is not param.empty:
            text += f" = {_value(param.default)}" if annotation else f"={_value(param.default)}"
        params.append(text)
    returns = "" if inspect.isclass(obj) else _annotation(sig.return_annotation)
    arrow = f" -> {returns}" if returns else ""
    one_line = f"{name}({', '.join(params)}){arrow}"
    if len(one_line) <= 100:
        return one_line
    return f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){arrow}"


def docstring(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    return md(doc) if doc else "*(no docstring)*"


def document(module_name: str, name: str) -> str:
    obj = _resolve(module_name, name)
    kind = "class" if inspect.isclass(obj) else "function"
    parts = [f"### `{module_name}.{name}`", ""]
    if inspect.isclass(obj) and issubclass(obj, BaseModel):
        parts += [f"{kind}, a validated config (pydantic; unknown fields and bad values raise `ConfigError`).", "",
                  docstring(obj), "", field_table(obj)]
    elif inspect.isclass(obj) and issubclass(obj, BaseException):
        parts += ["exception", "", docstring(obj)]
    else:
        parts += ["```python", signature(obj, name), "```", "", docstring(obj)]
    for method_name in METHODS.get(name, []):
        method = getattr(obj, method_name)
        parts += ["", f"#### `{name}.{method_name}`", "", "```python", signature(method, method_name), "```", "",
                  docstring(method)]
    return "\n".join(parts)


def module_intro(module_name: str) -> str:
    import importlib

    doc = inspect.getdoc(importlib.import_module(module_name)) or ""
    return md(doc.split("\n\n")[0]) if doc else ""


def api_page() -> str:
    lines = [
        "# API reference",
        "",
        "This page lists flguard's public Python API: each name's signature and its docstring, grouped by",
        "module. It is generated from the code by `python docs/generate_reference.py` (do not edit it by",
        "hand; `--check` fails when it is stale). For what the numbers mean and how the pieces fit, read",
        "the chapters linked from [the front page](index.md); the command-line interface is `flguard --help`.",
        "",
        "## Contents",
        "",
    ]
    for module_name, heading, _ in API:
        anchor = re.sub(r"[^a-z0-9 -]", "", f"{module_name} — {heading}".lower()).replace(" ", "-")
        lines.append(f"- [`{module_name}` — {heading}](#{anchor})")
    for module_name, heading, names in API:
        lines += ["", f"## `{module_name}` — {heading}", ""]
        intro = module_intro(module_name)
        if intro:
            lines += [intro, ""]
        for name in names:
            lines += [document(module_name, name), ""]
    return "\n".join(lines).rstrip() + "\n"


# ---- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated file is out of date")
    args = parser.parse_args(argv)
    configuration = DOCS / "configuration.md"
    outputs = {
        configuration: fill_markers(configuration.read_text(encoding="utf-8"), generated_blocks()),
        DOCS / "api.md": api_page(),
    }
    stale = [path for path, text in outputs.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python docs/generate_reference.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(outputs[path], encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    if USED_FALLBACKS:
        print("fields without a description in the code (meaning taken from FALLBACK_MEANINGS): "
              + ", ".join(sorted(USED_FALLBACKS)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
