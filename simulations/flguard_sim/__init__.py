"""flguard's Flower app: FedAvg on MNIST-5k, optionally with a simulated malicious server."""
