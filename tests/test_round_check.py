"""The client refuses a round up front when a tensor the server sent jumped in scale (issue 23 §2):
closed-form jumps, then the guard mod on the quickstart CNN over honest, fished and dead-network
rounds — the fished and dead ones refused before the handler runs, the honest ones trained."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from flguard import GuardConfig
from flguard.flower import guard_mod, weaker_fields
from flguard.flower.round_check import MODEL_KEY, outlier_tensors, parameter_jumps, tensor_scales
from flguard.guard.failure import SUSPICIOUS
from flguard.server.fishing import fish_class
from flguard.simulation import task

SETTINGS = task.TaskSettings(model="cnn", batch_size=4, lr=0.05, local_steps=2, init="default")
OVERRIDES = {"model": "cnn", "batch-size": 4, "lr": 0.05, "local-steps": 2, "init": "default"}


pytestmark = pytest.mark.usefixtures("server_identity")  # tests/conftest.py


def test_jumps_are_the_change_of_each_tensors_rms_in_units_of_its_scale_or_the_median_tensors():
    assert "steps" not in tensor_scales({"w": np.ones(2), "steps": np.arange(3)})  # integer buffers are skipped
    # zero-initialised tensors (biases, GroupNorm shifts) are measured, but set no unit: the median is of the rest
    assert tensor_scales({"w": np.full(2, 0.5), "b1": np.zeros(2), "b2": np.zeros(3)})[MODEL_KEY] == 0.5
    previous = tensor_scales({"w": np.full(4, 1.0), "b": np.zeros(2), "v": np.full(3, 0.5)})
    assert previous == {"w": 1.0, "b": 0.0, "v": 0.5, MODEL_KEY: 0.75}  # the median of the nonzero scales
    current = tensor_scales({"w": np.full(4, -2.0), "b": np.array([0.3, -0.3]), "v": np.full(3, 1000.0)})
    assert current[MODEL_KEY] == 2.0  # the median: the blown-up tensor does not set the unit
    jumps = parameter_jumps(current, previous)
    assert jumps["w"] == pytest.approx(1.0)  # |2 − 1| / max(1, 0.75)
    assert jumps["b"] == pytest.approx(0.3 / 0.75)  # a zero tensor is measured in the median tensor's unit
    assert jumps["v"] == pytest.approx(999.5 / 0.75)
    assert outlier_tensors(current) == {"w": 1.0, "b": pytest.approx(0.15), "v": 500.0}
    assert parameter_jumps({"new": 5.0, MODEL_KEY: 1.0}, previous) == {}  # a tensor not seen before is not compared


def _message(model: torch.nn.Module, server_round: int) -> Message:
    content = RecordDict({task.ARRAYS_KEY: task.to_arrays(model),
                          task.CONFIG_KEY: ConfigRecord({"lr": 0.05, "local-steps": 2, "batch-size": 4,
                                                         "server-round": server_round})})
    return Message(content, dst_node_id=5, message_type=MessageType.TRAIN)


def test_the_guard_mod_refuses_fished_and_dead_rounds_up_front_and_trains_the_honest_ones():
    handled = []
    app = ClientApp(mods=[guard_mod(GuardConfig(defense="gaussian", seed=0, max_param_jump=100.0))])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        handled.append(int(message.content.config_records[task.CONFIG_KEY]["server-round"]))
        return task.handle_train(message, context, task.settings_from(context, OVERRIDES))

    context = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config={})
    torch.manual_seed(0)
    model = task.make_model(SETTINGS)

    honest_jumps = []

    def scales(net: torch.nn.Module) -> dict[str, float]:
        return tensor_scales({name: value.numpy() for name, value in net.state_dict().items()})

    def run(sent: torch.nn.Module, server_round: int) -> Message:
        reply = app(_message(sent, server_round), context)
        if not reply.has_error():  # one client: the next global model is its own (guarded) update
            before = scales(model)
            model.load_state_dict(task.load_arrays(task.make_model(SETTINGS),
                                                   reply.content.array_records[task.ARRAYS_KEY]).state_dict())
            honest_jumps.append(max(parameter_jumps(scales(model), before).values()))
        return reply

    for server_round in (1, 2):  # the first round has nothing to compare with; the second moved a little
        assert not run(model, server_round).has_error()
    fished = run(fish_class(model, 3), 3)  # the classifier's other biases at 1000: out of scale, no history needed
    assert fished.has_error() and fished.error.reason.startswith(f"flguard: update withheld: {SUSPICIOUS}")
    assert "'fc3.bias'" in fished.error.reason and "median tensor" in fished.error.reason
    dead = task.make_model(SETTINGS)
    dead.load_state_dict(model.state_dict())
    with torch.no_grad():
        dead.fc2.bias.fill_(-1000.0)  # every ReLU of the last hidden layer off
    refused = run(dead, 4)
    assert refused.has_error() and "'fc2.bias'" in refused.error.reason
    jumped = task.make_model(SETTINGS)
    jumped.load_state_dict(model.state_dict())
    with torch.no_grad():
        jumped.fc3.bias.mul_(200.0)  # in scale with the model (~200× its median), but 200× its last round
    refused = run(jumped, 5)
    assert refused.has_error() and "'fc3.bias'" in refused.error.reason and "jump of" in refused.error.reason
    assert not run(model, 6).has_error()  # back to the honest model: compared with round 2 as well, accepted
    assert handled == [1, 2, 6]  # the refused rounds never reached the training code
    assert max(honest_jumps) < 1.0, honest_jumps  # guarded local SGD moves no tensor by its own scale


def test_the_run_config_cannot_drop_or_relax_the_clients_check():
    minimum = GuardConfig(defense="gaussian", max_param_jump=100.0)
    assert weaker_fields(GuardConfig(defense="gaussian", max_param_jump=50.0), minimum) == []
    for laxer in (None, 1000.0):
        (problem,) = weaker_fields(GuardConfig(defense="gaussian", max_param_jump=laxer), minimum)
        assert "max_param_jump" in problem
