"""``GuardConfig``: everything a user sets on the leakage guard, one pydantic model per defense.

``GuardConfig(defense=..., **fields)`` returns the model of that defense (``GaussianGuardConfig``,
``EigenGuardConfig``, …, all subclasses of ``GuardConfig``), so a field that does not apply to the
chosen defense — ``sigma`` with ``eigen``, ``keep_ratio`` with ``gaussian`` — is an error that names
it instead of being silently ignored. Which fields a defense takes follows what ``flguard.guard``
reads for it:

* every defense (``GuardConfig``, the base): the floor τ (``min_rmse`` or ``max_psnr`` with
  ``pixel_mean``/``pixel_std``), the measurement's ``eps``/``eps_mode``/``rtol``, ``clip_per_sample``,
  the failure policy ``on_unmet``/``acknowledge_unguarded``/``max_rel_noise`` and ``seed``: the guard
  measures every defense's noise against τ (a baseline is sent anyway and reported with
  ``guard_met``), clips for every defense, and applies ``on_unmet`` to any defense that fails;
* ``auto`` (the default), ``gaussian``, ``rowspace`` and ``eigen`` (``ThresholdGuardConfig``): ``input_bounds``,
  the box in which the floor they *promise* is verified;
* ``eigen`` and ``auto`` (which falls back on eigen): ``subspace_size``, ``krylov_steps``, ``gaussian_floor``; ``fixed-gaussian``: ``sigma``;
  ``pruning``: ``keep_ratio``; ``localdp``: Flower's LocalDpMod arguments ``clipping_norm``,
  ``sensitivity``, ``epsilon``, ``delta`` (``LocalDpConfig``, shared with ``flguard.simulation.localdp``).

``AnyGuardConfig`` is the same choice as a pydantic discriminated union (for fields of other
models), ``parse_guard_config`` builds one from a mapping (TOML, run config), and
``defense_fields`` lists a defense's fields — the compare config and the run-config keys are derived
from it, so a field declared here appears everywhere.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import Field, model_validator

from flguard.config import ConfigError, StrictModel
from flguard.guard.defaults import (  # noqa: F401  (re-exported: the config's public names)
    DEFENSES, DEFAULT_DEFENSE, THRESHOLD_DEFENSES, DEFAULT_MAX_PSNR, DEFAULT_MIN_RMSE, DEFAULT_MAX_PRODUCTS,
    DEFAULT_CLIP, DEFAULT_CLIP_RETENTION, DEFAULT_FALLBACK, DEFAULT_MAX_REL_NOISE, DEFAULT_MAX_EXCLUDED,
    DEFAULT_RTOL, NONE_STRINGS,
)
from flguard.guard.localdp_config import (  # noqa: F401  (LocalDpConfig, RENAMED_FIELDS re-exported)
    RENAMED_FIELDS, LocalDpConfig, _no_old_names,
)
from flguard.risk.defaults import DEFAULT_EPS_RELATIVE


Channels = float | tuple[float, ...]


def _per_channel(value: Channels) -> tuple[float, ...]:
    return value if isinstance(value, tuple) else (value,)


def _known_fields(model: type, data: Any) -> Any:
    """Before validation: a renamed field, or a field of another defense, is an error naming it (a
    plain typo is left to ``extra="forbid"``: "unknown field (check its spelling)")."""
    if not isinstance(data, Mapping):
        return data
    _no_old_names(data)
    defense = data.get("defense", model.model_fields["defense"].default)
    foreign = {}
    for name in data:
        if name in model.model_fields:
            continue
        owners = [d for d, m in DEFENSE_MODELS.items() if name in m.model_fields]
        if owners:
            foreign[name] = owners
    if foreign:
        own = [f for f in model.model_fields if f not in GuardConfig.model_fields]
        raise ValueError(
            "; ".join(f"{name} does not apply to defense={defense!r} (it is a field of {', '.join(map(repr, owners))})"
                      for name, owners in foreign.items())
            + f"; defense={defense!r} takes the common fields"
            + (f" and {', '.join(own)}" if own else " only"))
    return data


class GuardConfig(StrictModel):
    """Guard settings common to every defense; ``GuardConfig(defense=..., ...)`` returns the
    defense's own subclass (``defense`` defaults to ``"auto"``: the calibrated Gaussian, aimed (resolvent)
    noise on a step where the Gaussian would exceed the budget).

    ``min_rmse`` (τ) is the floor on each sample's predicted recovery RMSE, in the model's input
    units: for inputs normalised as (pixel − mean)/std, a pixel-space RMSE r is ``r / std``. The
    threshold defenses (``gaussian``, ``eigen``) scale their noise to meet it; the baselines are
    measured against it (``guard_met``) and sent anyway.

    ``max_psnr`` (dB, pixels in [0, 1]) states the floor in pixel space instead, with the inputs'
    normalisation ``pixel_mean``/``pixel_std`` (scalar or per channel): no sample's predicted
    reconstruction may be closer than this PSNR, i.e. its pixel RMSE must be ≥ 10^(−max_psnr/20).
    A pixel error is the input error times its channel's std, so the pixel RMSE is at least
    min(std) × the input RMSE, and τ = 10^(−max_psnr/20) / min(std) in input units guarantees the
    pixel floor on every channel mix (``floor``). Give ``min_rmse`` or ``max_psnr``, not both; with
    neither, the floor is DEFAULT_MAX_PSNR (15 dB): as ``max_psnr`` when ``pixel_mean`` and
    ``pixel_std`` are given, else as τ = DEFAULT_MIN_RMSE input units (15 dB for raw [0, 1] pixels).

    Why ``__new__`` dispatches: ``GuardConfig(...)`` is the public call in user code, run configs
    and TOML files, and it must keep working while each defense validates only its own fields.
    Python calls the returned subclass's (pydantic) ``__init__``, since it is an instance of
    ``GuardConfig``. For the same reason ``model_copy(update=...)`` validates (pydantic's does not):
    an update may change ``defense`` (the copy is then the new defense's model) and a field the
    defense does not take is an error, as in the constructor.
    """

    defense: Literal["none", "auto", "gaussian", "rowspace", "resolvent", "eigen", "fixed-gaussian", "pruning",
                     "localdp"] = DEFAULT_DEFENSE
    min_rmse: float | None = Field(None, ge=0.0, description="τ: per-sample floor on predicted RMSE (model-input "
                                   f"units); None: from max_psnr, else {DEFAULT_MAX_PSNR:g} dB ({DEFAULT_MIN_RMSE:.3g} "
                                   "for raw pixels)")
    max_psnr: float | None = Field(None, description="floor in pixel PSNR (dB, pixels in [0, 1]): no predicted "
                                   "reconstruction closer; needs pixel_mean and pixel_std; excludes min_rmse")
    pixel_mean: Channels | None = Field(None, description="max_psnr: the inputs' normalisation mean (pixels in [0, 1])")
    pixel_std: Channels | None = Field(None, description="max_psnr: the inputs' normalisation std, scalar or per channel")
    eps_mode: Literal["relative", "absolute"] = "relative"
    eps: float = Field(DEFAULT_EPS_RELATIVE, ge=0.0, description="Tikhonov ε: × λmax per sample, or absolute")
    max_rel_noise: float = Field(10.0, gt=0.0, description="noise budget: ‖noise‖ / ‖gradient‖ (or / C with "
                                 "clip_per_sample) at most this; gaussian, eigen: 40 by default")
    clip_per_sample: float | Literal["median", "quantile", "retention", "auto"] | None = Field(
        None, description="C: clip each sample's gradient to norm C before the floor (the guard measures the "
        "clipped map); max_rel_noise is then relative to C. 'median': C = the median of the batch's per-sample "
        "gradient norms, each step (flguard.guard.clipping.clip_level); 'quantile': their clip_quantile quantile; "
        "'retention': the smallest from the median up that keeps clip_retention of the gradient's length along it; "
        "'auto': 'retention' while the noise sent keeps the parameters' moves small and does not undo the steps' "
        "progress (needs the step size), else the median, or a fraction of it where the median's noise does harm "
        "(flguard.guard.clipping.AdaptiveClip); None: no clipping, the budget relative to ‖gradient‖; "
        "auto, gaussian, eigen: 'auto' by default")
    clip_quantile: float = Field(0.5, gt=0.0, le=1.0, description="with clip_per_sample='quantile': C = this "
                                 "quantile of the batch's per-sample gradient norms (the lower one: a sample's "
                                 "norm); 0.5 is 'median', 1 clips no sample")
    clip_retention: float = Field(DEFAULT_CLIP_RETENTION, gt=0.0, le=1.0, description="with clip_per_sample="
                                  "'retention': the share of the batch gradient's length along itself that the "
                                  "clipped sum keeps at least")
    on_unmet: Literal["drop", "max-noise", "send"] = "drop"
    acknowledge_unguarded: bool = Field(False, description="required with on_unmet='send'")
    seed: int | None = Field(None, description="None: noise from OS entropy; an int only for tests/benchmarks")
    rtol: float = Field(1e-3, gt=0.0, lt=0.1, description="solver tolerance (the floor is aimed at "
                        "τ(1 + rtol) with each sample's solver error bound taken off); gaussian, eigen: 3e-2 by default")
    max_products: float | None = Field(DEFAULT_MAX_PRODUCTS, gt=0.0, description="per step: at most this many "
                                       "Jacobian products per sample (J or Jᵀ), else the step is withheld naming "
                                       "the limit; None: no limit")
    max_seconds: float | None = Field(None, gt=0.0, description="per step: at most this many seconds of "
                                      "measuring, else the step is withheld naming the limit; None: no limit")
    max_param_jump: float | None = Field(None, gt=0.0, description="per round (guard_mod): refuse a train round "
                                         "up front, replying 'suspicious parameters', when a tensor the server sent "
                                         "is over 10× this × the model's median tensor RMS, or changed scale by more "
                                         "than this × since the client's last two rounds (flguard.flower.round_check; "
                                         "class fishing's biases ~1e4×, honest models ≤ 8.4×, honest rounds < 0.1); "
                                         "None: no check")

    def __new__(cls, *args: Any, **data: Any) -> "GuardConfig":
        if cls in (GuardConfig, ThresholdGuardConfig):  # pick the defense's model; an unknown or unfitting
            defense = data.get("defense", DEFAULT_DEFENSE)  # defense stays here and fails in validation
            model = DEFENSE_MODELS.get(defense) if isinstance(defense, str) else None
            cls = model if model is not None and issubclass(model, cls) else cls
        return super().__new__(cls)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> "GuardConfig":
        """A copy; with ``update``, a new config validated from the fields set here plus ``update``."""
        if not update:
            return super().model_copy(deep=deep)
        return GuardConfig(**{**self.model_dump(exclude_unset=True), "defense": self.defense, **update})

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "GuardConfig":
        """Build from a plain mapping (TOML, JSON) — the defense's model; same errors as the constructor."""
        return cls(**data)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        data = _known_fields(cls, data)
        if isinstance(data, Mapping) and any(isinstance(data.get(k), str) and data[k].lower() == "none"
                                             for k in NONE_STRINGS):
            data = {k: (None if k in NONE_STRINGS and isinstance(v, str) and v.lower() == "none" else v)
                    for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _positive_clip(self) -> "GuardConfig":
        clip = self.clip_per_sample
        if not isinstance(clip, str) and clip is not None and not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"clip_per_sample={clip} must be a positive number, 'median', 'quantile', 'retention', "
                             "'auto' or None")
        return self

    @model_validator(mode="after")
    def _one_floor(self) -> "GuardConfig":
        if self.max_psnr is None:
            if self.min_rmse is not None:
                return self
            normalisation = self.pixel_mean is not None and self.pixel_std is not None
            if not normalisation or "max_psnr" in self.model_fields_set:  # the default floor in input units
                object.__setattr__(self, "min_rmse", DEFAULT_MIN_RMSE)
                return self
            object.__setattr__(self, "max_psnr", DEFAULT_MAX_PSNR)  # the default floor, in pixels
        if self.min_rmse is not None:
            if "min_rmse" in self.model_fields_set:
                raise ValueError(f"min_rmse={self.min_rmse} and max_psnr={self.max_psnr} both set a floor; "
                                 "give one: max_psnr in pixel PSNR (with pixel_mean, pixel_std) or min_rmse in "
                                 "model-input units")
            object.__setattr__(self, "min_rmse", None)  # the default yields to max_psnr set by assignment
        if not math.isfinite(self.max_psnr):
            raise ValueError(f"max_psnr={self.max_psnr} must be finite")
        if self.pixel_mean is None or self.pixel_std is None:
            raise ValueError("max_psnr needs pixel_mean and pixel_std (the normalisation the model inputs went "
                             "through; 0 and 1 for raw [0, 1] pixels)")
        mean, std = _per_channel(self.pixel_mean), _per_channel(self.pixel_std)
        if len(mean) != len(std) and 1 not in (len(mean), len(std)):
            raise ValueError(f"pixel_mean has {len(mean)} channels and pixel_std {len(std)}: give one value or "
                             "one per channel each")
        if not all(math.isfinite(v) and v > 0 for v in std) or not all(math.isfinite(v) for v in mean):
            raise ValueError(f"pixel_std={self.pixel_std} must be positive and finite, pixel_mean finite")
        return self

    @model_validator(mode="after")
    def _send_needs_acknowledgement(self) -> "GuardConfig":
        if self.on_unmet == "send" and not self.acknowledge_unguarded:
            raise ValueError("on_unmet='send' lets an update that misses min_rmse leave the client; "
                             "set acknowledge_unguarded=True to confirm")
        return self

    @property
    def floor(self) -> float:
        """τ in model-input units: ``min_rmse``, or 10^(−max_psnr/20) / min(pixel_std)."""
        if self.max_psnr is None:
            return float(self.min_rmse)
        return 10 ** (-self.max_psnr / 20) / min(_per_channel(self.pixel_std))


class ThresholdGuardConfig(GuardConfig):
    """The defenses that promise the floor (``gaussian``, ``eigen``): they scale their noise until every
    sample's predicted RMSE reaches τ, optionally for an attacker that clips to a box of valid inputs.

    ``input_bounds`` (low, high), scalars or one value per channel in model-input units (pixels
    [0, 1] are ((0 − mean)/std, (1 − mean)/std)), or ``"batch"`` (each channel's min and max over
    the batch itself: the tightest box holding the data, so a conservative stand-in for any box an
    attacker may know): when set, the floor is verified for an attacker that clips its
    reconstruction to this box — the predicted error is clip(x + Δx) − x instead of Δx — a promise
    never weaker than without it, which closes the gap to box-constrained attacks (GS). With
    ``max_psnr`` and no ``input_bounds`` the box defaults to the pixel box [0, 1] (``bounds``).

    ``max_excluded``: on a trained model a few samples of a batch can need far more noise than the
    budget allows (with the box, a sample whose predicted shift points out of it keeps a small
    clipped error at any noise). Up to this share of the batch, such samples are left out of the
    step — their gradients are not in the update, which then carries nothing of them — and the
    others are guarded as usual (``flguard.guard.exclusion``); beyond it, ``on_unmet`` applies.
    """

    defense: Literal["auto", "gaussian", "rowspace", "resolvent", "eigen"] = DEFAULT_DEFENSE
    # the defaults that send on trained models (see DEFAULT_CLIP); the baselines keep no clipping, a
    # budget relative to ‖gradient‖ and rtol 1e-3, so "none" stays the unmodified update
    clip_per_sample: float | Literal["median", "quantile", "retention", "auto"] | None = Field(
        DEFAULT_CLIP, description="C: clip each sample's gradient to norm C before the floor (the guard measures "
        "the clipped map); max_rel_noise is then relative to C. 'median': C = the median of the batch's "
        "per-sample gradient norms, each step; 'quantile': their clip_quantile quantile; 'retention': the smallest of "
        "them from the median up whose clipped sum keeps clip_retention of the gradient's length along it; 'auto' "
        "(default): 'retention' while the noise sent keeps the parameters' moves small and does not undo the "
        "steps' progress (needs the step size), else the median, or a fraction of it where the median's noise does "
        "harm; "
        "None (or 'none'): no clipping, the budget relative to ‖gradient‖")
    max_rel_noise: float = Field(DEFAULT_MAX_REL_NOISE, gt=0.0, description="noise budget: ‖noise‖ / C with "
                                 "clip_per_sample (/ B·C for a summed loss; / ‖gradient‖ without) at most this")
    rtol: float = Field(DEFAULT_RTOL, gt=0.0, lt=0.1, description="solver tolerance (the floor is aimed at "
                        "τ(1 + rtol) with each sample's solver error bound taken off)")
    input_bounds: tuple[float | tuple[float, ...], float | tuple[float, ...]] | Literal["batch"] | None = Field(
        None, description="(low, high) box of valid inputs in model-input units (scalar or per channel), or 'batch'")
    max_excluded: float = Field(DEFAULT_MAX_EXCLUDED, ge=0.0, lt=1.0, description="share of a batch that may be left out of the "
                                "step when the budget cannot protect it (its gradient is then not sent); "
                                "0: the whole step is withheld instead")

    @model_validator(mode="after")
    def _bounds_are_a_box(self) -> "ThresholdGuardConfig":
        if self.input_bounds is not None and self.input_bounds != "batch":
            low, high = (v if isinstance(v, tuple) else (v,) for v in self.input_bounds)
            channels = max(len(low), len(high))
            if {len(low), len(high)} - {1, channels}:
                raise ValueError("input_bounds: low and high need one value each or one per channel")
            low, high = low * (channels // len(low)), high * (channels // len(high))
            if not all(math.isfinite(lo) and math.isfinite(hi) and lo < hi for lo, hi in zip(low, high)):
                raise ValueError(f"input_bounds={self.input_bounds}: every low must be finite and below its high")
        return self

    @property
    def bounds(self) -> tuple | str | None:
        """``input_bounds``, or with ``max_psnr`` and none given the pixel box [0, 1] in input units."""
        if self.input_bounds is not None or self.max_psnr is None:
            return self.input_bounds
        mean, std = _per_channel(self.pixel_mean), _per_channel(self.pixel_std)
        channels = max(len(mean), len(std))
        mean, std = mean * (channels // len(mean)), std * (channels // len(std))
        low = tuple((0 - m) / s for m, s in zip(mean, std))
        high = tuple((1 - m) / s for m, s in zip(mean, std))
        return (low, high) if channels > 1 else (low[0], high[0])


class GaussianGuardConfig(ThresholdGuardConfig):
    """``gaussian``: isotropic noise scaled until every sample's predicted RMSE ≥ τ."""

    defense: Literal["gaussian"] = "gaussian"


class RowspaceGuardConfig(ThresholdGuardConfig):
    """``rowspace``: Gaussian input noise, filtered by each sample's regularised gain and carried through
    the samples' Jacobians (Σ J_iᵀ(K_i+εI)⁻²z_i), scaled until every sample's predicted RMSE ≥ τ
    (``flguard.defenses.rowspace``): a quarter of eigen's products, less accuracy (docs/results.md)."""

    defense: Literal["rowspace"] = "rowspace"


class ResolventGuardConfig(ThresholdGuardConfig):
    """``resolvent``: each sample's random input noise filtered by (K_i+ε_iI)⁻¹ on the Krylov space of the guard's
    λmax Lanczos run (CG's sixth iterate), scaled to unit I²F on its own sample and mapped through the Jacobians
    (Σ J_iᵀ(K_i+ε_iI)⁻¹z_i/ι_i), then scaled to τ (``flguard.defenses.resolvent``): noise near each sample's weak
    directions without eigen's 64-step run."""

    defense: Literal["resolvent"] = "resolvent"


class EigenGuardConfig(ThresholdGuardConfig):
    """``eigen``: noise aimed at each sample's weak directions (found by Lanczos), scaled to τ."""

    defense: Literal["eigen"] = "eigen"
    subspace_size: int = Field(32, ge=1, description="eigen: weak directions mixed per sample")
    krylov_steps: int = Field(64, ge=4, description="eigen: Lanczos steps used to find weak directions")
    gaussian_floor: float = Field(0.0, ge=0.0, le=1.0, description="eigen: share of min_rmse an isotropic "
                                  "noise part must meet on its own (robustness to subspace-aware attackers)")


class AutoGuardConfig(EigenGuardConfig):
    """``auto`` (the default): the calibrated Gaussian, and aimed noise (``fallback``: resolvent noise, or eigen's
    with its fields) on a step where the Gaussian would need more than the budget, or — with SGD's
    learning rate known (``make_guarded``, ``guard_step(step_size=…)``) — whose noise would move the parameters
    by more than 10% of their norm per step in root mean square over the recent steps
    (``flguard.guard.perturb.auto_order``, ``AUTO_MAX_MOVE``)."""

    defense: Literal["auto"] = "auto"
    fallback: Literal["eigen", "resolvent"] = Field(DEFAULT_FALLBACK, description="auto: the aimed noise sent "
                                                    "where the Gaussian is not: 'resolvent' (default; its direction "
                                                    "from the guard's λmax run) or 'eigen' (its fields above; about "
                                                    "4× resolvent's products on a ResNet)")


class NoneGuardConfig(GuardConfig):
    """``none``: the gradient unchanged, its (absent) protection measured against τ."""

    defense: Literal["none"] = "none"


class FixedGaussianGuardConfig(GuardConfig):
    """``fixed-gaussian``: the baseline g + N(0, σ²I), sent whatever its measured RMSE."""

    defense: Literal["fixed-gaussian"] = "fixed-gaussian"
    sigma: float = Field(1e-2, gt=0.0, description="fixed-gaussian: noise standard deviation")


class PruningGuardConfig(GuardConfig):
    """``pruning``: the baseline that keeps the largest-magnitude entries (DLG's pruning defense)."""

    defense: Literal["pruning"] = "pruning"
    keep_ratio: float = Field(0.1, gt=0.0, le=1.0, description="pruning: share of largest-magnitude entries kept")


class LocalDpGuardConfig(LocalDpConfig, GuardConfig):
    """``localdp``: Flower's LocalDpMod rule (``LocalDpConfig``: clip to ``clipping_norm``, Gaussian
    noise of std sensitivity·√(2 ln(1.25/δ))/ε) on each step's gradient, measured against τ."""

    defense: Literal["localdp"] = "localdp"


#: Each defense's model; ``GuardConfig(defense=d)`` builds ``DEFENSE_MODELS[d]``.
DEFENSE_MODELS: dict[str, type[GuardConfig]] = {
    "none": NoneGuardConfig, "auto": AutoGuardConfig, "gaussian": GaussianGuardConfig, "rowspace": RowspaceGuardConfig,
    "resolvent": ResolventGuardConfig, "eigen": EigenGuardConfig,
    "fixed-gaussian": FixedGaussianGuardConfig, "pruning": PruningGuardConfig, "localdp": LocalDpGuardConfig}
assert tuple(DEFENSE_MODELS) == DEFENSES

#: The same choice as a pydantic field type, discriminated on ``defense``.
AnyGuardConfig = Annotated[Union[NoneGuardConfig, AutoGuardConfig, GaussianGuardConfig, RowspaceGuardConfig, ResolventGuardConfig,
                                 EigenGuardConfig, FixedGaussianGuardConfig,
                                 PruningGuardConfig, LocalDpGuardConfig], Field(discriminator="defense")]


def guard_config_model(defense: str) -> type[GuardConfig]:
    """The model of ``defense`` (a ConfigError naming the known ones otherwise)."""
    if defense not in DEFENSE_MODELS:
        raise ConfigError(f"GuardConfig.defense: value={defense!r} is not allowed: choose one of "
                          f"{', '.join(DEFENSES)}")
    return DEFENSE_MODELS[defense]


def defense_fields(defense: str) -> tuple[str, ...]:
    """The fields ``defense`` takes, ``defense`` itself excluded (declaration order)."""
    return tuple(name for name in guard_config_model(defense).model_fields if name != "defense")


def all_guard_fields() -> tuple[str, ...]:
    """Every field some defense takes, ``defense`` first (the ``guard-<field>`` run-config keys)."""
    names = ["defense"]
    for defense in DEFENSES:
        names += [name for name in defense_fields(defense) if name not in names]
    return tuple(names)


def parse_guard_config(data: Mapping[str, Any]) -> GuardConfig:
    """The defense's config from a mapping (TOML table, run-config values); ``defense`` defaults to
    ``"auto"``. Errors (ConfigError) name the field."""
    return GuardConfig(**dict(data))
