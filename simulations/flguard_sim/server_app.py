"""The ServerApp: FedAvg on the shared task, wrapped by ``MaliciousServer`` when ``malicious = true``.

The app itself lives in ``flguard.apps``. Results (attack rows, reconstruction grids, the
run summary) go to ``out-dir``; see docs/malicious-server.md.
"""

from flguard.apps.server import LoggedFedAvg, ServerSettings, build_strategy, make_server_app, run_server

app = make_server_app()

__all__ = ["app", "make_server_app", "run_server", "build_strategy", "ServerSettings", "LoggedFedAvg"]
