"""quickstart_app: the ClientApp — train and evaluate handlers, as in Flower's quickstart-pytorch.

The local hyperparameters (``lr``, ``local-epochs``, ``batch-size``) and the ``dataset`` come with the
server's train / evaluate config, defaulting to the quickstart's values.
"""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flguard.flower import GuardConfig, guard_mod
from quickstart_app.task import Net, load_data
from quickstart_app.task import test as test_fn
from quickstart_app.task import train as train_fn

# Flower ClientApp
app = ClientApp(mods=[guard_mod(GuardConfig(defense="gaussian", min_rmse=0.1, max_rel_noise=100.0))])


def _settings(msg: Message) -> dict:
    config = msg.content.config_records.get("config") or {}
    return {"lr": float(config.get("lr", 0.01)), "local-epochs": int(config.get("local-epochs", 1)),
            "batch-size": int(config.get("batch-size", 32)), "dataset": str(config.get("dataset", "mnist5k"))}


def _model_and_data(msg: Message, context: Context, settings: dict):
    """The received global model on this node's device, and this node's train / test loaders."""
    model = Net(settings["dataset"])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader, valloader = load_data(partition_id, num_partitions, settings["batch-size"], settings["dataset"])
    return model, device, trainloader, valloader


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    settings = _settings(msg)
    model, device, trainloader, _ = _model_and_data(msg, context, settings)

    train_loss = train_fn(model, trainloader, settings["local-epochs"], settings["lr"], device)

    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    settings = _settings(msg)
    model, device, _, valloader = _model_and_data(msg, context, settings)

    eval_loss, eval_acc = test_fn(model, valloader, device)

    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader.dataset)}
    content = RecordDict({"metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)
