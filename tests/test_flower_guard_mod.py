"""guard_mod on a real Flower ClientApp and real Messages: what leaves the client, and what does not."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from flguard import GuardConfig
from flguard.flower import guard_mod, guard_step
from flguard.simulation import task
from flguard.guard.report import METRIC_KEYS
from guard_settings import unclipped

SETTINGS = task.TaskSettings(batch_size=2, lr=0.05, local_steps=1, init="uniform")
OVERRIDES = {"batch-size": 2, "lr": 0.05, "local-steps": 1, "init": "uniform"}


pytestmark = pytest.mark.usefixtures("server_identity")  # tests/conftest.py


def _context() -> Context:
    return Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2},
                   state=RecordDict(), run_config={})


def _message(kind: str, model, steps: int = 1) -> Message:
    content = RecordDict({task.ARRAYS_KEY: task.to_arrays(model)})
    if kind == MessageType.TRAIN:
        content[task.CONFIG_KEY] = ConfigRecord({"lr": 0.05, "local-steps": steps, "batch-size": 2, "server-round": 1})
    return Message(content, dst_node_id=5, message_type=kind)


def _app(mods, guarded_handler: bool = True) -> ClientApp:
    app = ClientApp(mods=mods)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        if guarded_handler:
            return task.handle_train(message, context, task.settings_from(context, OVERRIDES))
        model = task.load_arrays(task.make_model(SETTINGS), message.content.array_records[task.ARRAYS_KEY])
        return task.train_reply(message, model, task.LocalUpdate(torch.zeros(1), torch.zeros(1), 0.0, 1, 1))

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return task.handle_evaluate(message, context, task.settings_from(context, OVERRIDES))

    return app


def _flat(arrays) -> torch.Tensor:
    return torch.cat([torch.as_tensor(a).reshape(-1) for a in arrays.to_numpy_ndarrays()])


def test_train_reply_is_the_unguarded_update_plus_exactly_the_reported_noise():
    model = task.make_model(SETTINGS)
    unguarded = _app([])(_message(MessageType.TRAIN, model), _context())
    guarded = _app([guard_mod(unclipped(defense="gaussian", min_rmse=0.05, seed=0))])(
        _message(MessageType.TRAIN, model), _context())
    assert not guarded.has_error()
    metrics = guarded.content.metric_records[task.METRICS_KEY]
    assert set(METRIC_KEYS) <= set(metrics) and metrics["guard_met"] == 1.0
    assert metrics["guard_min_rmse_after"] >= 0.05
    difference = _flat(guarded.content.array_records[task.ARRAYS_KEY]) - _flat(unguarded.content.array_records[task.ARRAYS_KEY])
    # FedSGD: θ1 = θ0 − lr·(g + δ), so the uploads differ by lr·‖δ‖
    torch.testing.assert_close(difference.norm().double(), torch.tensor(0.05 * metrics["guard_noise_norm"]).double(),
                               rtol=1e-4, atol=0)


def test_evaluate_passes_through_untouched_with_the_mod_app_wide():
    model = task.make_model(SETTINGS)
    plain = _app([])(_message(MessageType.EVALUATE, model), _context())
    wrapped = _app([guard_mod(unclipped())])(_message(MessageType.EVALUATE, model), _context())
    assert not wrapped.has_error()
    assert dict(wrapped.content.metric_records[task.METRICS_KEY]) == dict(plain.content.metric_records[task.METRICS_KEY])


def test_dropped_update_becomes_an_error_reply_with_the_reason():
    model = task.make_model(SETTINGS)
    strict = unclipped(defense="gaussian", min_rmse=0.05, max_rel_noise=1e-6)
    reply = _app([guard_mod(strict)])(_message(MessageType.TRAIN, model), _context())
    assert reply.has_error() and "budget" in reply.error.reason and not reply.has_content()


def test_a_handler_that_skips_the_guard_is_refused():
    model = task.make_model(SETTINGS)
    reply = _app([guard_mod(unclipped())], guarded_handler=False)(_message(MessageType.TRAIN, model), _context())
    assert reply.has_error() and "guard_step" in reply.error.reason


def test_multi_step_training_is_guarded_per_step_with_the_worst_step_reported():
    model = task.make_model(SETTINGS)
    app = _app([guard_mod(unclipped(defense="eigen", min_rmse=0.05, seed=1))])
    reply = app(_message(MessageType.TRAIN, model, steps=3), Context(
        run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
        run_config={"local-steps": 3}))
    assert not reply.has_error()
    metrics = reply.content.metric_records[task.METRICS_KEY]
    assert metrics["guard_met"] == 1.0 and metrics["guard_min_rmse_after"] >= 0.05


def test_run_config_configures_the_guard_and_bad_values_name_the_field():
    from flguard.flower import guard_mod_from_run_config

    model = task.make_model(SETTINGS)
    app = _app([guard_mod_from_run_config()])
    configured = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                         run_config={"guard-defense": "eigen", "guard-min-rmse": 0.05, "guard-seed": 2})
    reply = app(_message(MessageType.TRAIN, model), configured)
    assert not reply.has_error() and reply.content.metric_records[task.METRICS_KEY]["guard_met"] == 1.0
    bad = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                  run_config={"guard-defense": "eigen", "guard-min-rmse": -1.0})
    reply = app(_message(MessageType.TRAIN, model), bad)
    assert reply.has_error() and "GuardConfig.min_rmse" in reply.error.reason
    unguarded = app(_message(MessageType.TRAIN, model), _context())  # no guard-defense key: inert
    assert not unguarded.has_error() and "guard_met" not in unguarded.content.metric_records[task.METRICS_KEY]


def test_localdp_mod_chains_after_the_guard():
    from flwr.clientapp.mod import LocalDpMod

    model = task.make_model(SETTINGS)
    mods = [guard_mod(unclipped(defense="gaussian", min_rmse=0.05, seed=0)),
            LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=5.0, delta=1e-5)]
    reply = _app(mods)(_message(MessageType.TRAIN, model), _context())
    assert not reply.has_error()
    assert reply.content.metric_records[task.METRICS_KEY]["guard_met"] == 1.0
    evaluate = _app(mods[:1])(_message(MessageType.EVALUATE, model), _context())
    assert not evaluate.has_error()


def test_numpy_client_wrapper_guards_fit_and_refuses_unguarded_updates():
    import numpy as np
    import pytest
    from flwr.client import NumPyClient

    from flguard.flower.numpy_client import GuardedNumPyClient, UnguardedUpdate

    train, _ = task.load_partition(SETTINGS, 0, 2)

    class Client(NumPyClient):
        def __init__(self, guarded: bool):
            self.guarded = guarded

        def fit(self, parameters, config):
            model = task.make_model(SETTINGS)
            model.load_state_dict({k: torch.as_tensor(v) for k, v in zip(model.state_dict(), parameters)})
            if self.guarded:
                task.local_sgd(model, train, lr=0.05, steps=1, batch_size=2, generator=torch.Generator().manual_seed(0))
            return [v.numpy() for v in model.state_dict().values()], 2, {"train-loss": 0.0}

    start = [v.numpy() for v in task.make_model(SETTINGS).state_dict().values()]
    arrays, _, metrics = GuardedNumPyClient(Client(True), unclipped(min_rmse=0.05, seed=0)).fit(start, {})
    assert metrics["guard_met"] == 1.0 and set(METRIC_KEYS) <= set(metrics)
    plain, _, _ = Client(True).fit(start, {})
    moved = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(arrays, plain)))
    assert abs(moved - 0.05 * metrics["guard_noise_norm"]) <= 1e-3 * moved
    with pytest.raises(UnguardedUpdate):
        GuardedNumPyClient(Client(False)).fit(start, {})


def test_a_faked_secagg_stage_does_not_open_a_way_around_the_guard():
    """The guard lets SecAgg+ control stages through only when their reply holds no update."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    model = task.make_model(SETTINGS)
    message = _message(MessageType.TRAIN, model)
    message.content[RECORD_KEY_CONFIGS] = ConfigRecord({Key.STAGE: Stage.SETUP})  # no secaggplus_mod in the app
    reply = _app([guard_mod(unclipped())], guarded_handler=False)(message, _context())
    assert reply.has_error() and "guard_step" in reply.error.reason


