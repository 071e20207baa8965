"""The guard on Flower's deployment engine: a real SuperLink and two SuperNodes on loopback.

Two rounds of the guarded simulations/ app; one SuperNode is killed once round 2 has started. The
run must complete, and every train reply the server received (logged one by one in summary.json
by the app's ``LoggedFedAvg``) must carry the guard's keys with ``guard_met`` = 1 and non-zero
noise: no unguarded update arrived. Every process started here is stopped by its process group.
"""

from __future__ import annotations

import csv
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SIMULATIONS, TINY_COMPARISON
from flguard.guard.report import METRIC_KEYS

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


def _wait_for_log(path: Path, text: str, count: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text(errors="replace").count(text) >= count:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{path.name}: fewer than {count} × {text!r} after {seconds} s")


def _die_with_this_process() -> None:
    """In the child, before exec (Linux): SIGKILL it when the process that started it dies — a killed
    pytest never reaches the fixture's teardown, and its SuperLink and SuperNodes outlived it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not glibc Linux: the teardown below is the only stop


@pytest.fixture
def launch():
    """Start processes in their own process groups; stop every one of them at the end, by PID (and,
    on Linux, with this process if it is killed first)."""
    started: list[subprocess.Popen] = []

    def start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
        process = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True,
                                   preexec_fn=_die_with_this_process if sys.platform.startswith("linux") else None)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue


def _start_federation(tmp_path: Path, launch, node_config: str = "") -> tuple[list[subprocess.Popen], dict]:
    """A SuperLink and two SuperNodes on loopback (``node_config`` added to each node's partition
    keys), both registered; returns the nodes and the environment for ``flwr`` commands."""
    port = _free_port()
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "local-deployment"\n\n[superlink.local-deployment]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLGUARD_RUNS_DIR": str(tmp_path / "runs"),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_TELEMETRY_ENABLED": "0", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    launch([str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
            "--port", str(port)], tmp_path / "superlink.log", env)
    _wait_for_port(port, 90)
    nodes = [launch([str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                     "--port", str(_free_port()), "--node-config",
                     f"partition-id={k} num-partitions=2 {node_config}".strip()],
                    tmp_path / f"supernode-{k}.log", env) for k in range(2)]
    # Both SuperNodes registered before a run starts, so its first round samples both.
    _wait_for_log(tmp_path / "superlink.log", "Activated node_id=", count=2, seconds=180)
    return nodes, env


def test_guarded_run_survives_a_killed_supernode(tmp_path: Path, launch) -> None:
    # min-nodes=1 only lets round 2's evaluate go on without the node killed below.
    nodes, env = _start_federation(tmp_path, launch)
    out_dir = tmp_path / "results"
    run_log = tmp_path / "run.log"
    run = launch([str(BIN / "flwr"), "run", str(SIMULATIONS), "local-deployment", "--stream", "--run-config",
                  f'num-server-rounds=2 min-nodes=1 batch-size=2 round-timeout=400 attack-iterations=2 '
                  f'attack-blocking=true out-dir="{out_dir}"'], run_log, env)
    deadline = time.monotonic() + 840
    while "[ROUND 2/2]" not in run_log.read_text() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    assert "[ROUND 2/2]" in run_log.read_text(), run_log.read_text()[-3000:]
    os.killpg(nodes[1].pid, signal.SIGKILL)  # a client disappears mid-run
    nodes[1].wait(timeout=30)
    assert run.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, run_log.read_text()[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert sorted(summary["train_metrics"]) == ["1", "2"]
    for metrics in summary["train_metrics"].values():
        assert metrics["guard_met"] == 1.0 and metrics["guard_min_rmse_after"] >= 0.05
    # Every train reply the server received, one by one: only guarded updates arrived.
    replies = summary["train_replies"]
    # Round 1: both nodes' replies; round 2: the survivor's (plus the killed node's error reply).
    assert len(replies["1"]) == 2 and 1 <= len(replies["2"]) <= 2, replies
    received = [metrics for per_node in replies.values() for metrics in per_node.values() if "error" not in metrics]
    assert len(received) >= 3, replies
    for metrics in received:
        assert set(METRIC_KEYS) <= set(metrics), metrics
        assert metrics["guard_met"] == 1.0 and metrics["guard_min_rmse_after"] >= 0.05 and metrics["guard_noise_norm"] > 0


def test_the_server_cannot_switch_the_clients_guard_off(tmp_path: Path, launch) -> None:
    """SuperNodes whose node config sets the client's own guard; the run config asks for
    ``guard-defense = "none"``. Every train reply must come back guarded or as an error: here, the
    refusal that names the run config's attempt."""
    _, env = _start_federation(tmp_path, launch, "guard-defense='gaussian' guard-min-rmse=0.05")
    out_dir = tmp_path / "results"
    run_log = tmp_path / "run.log"
    run = launch([str(BIN / "flwr"), "run", str(SIMULATIONS), "local-deployment", "--stream", "--run-config",
                  f'num-server-rounds=1 batch-size=2 round-timeout=400 attack-iterations=2 attack-blocking=true '
                  f'guard-defense="none" '
                  f'out-dir="{out_dir}"'], run_log, env)
    assert run.wait(timeout=600) == 0, run_log.read_text()[-3000:]
    replies = json.loads((out_dir / "summary.json").read_text())["train_replies"]
    received = [metrics for per_node in replies.values() for metrics in per_node.values()]
    assert len(received) == 2, replies
    for metrics in received:  # guarded, or an error reply; never an unguarded update
        assert ("error" in metrics and "lower the client's guard" in metrics["error"]
                and "defense='none'" in metrics["error"]) or metrics.get("guard_met") == 1.0, metrics


# The suite's tiny comparison with one round and two defenses: one ``flwr run`` each.
DEPLOYED_COMPARISON = re.sub(r'\[\[defenses\]\]\nname = "dp"\n[^\[]*', "",
                             TINY_COMPARISON.replace("rounds = 2", "rounds = 1"))


def test_compare_recipe_on_the_deployment_engine(tmp_path: Path, launch) -> None:
    """docs/compare.md's recipe, command for command: a SuperLink and one SuperNode per client,
    one ``flwr run`` per defense with the run config ``flguard compare --run-config`` prints, then
    ``flguard compare`` merges the finished runs without redoing any in the Simulation Engine."""
    config, out = tmp_path / "deployed.toml", tmp_path / "out"
    config.write_text(DEPLOYED_COMPARISON)
    _, env = _start_federation(tmp_path, launch)
    flguard = [str(BIN / "flguard"), "compare", str(config), "--out", str(out)]
    for defense in ("none", "guarded"):
        printed = subprocess.run([*flguard, "--run-config", defense], env=env, capture_output=True, text=True,
                                 check=True).stdout.strip()
        assert "sim-truth-dir" not in printed and f'out-dir="{out.resolve() / "runs" / defense}"' in printed
        log = tmp_path / f"run-{defense}.log"
        run = launch([str(BIN / "flwr"), "run", str(SIMULATIONS), "local-deployment", "--stream",
                      "--run-config", printed], log, env)
        assert run.wait(timeout=600) == 0, log.read_text()[-3000:]
    summaries = {d: out / "runs" / d / "summary.json" for d in ("none", "guarded")}
    written = {d: path.stat().st_mtime_ns for d, path in summaries.items()}
    merged = subprocess.run(flguard, env=env, capture_output=True, text=True, timeout=600)
    assert merged.returncode == 0, merged.stdout[-3000:] + merged.stderr[-3000:]
    assert "none: skip" in merged.stdout and "guarded: skip" in merged.stdout, merged.stdout[-3000:]
    assert {d: path.stat().st_mtime_ns for d, path in summaries.items()} == written  # not redone
    with (out / "rounds.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sorted((r["defense"], r["client"]) for r in rows) == [("guarded", "0"), ("guarded", "1"),
                                                                 ("none", "0"), ("none", "1")]
    guarded = [r for r in rows if r["defense"] == "guarded"]
    assert all(float(r["min_pred_rmse"]) >= 0.2 and float(r["noise_norm"]) > 0 for r in guarded), guarded
    attacked = [r for r in rows if r["attack_method"]]
    # Per round and defense: one probed victim and one honest client's real upload; no true batch
    # outside simulations, so no scores.
    assert sorted(r["attack_target"] for r in attacked) == ["fedavg-upload"] * 2 + ["probe"] * 2, attacked
    assert all(r["attack_method"] == "gs" and r["attack_psnr"] == "" for r in attacked), attacked
    assert (out / "report.html").exists() and (out / "summary.csv").exists()
