"""The malicious server: the attacker's side of a Flower federation, kept apart from the client's.

As breaching separates user, server and attacker, flguard keeps the client (``flguard.flower``:
the guard's mod and wrappers, the shared task, the client half of the truth channel) apart from
the server that attacks it. A client that imports ``flguard.flower`` loads none of this package
nor the attacks. One concept per module:

- ``strategy``: ``MaliciousServer``, a Flower 1.41 ``Strategy`` wrapper that delegates every
  decision to the wrapped strategy and only captures the chosen clients' uploads;
- ``fishing``: the parameter moves (``fish_class``, ``fish_feature``) that make a batch gradient carry
  one class's samples, ``count_targets`` and ``attack_fished`` (Wen et al. 2022);
- ``victims``: whom to attack (target selectors, honest real uploads) and the victim config;
- ``uploads``: what an attack is (``AttackSpec``, ``UploadAttack``) and how an upload decodes
  (``delta_to_gradient``, ``ClientUpdate``);
- ``runner``: ``AttackRunner``, which inverts captured uploads on a background thread;
- ``scoring``: ``Scorer``/``score_batch``, the reconstruction against the true batch;
- ``results``: ``ResultWriter``, the rows (``attacks.jsonl``, ``attacks.csv``) and images on disk;
- ``truth``: ``TruthReader``, the server half of the simulation-only true-batch channel.
"""

from flguard.server.fishing import (FISHING_KINDS, attack_fished, attack_fished_unrolled, count_targets, fish_class,
                                    fish_feature)
from flguard.server.results import ROW_FIELDS, ResultWriter, save_grid
from flguard.server.runner import AttackRunner, CapturedUpload
from flguard.server.scoring import Scorer, score_batch
from flguard.server.strategy import MaliciousServer
from flguard.server.truth import TrueBatch, TruthReader
from flguard.server.uploads import (PROBE, UPLOAD, AttackSpec, ClientUpdate, UploadAttack, delta_to_gradient,
                                    upload_attack_from_config)
from flguard.server.victims import Fishing, TargetSelector, every_client, first_clients, honest_targets

__all__ = [
    "MaliciousServer",
    "Fishing",
    "FISHING_KINDS",
    "fish_class",
    "fish_feature",
    "count_targets",
    "attack_fished",
    "attack_fished_unrolled",
    "AttackSpec",
    "UploadAttack",
    "ClientUpdate",
    "delta_to_gradient",
    "upload_attack_from_config",
    "PROBE",
    "UPLOAD",
    "TargetSelector",
    "every_client",
    "first_clients",
    "honest_targets",
    "AttackRunner",
    "CapturedUpload",
    "Scorer",
    "score_batch",
    "ResultWriter",
    "ROW_FIELDS",
    "save_grid",
    "TruthReader",
    "TrueBatch",
]
