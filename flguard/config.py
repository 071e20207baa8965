"""Configuration primitives: strict pydantic models whose errors name the field, value and rule.

Every user-facing config in flguard derives from ``StrictModel`` so that a typo'd field or a bad
value fails at construction with a one-line message, not a traceback from deep inside torch.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound="StrictModel")


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the field, the value and the rule."""


def describe_validation_error(model_name: str, error: ValidationError) -> str:
    """Render pydantic's errors as ``Model.field: value=... is not allowed: reason`` lines."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        nested = (item.get("ctx") or {}).get("error")
        if isinstance(nested, ConfigError) and field:
            # A nested StrictModel already described its own fields: re-root its lines at this field.
            for line in str(nested).splitlines():
                inner, _, rest = line.partition(".")
                lines.append(f"{model_name}.{field}.{rest}" if rest and inner.isidentifier() else
                             f"{model_name}.{field}: {line}")
            continue
        reason = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            reason = "unknown field (check its spelling)"
        if item["type"] == "missing":
            lines.append(f"{model_name}.{field}: required (no default)")
            continue
        if not field:  # a rule across fields: its message names them
            lines.append(f"{model_name}: {reason}")
            continue
        lines.append(f"{model_name}.{field}: value={item.get('input')!r} is not allowed: {reason}")
    return "\n".join(lines)


class StrictModel(BaseModel):
    """Base for all flguard configs: unknown fields are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise ConfigError(describe_validation_error(type(self).__name__, error)) from None

    @classmethod
    def parse(cls: type[T], data: dict[str, Any]) -> T:
        """Build from a plain mapping (TOML, JSON); same errors as the constructor."""
        return cls(**data)
