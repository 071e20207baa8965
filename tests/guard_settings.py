"""The guard's settings before issue 22's defaults, for the tests of the unclipped maths.

Since issue 22 the threshold defenses clip per sample at the batch's median norm by default, with a
budget of 40 C, up to a quarter of a batch left out and rtol 1e-2. The tests that check the
unclipped I²F (the plain per-sample block J_i, the budget in units of ‖g‖, the whole batch kept)
against dense references ask for those settings explicitly through ``unclipped``; the clipped
defaults have dense tests of their own (tests/test_guard_clip.py, tests/test_guard_model.py).
"""

from __future__ import annotations

from flguard import GuardConfig
from flguard.guard.config import THRESHOLD_DEFENSES

UNCLIPPED = dict(clip_per_sample=None, max_rel_noise=10.0, max_excluded=0.0, rtol=1e-3)


def unclipped(**fields) -> GuardConfig:
    """``GuardConfig(**fields)`` with UNCLIPPED under the fields given (threshold defenses only)."""
    if fields.get("defense", "gaussian") in THRESHOLD_DEFENSES:
        fields = {**UNCLIPPED, **fields}
    return GuardConfig(**fields)
