"""A Flower app in the shape of Flower's quickstart-pytorch (our own code), guarded by flguard."""
