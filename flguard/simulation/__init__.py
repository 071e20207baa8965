"""The simulated federation's shared pieces — never on a deployed client's import path.

- ``task``: the FL task every flguard app shares (model, client partitions, local SGD, the
  train-config keys the server sends, the record helpers).
- ``truth``: the simulation-only channel that leaves a client's true batch for the simulated
  server to score (``record_batch``; it writes nothing outside Flower's simulation runtime).
- ``localdp``: Flower's ``LocalDpMod`` configured from ``localdp-<field>`` run-config keys, with the
  noise it added measured (the comparison's baseline).

The apps (``flguard.apps``) and the malicious server (``flguard.server``) build on this package;
the client side (``flguard.flower``, ``flguard.guard``) does not import it.
"""

from flguard.simulation.truth import TRUTH_DIR_KEY, TruthChannelRefused, in_simulation_runtime, record_batch

__all__ = ["TRUTH_DIR_KEY", "TruthChannelRefused", "in_simulation_runtime", "record_batch"]