class _ScalarAndIntegerModel(torch.nn.Module):
    """A 0-d trainable scale and an integer buffer: what Flower 1.41's DP mods mishandle."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc = torch.nn.Linear(6, 3)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.register_buffer("steps", torch.tensor(7, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.fc(x.flatten(1))


def _scalar_app(zero_gradient: bool = False, config: GuardConfig | None = None,
                step_size: float | None = None) -> ClientApp:
    """A one-step handler on ``_ScalarAndIntegerModel`` under ``guard_mod`` (the Gaussian by default);
    ``step_size``: handed to ``guard_step`` and used for the step (else 0.1, not handed over)."""
    from flwr.app import ArrayRecord, MetricRecord

    app = ClientApp(mods=[guard_mod(config or unclipped(defense="gaussian", min_rmse=0.05, seed=0))])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        model = _ScalarAndIntegerModel()
        x, y = torch.randn(2, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 2])
        params = list(model.parameters())
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
        if zero_gradient:
            grads = [torch.zeros_like(g) for g in grads]
        grads = guard_step(model, x, y, grads, step_size=step_size)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_((0.1 if step_size is None else step_size) * g)
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 2})}), reply_to=message)

    return app


def test_zero_d_integer_and_all_zero_updates_are_handled():
    message = _message(MessageType.TRAIN, task.make_model(SETTINGS))
    reply = _scalar_app(zero_gradient=False)(message, _context())
    assert not reply.has_error(), reply.error if reply.has_error() else None
    arrays = reply.content.array_records["arrays"].to_torch_state_dict()
    start = _ScalarAndIntegerModel().state_dict()
    assert arrays["steps"].dtype == torch.long and int(arrays["steps"]) == 7  # never touched
    assert arrays["scale"].shape == () and float(arrays["scale"]) != float(start["scale"])  # 0-d guarded and moved
    assert reply.content.metric_records["metrics"]["guard_met"] == 1.0
    # An all-zero gradient cannot meet a noise budget relative to its norm: a clean error, no crash.
    zero = _scalar_app(zero_gradient=True)(_message(MessageType.TRAIN, task.make_model(SETTINGS)), _context())
    assert zero.has_error() and "budget" in zero.error.reason


def _loop_app(mode: str) -> ClientApp:
    """A train handler with an ordinary optimizer loop over 3 batches, guarded in different ways."""
    from flguard import make_guarded

    app = ClientApp(mods=[guard_mod(unclipped(defense="gaussian", min_rmse=0.05, seed=0))])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        model = task.load_arrays(task.make_model(SETTINGS), message.content.array_records[task.ARRAYS_KEY])
        data, _ = task.load_partition(SETTINGS, 0, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        criterion = torch.nn.CrossEntropyLoss()
        if mode in ("make_guarded", "one-unguarded-step", "two-passes"):
            model, optimizer, criterion = make_guarded(model, optimizer, criterion)
        for step in range(3):
            x, y = data.normalize(data.images[2 * step:2 * step + 2]), data.labels[2 * step:2 * step + 2]
            if mode == "one-unguarded-step" and step == 2:  # a second, unwrapped optimizer sneaks a step in
                plain = torch.optim.SGD(model.parameters(), lr=0.05)
                plain.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                plain.step()
                continue
            optimizer.zero_grad()
            if mode == "two-passes":  # gradients accumulated over a batch of another size, then this one's
                criterion(model(data.normalize(data.images[10:13])), data.labels[10:13]).backward()
            loss = criterion(model(x), y)
            loss.backward()
            if mode == "guard_step-once" and step == 0:
                params = list(model.parameters())
                for p, g in zip(params, guard_step(model, x, y, [p.grad for p in params])):
                    p.grad = g
            optimizer.step()
        return task.train_reply(message, model, task.LocalUpdate(torch.zeros(1), torch.zeros(1), 0.0, 3, 2))

    return app


def test_make_guarded_under_the_mod_guards_every_step_and_reports():
    model = task.make_model(SETTINGS)
    reply = _loop_app("make_guarded")(_message(MessageType.TRAIN, model), _context())
    assert not reply.has_error(), reply.error
    metrics = reply.content.metric_records[task.METRICS_KEY]
    assert metrics["guard_met"] == 1.0 and metrics["guard_min_rmse_after"] >= 0.05 and metrics["guard_matvecs"] > 0


@pytest.mark.parametrize("mode,reason", [
    ("one-unguarded-step", "1 of 3 optimizer steps this round were not guarded"),
    ("guard_step-once", "2 of 3 optimizer steps this round were not guarded"),
    ("plain", "never guarded a step"),
    ("two-passes", "2 forward passes"),
])
def test_a_round_with_any_unguarded_step_is_an_error_reply(mode, reason):
    model = task.make_model(SETTINGS)
    reply = _loop_app(mode)(_message(MessageType.TRAIN, model), _context())
    assert reply.has_error() and not reply.has_content()
    assert reason in reply.error.reason and reply.error.reason.startswith("flguard: update withheld")


def _client_context(node_guard: dict, run_guard: dict) -> Context:
    return Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2, **node_guard},
                   state=RecordDict(), run_config=run_guard)


@pytest.mark.parametrize("run_guard,outcome", [
    ({}, 0.05),                                                       # unset: the client's own guard runs
    ({"guard-defense": ""}, 0.05),                                    # "" = unset, not "off"
    ({"guard-defense": "eigen", "guard-min-rmse": 0.1}, 0.1),         # stricter: allowed
    ({"guard-defense": "none"}, "defense='none' promises no floor"),
    ({"guard-defense": "pruning"}, "defense='pruning' promises no floor"),
    ({"guard-defense": "gaussian", "guard-min-rmse": 0.01}, "min_rmse=0.01 is weaker than the client's min_rmse=0.05"),
    ({"guard-defense": "gaussian", "guard-min-rmse": 0.05, "guard-on-unmet": "max-noise"}, "on_unmet='max-noise'"),
])
@pytest.mark.parametrize("where", ["node-config", "code"])
def test_the_run_config_cannot_switch_off_or_lower_the_clients_guard(run_guard, outcome, where):
    from flguard.flower import guard_mod_from_run_config

    client = {"guard-defense": "gaussian", "guard-min-rmse": 0.05}
    mod = (guard_mod_from_run_config() if where == "node-config"
           else guard_mod_from_run_config(minimum=unclipped(defense="gaussian", min_rmse=0.05)))
    context = _client_context(client if where == "node-config" else {}, run_guard)
    model = task.make_model(SETTINGS)
    reply = _app([mod])(_message(MessageType.TRAIN, model), context)
    if isinstance(outcome, str):
        assert reply.has_error() and outcome in reply.error.reason and "lower the client's guard" in reply.error.reason
    else:
        assert not reply.has_error(), reply.error
        metrics = reply.content.metric_records[task.METRICS_KEY]
        assert metrics["guard_met"] == 1.0 and metrics["guard_min_rmse_after"] >= outcome


def test_without_a_client_floor_the_run_config_still_chooses():
    from flguard.flower import guard_mod_from_run_config

    model = task.make_model(SETTINGS)
    unguarded = _app([guard_mod_from_run_config()])(_message(MessageType.TRAIN, model), _client_context({}, {}))
    assert not unguarded.has_error() and "guard_met" not in unguarded.content.metric_records[task.METRICS_KEY]
    guarded = _app([guard_mod_from_run_config()])(_message(MessageType.TRAIN, model), _client_context(
        {}, {"guard-defense": "gaussian", "guard-min-rmse": 0.05}))
    assert guarded.content.metric_records[task.METRICS_KEY]["guard_met"] == 1.0


@pytest.mark.parametrize("defense", ["gaussian", "eigen"])
def test_the_uploaded_arrays_meet_the_floor_under_an_independent_dense_i2f(defense):
    """What left the client, not what the guard reports: δ is read off the uploaded arrays and each
    sample's I²F is recomputed from autograd Jacobians with ``torch.linalg`` (issue 14 §5)."""
    from risk_reference import dense_jacobians

    torch.manual_seed(3)
    tiny = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Tanh(), torch.nn.Flatten(),
                               torch.nn.Linear(2 * 4 * 4, 3)).double()
    x, y, lr, tau = torch.randn(3, 1, 6, 6, dtype=torch.float64), torch.tensor([0, 2, 1]), 0.05, 0.3
    app = ClientApp(mods=[guard_mod(unclipped(defense=defense, min_rmse=tau, max_rel_noise=1e4))])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        model = task.load_arrays(tiny, message.content.array_records[task.ARRAYS_KEY])
        params = list(model.parameters())
        grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
        with torch.no_grad():
            for p, g in zip(params, guard_step(model, x, y, grads)):
                p -= lr * g
        return task.train_reply(message, model, task.LocalUpdate(x, y, 0.0, 1, 3))

    start = torch.cat([p.detach().reshape(-1).clone() for p in tiny.parameters()])
    jac, g = dense_jacobians(tiny, x, y)
    content = RecordDict({task.ARRAYS_KEY: task.to_arrays(tiny),
                          task.CONFIG_KEY: ConfigRecord({"lr": lr, "local-steps": 1, "batch-size": 3, "server-round": 1})})
    reply = app(Message(content, dst_node_id=5, message_type=MessageType.TRAIN), _context())
    assert not reply.has_error(), reply.error
    uploaded = _flat(reply.content.array_records[task.ARRAYS_KEY]).double()
    delta = (start - uploaded) / lr - g  # θ1 = θ0 − lr·(g + δ): the noise that was actually sent
    assert float(delta.norm()) > 0
    kernel = jac @ jac.transpose(1, 2)
    eps = 1e-2 * torch.linalg.eigvalsh(kernel)[:, -1]  # the default ε = 1e-2·λmax, from eigh
    eye = torch.eye(jac.shape[1], dtype=jac.dtype)
    shift = torch.linalg.solve(kernel + eps.view(-1, 1, 1) * eye, (jac @ delta).unsqueeze(-1)).squeeze(-1)
    rmse = shift.norm(dim=1) / jac.shape[1] ** 0.5
    assert bool((rmse >= tau).all()), rmse


def test_guard_step_hands_the_step_size_to_auto():
    """With a step at which the Gaussian's noise would swamp the weights, ``auto`` sends its aimed noise,
    which needs less of it: the reply's noise norm drops, and both replies meet the floor."""
    config = unclipped(defense="auto", min_rmse=0.05, seed=0, subspace_size=2, krylov_steps=4)
    replies = [_scalar_app(config=config, step_size=step)(_message(MessageType.TRAIN, task.make_model(SETTINGS)), _context())
               for step in (1e-9, 1e6)]
    for reply in replies:
        assert not reply.has_error(), reply.error if reply.has_error() else None
        assert reply.content.metric_records["metrics"]["guard_met"] == 1.0
    small, large = (reply.content.metric_records["metrics"]["guard_noise_norm"] for reply in replies)
    assert large < 0.9 * small, (small, large)
