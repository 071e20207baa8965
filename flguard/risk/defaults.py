"""Defaults of the risk measurement that configurations above risk/ also need.

A module of constants only (no torch, no solver), so a configuration model can take a default
from here without importing the measurement code.
"""

#: Default Tikhonov ε of I2F, relative to each sample's λmax: ε_i = DEFAULT_EPS_RELATIVE · λmax,i.
#: A relative ε is scale-free (λ spans orders of magnitude across models and samples); the value
#: is the one chosen by the ε study in docs/results.md.
DEFAULT_EPS_RELATIVE = 1e-2
