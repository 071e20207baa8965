"""The guard in a real Flower simulation (Ray backend): every round's train replies carry the guard's
metrics, evaluate works with the mod attached app-wide, and the run completes."""

from __future__ import annotations

from flguard import GuardConfig
from flguard.flower import guard_mod
from flguard.guard_report import METRIC_KEYS


def test_guarded_fedsgd_in_a_ray_simulation(simulation_apps) -> None:
    from flwr.simulation import run_simulation

    make_client_app, make_server_app = simulation_apps
    overrides = {"num-server-rounds": 2, "batch-size": 2, "local-steps": 1, "lr": 0.1, "init": "uniform",
                 "malicious": False, "round-timeout": 600.0}
    results = []
    try:
        run_simulation(server_app=make_server_app(overrides, on_result=results.append),
                       client_app=make_client_app(overrides, mods=[guard_mod(GuardConfig(defense="gaussian",
                                                                                         min_rmse=0.05))]),
                       num_supernodes=2,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 2}})
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    (result,) = results
    assert set(result.train_metrics_clientapp) == {1, 2}
    for metrics in result.train_metrics_clientapp.values():
        assert set(METRIC_KEYS) <= set(metrics.keys())
        assert metrics["guard_met"] == 1.0 and metrics["guard_min_rmse_after"] >= 0.05
    assert set(result.evaluate_metrics_clientapp) == {1, 2}  # evaluate replies untouched by the mod
