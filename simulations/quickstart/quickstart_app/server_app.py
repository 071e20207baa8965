"""quickstart_app: the ServerApp — FedAvg, as in Flower's quickstart-pytorch."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from quickstart_app.task import Net

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_train: float = float(context.run_config.get("fraction-train", 1.0))
    num_rounds: int = int(context.run_config.get("num-server-rounds", 2))
    config = {key: context.run_config[key] for key in ("lr", "local-epochs", "batch-size", "dataset")
              if key in context.run_config}

    global_model = Net(str(config.get("dataset", "mnist5k")))
    arrays = ArrayRecord(global_model.state_dict())

    strategy = FedAvg(fraction_train=fraction_train)
    result = strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord(config),
                            evaluate_config=ConfigRecord(config), num_rounds=num_rounds)

    print("\nSaving final model to disk...")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
