"""The ClientApp: FedSGD (one local SGD step) or K local steps on this node's MNIST-5k partition.

The app itself lives in ``flguard.apps`` (``flguard compare`` runs the same one). Its defenses
come from the run config: ``guard-<field>`` keys attach flguard's guard, ``localdp-<field>`` keys
Flower's LocalDpMod. In your own app the guard is one line: ``ClientApp(mods=[guard_mod(config)])``.
"""

from flguard.apps.client import make_client_app

app = make_client_app()

__all__ = ["app", "make_client_app"]
