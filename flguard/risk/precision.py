"""IEEE float32 for the products and solves that a certificate rests on, whatever the user's precision.

On a CUDA device PyTorch lets cuDNN run float32 convolutions in TF32 by default (a 10-bit mantissa:
relative errors near 1e-3), and a user may allow TF32 matrix products too; a mixed-precision loop runs its
forward pass under ``torch.autocast`` (bfloat16 or float16: relative errors near 1e-2 … 1e-3). The guard's
solves are verified to rtol 1e-2 … 1e-3 and its floor is certified from them: its Jacobian products and linear
algebra must run in the float32 they claim. Inside ``exact_float32(device)`` they do: autocast off on every
device type, and on a CUDA device TF32 off too. The user's own training keeps their settings outside it.
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
#: The same for a gradient whose forward pass ran under ``torch.autocast``, checked against a recomputation under
#: the same autocast: on a CPU the two agree to the last bit (measured: bfloat16 on a GroupNorm ResNet-8); on a CUDA
#: device cuDNN may pick other half-precision kernels from call to call. What is sent is the guard's own float32
#: recomputation, so the tolerance only decides which mistakes in the loop (another loss, accumulated batches) are
#: named; an accumulated second batch moves the gradient by about its own norm.
AUTOCAST_GRADIENT_RTOL = 5e-2

#: The device types whose autocast ``autocast_state`` reads and ``autocast_as`` sets (``torch.amp``'s own list
#: of those with an autocast; the ones this PyTorch has are kept at import).
AUTOCAST_DEVICE_TYPES = tuple(device_type for device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia")
                              if torch.amp.is_autocast_available(device_type))

#: Autocast as it stands at a point of the program: the device types it is on for, each with its dtype.
AutocastState = tuple[tuple[str, torch.dtype], ...]


def gradient_rtol(gradient: torch.Tensor, exact: float, autocast: AutocastState = ()) -> float:
    """The relative tolerance for checking ``gradient`` against a recomputation: ``exact`` (what float32
    or float64 rounding allows), raised to ``AUTOCAST_GRADIENT_RTOL`` where its forward pass ran under ``autocast``
    and to ``TF32_GRADIENT_RTOL`` for a float32 gradient on a CUDA device."""
    if autocast:
        return max(exact, AUTOCAST_GRADIENT_RTOL)
    if gradient.is_cuda and gradient.dtype == torch.float32:
        return max(exact, TF32_GRADIENT_RTOL)
    return exact


def autocast_state() -> AutocastState:
    """The device types with autocast on here, each with its dtype (empty where a pass runs in its own dtypes)."""
    return tuple((device_type, torch.get_autocast_dtype(device_type)) for device_type in AUTOCAST_DEVICE_TYPES
                 if torch.is_autocast_enabled(device_type))


@contextlib.contextmanager
def autocast_as(state: AutocastState) -> Iterator[None]:
    """Autocast exactly as ``state`` inside: on with its dtype for each of its device types, off for every other
    one that is on here; the previous state is restored on exit."""
    wanted = dict(state)
    with contextlib.ExitStack() as stack:
        for device_type in AUTOCAST_DEVICE_TYPES:
            if device_type in wanted:
                stack.enter_context(torch.autocast(device_type, dtype=wanted[device_type]))
            elif torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@contextlib.contextmanager
def exact_float32(device: torch.device | str) -> Iterator[None]:
    """Float32 as it claims to be inside: autocast off on every device type (a mixed-precision loop may call the
    guard inside its ``torch.autocast`` block) and, when ``device`` is a CUDA device, IEEE float32 for cuDNN
    convolutions and CUDA matrix products; the previous settings are restored on exit."""
    with autocast_as(()):
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
