"""Shared test setup: Flower offline, deterministic torch, small thread pools."""

import os

os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

import contextlib  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

SIMULATIONS = Path(__file__).resolve().parents[1] / "simulations"

# A comparison small enough for the test suite: 2 clients, 2 rounds, an MLP on digits, 8 GS iterations.
TINY_COMPARISON = """
name = "tiny"
seed = 0
[task]
dataset = "digits"
model = "mlp"
init = "uniform"
clients = 2
partitioning = "iid"
rounds = 2
local_steps = 2
batch_size = 4
lr = 0.1
[attack]
method = "gs"
iterations = 8
clients_per_round = 1
victim_batch_size = 1
victim_local_steps = 1
[[defenses]]
name = "none"
defense = "none"
[[defenses]]
name = "dp"
defense = "localdp"
clipping_norm = 10.0
sensitivity = 1.0
epsilon = 20.0
[[defenses]]
name = "guarded"
defense = "gaussian"
min_rmse = 0.2
input_bounds = "batch"
seed = 0
"""


# PyTorch 2.14's oneDNN weight gradient of a strided 1×1 convolution in channels-last memory is wrong on some CPUs
# (an AMD EPYC core with AVX2: the ResNet shortcut's gradient off by 18× its norm with two threads, a heap corruption
# and a crash with one; docs/results.md, "Channels-last on the CPU"). The tests whose user loops train channels-last
# ResNets in float32, as practitioners do, take ``sound_channels_last_convolutions``: where a probe in a subprocess
# shows the fault, PyTorch's own (non-oneDNN) convolutions run them. The guard's products never take channels-last
# kernels either way.
_CHANNELS_LAST_PROBE = """
import torch
torch.manual_seed(0)
conv, x = torch.nn.Conv2d(4, 8, 1, stride=2, bias=False), torch.rand(4, 4, 8, 8)
def weight_grad(memory_format):
    copy = torch.nn.Conv2d(4, 8, 1, stride=2, bias=False)
    copy.load_state_dict(conv.state_dict())
    copy = copy.to(memory_format=memory_format)
    copy(x.contiguous(memory_format=memory_format)).square().sum().backward()
    return copy.weight.grad
ok = True
for threads in (torch.get_num_threads(), 1):
    torch.set_num_threads(threads)
    ref = weight_grad(torch.contiguous_format)
    ok = ok and all(torch.allclose(weight_grad(torch.channels_last), ref, rtol=1e-4, atol=1e-6) for _ in range(8))
raise SystemExit(0 if ok else 3)
"""


@functools.cache
def _onednn_channels_last_is_sound() -> bool:
    import subprocess

    try:
        probe = subprocess.run([sys.executable, "-c", _CHANNELS_LAST_PROBE], capture_output=True, timeout=120)
        return probe.returncode == 0
    except subprocess.TimeoutExpired:  # a probe that hangs is not a sound kernel either
        return False


@pytest.fixture(scope="module")
def sound_channels_last_convolutions():
    """oneDNN off for the module where its channels-last strided 1×1 convolution gradient is wrong on this CPU."""
    enabled = torch.backends.mkldnn.enabled
    if torch.backends.mkldnn.is_available() and not _onednn_channels_last_is_sound():
        torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = enabled


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Double-backward on tiny nets is dominated by thread synchronisation on a busy 2-core box. The count is not
    raised again afterwards: with PyTorch 2.14's MKL on the AMD EPYC machine, ``torch.set_num_threads(n)`` with n > 1
    (even the count already set) breaks the batched LU of float64 matrices from about 150 rows for the rest of the
    process — ``torch.linalg.solve`` then returns garbage (oneMKL: "Parameter 6 was incorrect on entry to DLASWP") or
    hangs — and later tests' dense references solve such batches. The guard itself takes no LU (eigh, Cholesky and QR
    were unaffected)."""
    torch.set_num_threads(1)
    yield


@contextlib.contextmanager
def importable_app(monkeypatch: pytest.MonkeyPatch, folder: Path, package: str):
    """Make a Flower app package under ``folder`` importable here and by the Ray workers (through
    sys.path); afterwards shut Ray down and forget the package's modules, whatever happens."""
    monkeypatch.syspath_prepend(str(folder))
    try:
        yield
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]


@pytest.fixture
def simulation_apps(monkeypatch: pytest.MonkeyPatch):
    """The app factories of simulations/."""
    with importable_app(monkeypatch, SIMULATIONS, "flguard_sim"):
        from flguard_sim.client_app import make_client_app
        from flguard_sim.server_app import make_server_app

        yield make_client_app, make_server_app


@pytest.fixture
def server_identity():
    """Messages are created server-side in Flower; give this process the identity a ServerApp has
    (for tests that build train messages and call a ClientApp directly)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
