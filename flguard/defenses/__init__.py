"""Perturbations the guard can apply, one module each, behind one small protocol.

Threshold defenses (``gaussian``, ``rowspace``, ``resolvent``, ``eigen``) return a *direction*; the guard scales it until every
sample's predicted recovery RMSE meets the floor, verified on the realised noise. Baselines
(``none``, ``fixed-gaussian``, ``pruning``, ``localdp``) return the perturbed gradient itself and are
scored with the same I2F, so the comparison is fair.
"""

from flguard.defenses.base import DefenseContext, Direction, draw_generator
from flguard.defenses.baselines import BASELINES
from flguard.defenses.eigen import eigen_direction
from flguard.defenses.gaussian import gaussian_direction
from flguard.defenses.resolvent import resolvent
from flguard.defenses.rowspace import rowspace_direction

DIRECTIONS = {"gaussian": gaussian_direction, "rowspace": rowspace_direction, "resolvent": resolvent,
              "eigen": eigen_direction}

__all__ = ["DefenseContext", "Direction", "draw_generator", "DIRECTIONS", "BASELINES"]
