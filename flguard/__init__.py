"""flguard: per-sample gradient-leakage measurement, guarded updates and inversion attacks for Flower.

The client's names (``Guard``, ``GuardConfig``, ``make_guarded``, …) come from ``flguard.guard``;
``flguard.flower`` attaches them to Flower clients. The simulated federation (``flguard.simulation``,
``flguard.apps``), the malicious server (``flguard.server``) and the attacks are separate packages
that a client never imports.
"""

__version__ = "0.1.0"

_GUARD_NAMES = ("Guard", "GuardConfig", "GuardReport", "GuardOutput", "GuardFailure", "make_guarded",
                "check_model", "fix_model", "UnsupportedModel")

__all__ = ["__version__", *_GUARD_NAMES]


def __getattr__(name: str):
    # The guard pulls in torch.func machinery; import it on first use so `flguard --help` is fast.
    if name in _GUARD_NAMES:
        from flguard import guard

        return getattr(guard, name)
    raise AttributeError(name)
