"""Compare defenses round by round: ``flguard compare CONFIG --out DIR`` and ``flguard demo``.

- ``config``: the TOML comparison config (pydantic-validated) and its run-config keys;
- ``runner``: one Flower simulation per defense (Ray backend), resumable;
- ``tables``: ``rounds.csv`` and ``summary.csv``;
- ``classes``: per-class risk of the task's initial model;
- ``report``: the figures and the self-contained ``report.html``.
"""

from flguard.compare.config import DEFAULT_CONFIG, CompareConfig, DefenseSpec, load_config

__all__ = ["CompareConfig", "DefenseSpec", "load_config", "DEFAULT_CONFIG"]
