"""Model zoo: the architectures the source papers attack and measure.

``create(name, ...)`` is the one entry point; every model takes ``in_channels`` and
``image_size`` so that MNIST (1x28x28), LFW faces (1x25x25) and CIFAR (3x32x32) all work.
"""

from flguard.models.zoo import MODEL_NAMES, create
from flguard.models.init import INIT_NAMES, initialize

__all__ = ["create", "initialize", "MODEL_NAMES", "INIT_NAMES"]
