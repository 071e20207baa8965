"""flguard: per-sample gradient-leakage measurement, guarded updates and inversion attacks for Flower."""

__version__ = "0.1.0"

__all__ = ["__version__"]
