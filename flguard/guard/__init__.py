"""The guard: per-sample leakage measured, the update perturbed to a certified floor, failing closed.

What a client uses (also importable from ``flguard``):

- ``GuardConfig`` (``config``): every setting, validated; ``LocalDpConfig`` for Flower's LocalDpMod.
- ``make_guarded`` (``training``): an unchanged ``loss.backward(); optimizer.step()`` loop, guarded.
- ``Guard`` (``engine``): one batch's gradient → ``GuardOutput`` (the upload or None, and its
  ``GuardReport`` from ``report``); ``GuardFailure`` (``failure``) names why a step withheld.
- ``check_model`` / ``fix_model`` / ``UnsupportedModel`` (``model_check``): the layers it can certify;
  ``FrozenBatchNorm`` (``frozen_batchnorm``): a pretrained BatchNorm kept as it was, for fine-tuning;
  ``DropoutDraws`` and ``ReplayedDropPath`` (``flguard.risk.dropout_draws``): the masks of a pass with train-mode
  dropout, which ``Guard.protect`` replays (``draws=``), and the stochastic depth that ``fix_model`` puts in.

Inside, one job per module: ``perturb`` picks and runs the defense on a step's per-sample operator,
``floor`` scales its noise to the floor within the budget, ``exclusion`` leaves out the samples the
budget cannot protect, ``session`` keeps a round's reports for the Flower mod
(``flguard.flower``). Dependencies run one way: risk ← defenses ← guard ← flower.
"""

from flguard.guard.config import GuardConfig, LocalDpConfig
from flguard.guard.failure import GuardFailure
from flguard.guard.report import GuardOutput, GuardReport
from flguard.guard.frozen_batchnorm import FrozenBatchNorm
from flguard.guard.model_check import UnsupportedModel, check_model, fix_model
from flguard.guard.engine import Guard
from flguard.guard.training import make_guarded
from flguard.risk.dropout_draws import DropoutDraws, ReplayedDropPath

__all__ = ["Guard", "GuardConfig", "GuardFailure", "GuardOutput", "GuardReport", "LocalDpConfig", "make_guarded",
           "check_model", "fix_model", "UnsupportedModel", "FrozenBatchNorm", "DropoutDraws", "ReplayedDropPath"]
