"""``LocalDpConfig``: the arguments of Flower's ``LocalDpMod``, one meaning of "localdp" shared by the guard's
``localdp`` defense (``flguard.guard.config.LocalDpGuardConfig``) and ``flguard.simulation.localdp``, with the
error that names a field's old name."""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import Field, model_validator

from flguard.config import StrictModel
from flguard.defenses.baselines import gaussian_mechanism_std


#: Old names of the localdp fields (before they took Flower's LocalDpMod names): an error says the new one.
RENAMED_FIELDS = {"clip_norm": "clipping_norm", "dp_epsilon": "epsilon", "dp_delta": "delta"}


def _no_old_names(data: Any) -> None:
    renamed = [f"{old} is now {new} (Flower's LocalDpMod name, a defense='localdp' field)"
               for old, new in RENAMED_FIELDS.items() if old in data]
    if renamed:
        raise ValueError("; ".join(renamed))


class LocalDpConfig(StrictModel):
    """The arguments of Flower's ``LocalDpMod``: clip to ``clipping_norm``, then Gaussian noise of std
    ``gaussian_mechanism_std(sensitivity, epsilon, delta)`` = sensitivity·√(2 ln(1.25/δ))/ε.

    One meaning of "localdp": ``flguard.simulation.localdp`` passes these to Flower's mod (on the model update),
    the guard's ``localdp`` defense (``LocalDpGuardConfig``) applies the same rule to each step's
    gradient, with the same names."""

    clipping_norm: float = Field(gt=0.0, description="clip the update (model update θK − θ0, or the guard's "
                                                     "step gradient) to this norm")
    sensitivity: float = Field(gt=0.0, description="sensitivity in the noise formula (usually = clipping_norm)")
    epsilon: float = Field(gt=0.0, description="ε of the Gaussian mechanism")
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="δ of the Gaussian mechanism")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            _no_old_names(data)
        return data

    @property
    def std(self) -> float:
        """The per-coordinate noise standard deviation the mechanism adds."""
        return gaussian_mechanism_std(self.sensitivity, self.epsilon, self.delta)


__all__ = ["LocalDpConfig", "RENAMED_FIELDS"]
