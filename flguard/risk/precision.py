"""IEEE float32 on CUDA devices for the products and solves that a certificate rests on.

On a CUDA device PyTorch lets cuDNN run float32 convolutions in TF32 by default (a 10-bit mantissa:
relative errors near 1e-3), and a user may allow TF32 matrix products too. The guard's solves are
verified to rtol 1e-2 … 1e-3 and its floor is certified from them: its Jacobian products and linear
algebra must run in the float32 they claim. Inside ``exact_float32(device)`` both run in IEEE float32;
on a CPU it changes nothing. The user's own training keeps their setting outside it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable)

#: How closely a float32 gradient computed on a CUDA device can be expected to match a recomputation of it:
#: the user's side runs TF32 convolutions by default (and cuDNN may pick other algorithms from call to call),
#: errors near 1e-3 of the summands; one ResNet-18-GN step in six on an H200 exceeded 1e-3 against the
#: guard's IEEE float32 per-sample sum. Consistency checks that only catch the gradient of another loss
#: (what is sent is the guard's own recomputation) allow this on such gradients.
TF32_GRADIENT_RTOL = 1e-2


def gradient_rtol(gradient: torch.Tensor, exact: float) -> float:
    """The relative tolerance for checking ``gradient`` against a recomputation: ``exact`` (what float32
    or float64 rounding allows), raised to ``TF32_GRADIENT_RTOL`` for a float32 gradient on a CUDA device."""
    if gradient.is_cuda and gradient.dtype == torch.float32:
        return max(exact, TF32_GRADIENT_RTOL)
    return exact


@contextlib.contextmanager
def exact_float32(device: torch.device | str) -> Iterator[None]:
    """IEEE float32 for cuDNN convolutions and CUDA matrix products inside, when ``device`` is a CUDA
    device; the previous settings are restored on exit."""
    if torch.device(device).type != "cuda":
        yield
        return
    with ieee_float32():
        yield


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """TF32 off for cuDNN and CUDA matrix products inside, whichever of PyTorch's two interfaces the
    settings were made through: the legacy ``allow_tf32`` flags, or (where reading those raises
    because the settings were made through the newer ``fp32_precision`` one) the newer interface."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    try:
        saved = (cudnn.allow_tf32, matmul.allow_tf32)
    except RuntimeError:  # set through fp32_precision: PyTorch refuses to read them as one legacy flag
        saved = None
    if saved is not None:  # touch only what allows TF32, so that nothing else changes on the way out
        flags = [(owner, "allow_tf32", True) for owner, on in zip((cudnn, matmul), saved) if on]
    else:
        flags = [(owner, "fp32_precision", owner.fp32_precision) for owner in (cudnn.conv, matmul)
                 if owner.fp32_precision != "ieee"]
    for owner, name, _ in flags:
        setattr(owner, name, False if name == "allow_tf32" else "ieee")
    try:
        yield
    finally:
        for owner, name, value in flags:
            setattr(owner, name, value)


def on_exact_float32(method: F) -> F:
    """A method of an object with a ``device`` run inside ``exact_float32(self.device)``."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with exact_float32(self.device):
            return method(self, *args, **kwargs)
    return wrapped  # type: ignore[return-value]
