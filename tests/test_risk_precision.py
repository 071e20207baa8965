"""``exact_float32``: no TF32 in the guard's products and solves on a CUDA device, the user's settings
restored — through PyTorch's legacy flags and through its newer fp32_precision interface."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flguard.risk.precision import exact_float32, ieee_float32


def _run(code: str) -> str:
    """In a fresh interpreter: the TF32 settings are process-wide and the two interfaces cannot be mixed back."""
    done = subprocess.run([sys.executable, "-c", "import torch\nfrom flguard.risk.precision import ieee_float32\n"
                           "b = torch.backends\n" + code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_legacy_flags_are_switched_off_inside_and_restored_untouched():
    inside = _run("with ieee_float32():\n    print(b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32)\n"
                         "print(b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32, b.cudnn.conv.fp32_precision,"
                         " b.cuda.matmul.fp32_precision)")
    values = _run("b.cuda.matmul.allow_tf32 = True\nwith ieee_float32():\n"
                  "    print(b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32)\n"
                  "print(b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32, b.cudnn.conv.fp32_precision)")
    assert values == ["False", "False", "True", "True", "tf32"]
    # PyTorch's defaults: cuDNN allows TF32, matrix products do not; only the first is touched
    assert list(inside) == ["False", "False", "True", "False", "tf32", "none"]


def test_settings_made_through_fp32_precision_are_switched_through_it():
    values = _run("b.cudnn.conv.fp32_precision = 'tf32'; b.cudnn.rnn.fp32_precision = 'ieee'\n"
                  "b.cuda.matmul.fp32_precision = 'tf32'\n"
                  "try:\n    b.cudnn.allow_tf32\nexcept RuntimeError:\n    print('mixed')\n"
                  "with ieee_float32():\n    print(b.cudnn.conv.fp32_precision, b.cuda.matmul.fp32_precision)\n"
                  "print(b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision, b.cuda.matmul.fp32_precision)")
    assert values == ["mixed", "ieee", "ieee", "tf32", "ieee", "tf32"]


def test_on_a_cpu_nothing_changes():
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    with exact_float32("cpu"):
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_convolutions_and_products_inside_are_ieee_float32():
    """A float32 convolution's input gradient and a matrix product inside agree with float64 to 1e-5 of
    their size; TF32's 10-bit mantissa errs near 1e-3 (printed for the record outside)."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, 32, 32, device="cuda")
    w = torch.randn(64, 64, 3, 3, device="cuda") / 24
    a, m = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")

    def errors() -> tuple[float, float]:
        conv = torch.nn.functional.conv2d(x, w, padding=1)
        exact = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
        product = a @ m
        return (float((conv - exact).norm() / exact.norm()),
                float((product - a.double() @ m.double()).norm() / (a.double() @ m.double()).norm()))
    with exact_float32("cuda"):
        conv, product = errors()
    print("outside (the user's settings):", errors(), "inside:", (conv, product))
    assert conv < 1e-5 and product < 1e-5, (conv, product)


def test_gradient_checks_allow_tf32_only_on_cuda_float32():
    """The consistency checks' tolerance: the exact one on the CPU and in float64; TF32's on CUDA float32."""
    from flguard.risk.precision import TF32_GRADIENT_RTOL, gradient_rtol
    assert gradient_rtol(torch.zeros(3), 1e-4) == 1e-4
    assert gradient_rtol(torch.zeros(3, dtype=torch.float64), 1e-3) == 1e-3
    if torch.cuda.is_available():
        assert gradient_rtol(torch.zeros(3, device="cuda"), 1e-4) == TF32_GRADIENT_RTOL
        assert gradient_rtol(torch.zeros(3, device="cuda", dtype=torch.float64), 1e-4) == 1e-4


def test_exact_float32_switches_autocast_off_inside_and_back_on_outside():
    """A mixed-precision loop may call the guard inside ``torch.autocast``: a convolution and a matrix product inside
    ``exact_float32`` run in float32 and match float64 to float32's rounding; outside, bfloat16 errs near 1e-3."""
    from flguard.risk.precision import autocast_as, autocast_state
    torch.manual_seed(0)
    x, w = torch.randn(2, 8, 10, 10), torch.randn(8, 8, 3, 3) / 8
    exact = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)

    def conv_error() -> tuple[torch.dtype, float]:
        out = torch.nn.functional.conv2d(x, w, padding=1)
        return out.dtype, float((out.double() - exact).norm() / exact.norm())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half_dtype, half_error = conv_error()
        with exact_float32("cpu"):
            inside_dtype, inside_error = conv_error()
            assert autocast_state() == ()
        assert autocast_state() == (("cpu", torch.bfloat16),)  # restored
        with autocast_as(()), autocast_as((("cpu", torch.float16),)):
            assert autocast_state() == (("cpu", torch.float16),)
    assert autocast_state() == ()
    assert half_dtype == torch.bfloat16 and half_error > 1e-3, half_error
    assert inside_dtype == torch.float32 and inside_error < 1e-6, inside_error


def test_gradient_checks_allow_half_precision_after_autocast():
    from flguard.risk.precision import AUTOCAST_GRADIENT_RTOL, gradient_rtol
    assert gradient_rtol(torch.zeros(3), 1e-4, (("cpu", torch.bfloat16),)) == AUTOCAST_GRADIENT_RTOL
    assert gradient_rtol(torch.zeros(3), 1e-4, ()) == 1e-4
