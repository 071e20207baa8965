"""flguard: per-sample gradient-leakage measurement, guarded updates and inversion attacks for Flower."""

__version__ = "0.1.0"

__all__ = ["__version__", "Guard", "GuardConfig", "GuardReport", "GuardOutput", "GuardFailure", "make_guarded",
           "check_model", "fix_model", "UnsupportedModel"]


def __getattr__(name: str):
    # The guard pulls in torch.func machinery; import it on first use so `flguard --help` is fast.
    if name in ("Guard", "GuardFailure"):
        from flguard import guard

        return getattr(guard, name)
    if name == "make_guarded":
        from flguard.training import make_guarded

        return make_guarded
    if name in ("check_model", "fix_model", "UnsupportedModel"):
        from flguard import guard_model

        return getattr(guard_model, name)
    if name == "GuardConfig":
        from flguard.guard_config import GuardConfig

        return GuardConfig
    if name in ("GuardReport", "GuardOutput"):
        from flguard import guard_report

        return getattr(guard_report, name)
    raise AttributeError(name)
