"""The guard on ResNet-shaped colour models: the model check and fix, channels-last inputs, the
defaults (median clipping) against dense float64 I²F, and the per-step limit failing closed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flguard import Guard, GuardConfig, UnsupportedModel, check_model, fix_model, make_guarded
from flguard.guard import GuardFailure
from flguard.models import create
from flguard.risk.operator import JacobianOperator
from risk_reference import assert_certified_on_dense_float64

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


def _resnet18():
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10)


def test_check_model_names_every_batchnorm_of_torchvision_resnet18_and_fix_model_replaces_them():
    model = _resnet18()
    problems = check_model(model)
    batchnorms = [name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(batchnorms) == 20 and len(problems) == 20
    assert problems[0].startswith("bn1: BatchNorm2d") and "fix_model" in problems[0]
    assert any(p.startswith("layer2.0.downsample.1: BatchNorm2d") for p in problems)
    with torch.no_grad():
        model.bn1.weight.uniform_(0.5, 1.5)
    fixed = fix_model(model)
    assert check_model(fixed) == []
    assert len(check_model(model)) == 20  # not in place: the original keeps its BatchNorm
    assert isinstance(fixed.bn1, nn.GroupNorm) and fixed.bn1.num_groups == 32 and fixed.bn1.num_channels == 64
    assert torch.equal(fixed.bn1.weight, model.bn1.weight) and fixed.bn1.weight is not model.bn1.weight
    assert sum(p.numel() for p in fixed.parameters()) == sum(p.numel() for p in model.parameters())
    assert fixed(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_check_model_lists_dropout_in_train_mode_and_running_instancenorm():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True), nn.Flatten(),
                          nn.AlphaDropout(0.3), nn.Linear(4 * 30 * 30, 2))  # nn.Dropout is replayed: not listed
    problems = check_model(model)
    assert [p.split(":")[0] for p in problems] == ["1", "3"]
    model[3].eval()
    assert len(check_model(model)) == 1
    assert check_model(create("resnet18_gn")) == [] and check_model(create("resnet8_gn")) == []


def test_make_guarded_and_guard_refuse_batchnorm_before_the_first_step_naming_fix_model():
    model = _resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedModel, match=r"(?s)layer1\.0\.bn1: BatchNorm2d.*fix_model"):
        make_guarded(model, optimizer, nn.CrossEntropyLoss(), GuardConfig(pixel_mean=MEAN, pixel_std=STD))
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    with pytest.raises(UnsupportedModel, match="BatchNorm"):
        Guard(GuardConfig()).protect(model, x, y, torch.zeros(sum(p.numel() for p in model.parameters())))
    fixed = fix_model(model)  # after the fix the same call is accepted
    make_guarded(fixed, torch.optim.SGD(fixed.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                 GuardConfig(pixel_mean=MEAN, pixel_std=STD))


def test_a_batchnorm_switched_on_after_wrapping_is_refused_at_the_step():
    model = create("resnet8_gn", image_size=8)
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               nn.CrossEntropyLoss(), GuardConfig(pixel_mean=MEAN, pixel_std=STD))
    model.layers[0].norm1 = nn.BatchNorm2d(4)
    optimizer.zero_grad()
    criterion(model(torch.randn(3, 3, 8, 8)), torch.tensor([0, 1, 2])).backward()
    with pytest.raises(GuardFailure, match="BatchNorm2d"):
        optimizer.step()
    assert all(p.grad is None for p in model.parameters())


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("defense,products,device", [
    ("gaussian", "cached", "cpu"), ("gaussian", "direct", "cpu"), ("eigen", "direct", "cpu"),
    ("rowspace", "cached", "cpu"), ("rowspace", "direct", "cpu"), ("resolvent", "cached", "cpu"),
    ("resolvent", "direct", "cpu"), ("resolvent", "direct-1", "cpu"), ("eigen", "direct-1", "cpu"),
    ("gaussian", "direct-vmap", "cpu"), ("resolvent", "direct-vmap", "cpu"),
    pytest.param("gaussian", "cached", "cuda", marks=CUDA), pytest.param("gaussian", "direct", "cuda", marks=CUDA),
    pytest.param("eigen", "direct", "cuda", marks=CUDA), pytest.param("resolvent", "cached", "cuda", marks=CUDA),
    pytest.param("resolvent", "direct", "cuda", marks=CUDA), pytest.param("resolvent", "ghost", "cuda", marks=CUDA),
    pytest.param("gaussian", "ghost", "cuda", marks=CUDA)])
def test_median_clipping_on_a_channels_last_resnet_matches_dense_float64_i2f(defense, products, device, monkeypatch):
    """make_guarded with median clipping, exclusion and the 15 dB pixel floor (its pixel box, ε =
    1e-2·λmax) on a 3-channel GroupNorm ResNet fed channels-last inputs: the noise actually applied
    gives every kept sample a dense-recomputed, box-clipped I²F RMSE ≥ τ, and the report's values
    agree with the dense ones — with the cached products and with the direct ones that large models
    take (two samples per chunk here, on a CUDA device too; "direct-1": one sample at a time, with plain
    autograd, as a ResNet-18's on the CPU), on the CPU and on a CUDA device (the reference always on the CPU). On
    the CPU the guard's operator runs both on the batched ghost products; "direct-vmap" keeps the vmapped chunks of
    two samples that a model the ghost products refuse takes there (``GUARD_GHOST_ON_CPU`` off); "ghost" on a CUDA
    device: the batched ghost products there too (``GUARD_GHOST_ON_CUDA``, off by default)."""
    from flguard.risk import sizing
    torch.manual_seed(0)
    monkeypatch.setattr(sizing, "GUARD_GHOST_ON_CUDA", products == "ghost")
    model = create("resnet8_gn", image_size=6).double()
    if products.startswith("direct"):
        dtheta = sum(p.numel() for p in model.parameters())
        monkeypatch.setattr(sizing, "CACHED_UP_TO", (1 if products == "direct-1" else 2) * dtheta)
        monkeypatch.setattr(sizing, "CUDA_CHUNK_SHARE", 0.0)  # a CUDA device's chunks as small as the CPU's
        monkeypatch.setattr(sizing, "CUDA_CACHED_SHARE", 0.0)  # and no cached pullbacks there either
        monkeypatch.setattr(sizing, "GUARD_GHOST_ON_CPU", products != "direct-vmap")
    x = torch.rand(4, 3, 6, 6, dtype=torch.float64)
    x = ((x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)).to(
        memory_format=torch.channels_last)
    y = torch.tensor([0, 3, 5, 7])
    # a CUDA generator draws other noise from the same seed: the draw that needs 83× the clipping norm here
    # (CPU seeds 0 and 7 do too, 1–6 need under 40×); the test is of the certificate, not the budget
    config = GuardConfig(defense=defense, pixel_mean=MEAN, pixel_std=STD, seed=3, clip_per_sample="median",
                         max_excluded=0.25, max_rel_noise=40.0 if device == "cpu" else 1000.0, rtol=1e-2)
    model, optimizer, criterion = make_guarded(model.to(device), torch.optim.SGD(model.parameters(), lr=0.0),
                                               nn.CrossEntropyLoss(), config)
    optimizer.zero_grad()
    criterion(model(x.to(device)), y.to(device)).backward()
    optimizer.step()
    report = optimizer.guard_reports[0]
    assert report.met
    model.cpu()
    assert_certified_on_dense_float64(model, x, y, config, report)


@pytest.mark.parametrize("products", ["cached", "direct", "direct-1"])
def test_a_small_vision_transformer_is_guarded_and_certified_against_dense_float64_i2f(products, monkeypatch):
    """torchvision's VisionTransformer (patch convolution, class token, LayerNorm, nn.MultiheadAttention, GELU MLP)
    through make_guarded, with the cached products and the direct ones (two samples per chunk, and one at a time):
    its attention's default CPU kernel (flash) has no second derivative, so every step was withheld, and PyTorch's
    LayerNorm gave wrong products (worst on the direct path); the guard's forward runs both in plain operators
    (``flguard.risk.functional``), and the noise sent certifies every kept sample against dense float64 I²F (the
    reference's double derivatives on the math attention kernel, which autograd and forward mode both
    differentiate, and PyTorch's LayerNorm, whose plain double derivatives are right)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flguard.risk import sizing

    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(image_size=6, patch_size=3, num_layers=1, num_heads=2, hidden_dim=8,
                                                 mlp_dim=16, num_classes=10).double()
    if products.startswith("direct"):
        dtheta = sum(p.numel() for p in model.parameters())
        monkeypatch.setattr(sizing, "CACHED_UP_TO", (1 if products == "direct-1" else 2) * dtheta)
    x = (torch.rand(4, 3, 6, 6, dtype=torch.float64) - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(
        STD).view(1, 3, 1, 1)
    y = torch.tensor([0, 3, 5, 7])
    config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, seed=3, clip_per_sample="median", max_excluded=0.25,
                         max_rel_noise=40.0, rtol=1e-2)
    model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                               nn.CrossEntropyLoss(), config)
    optimizer.zero_grad()
    criterion(model(x), y).backward()  # the user's own step: the default kernel
    optimizer.step()
    report = optimizer.guard_reports[0]
    assert report.met, report.reason
    with sdpa_kernel(SDPBackend.MATH):
        assert_certified_on_dense_float64(model, x, y, config, report)


def test_channels_last_float32_is_computed_on_contiguous_inputs():
    """torch 2.14's CPU kernel for the weight gradient of a strided 1×1 convolution (ResNet's shortcut)
    on channels-last float32 inputs is wrong; the operator's products use the same values laid out
    contiguously, so they match the float64 reference."""
    torch.manual_seed(0)
    model = create("resnet8_gn", image_size=8)
    x, y = torch.randn(3, 3, 8, 8), torch.tensor([0, 1, 2])
    v = torch.randn(3, 1, sum(p.numel() for p in model.parameters()))
    channels_last = JacobianOperator(model, x.to(memory_format=torch.channels_last), y)
    reference = JacobianOperator(model.double(), x.double(), y)
    torch.testing.assert_close(channels_last.per_sample_gradients().double(), reference.per_sample_gradients(),
                               rtol=1e-4, atol=1e-5)
    model.float()
    torch.testing.assert_close(channels_last.j(v).double(), reference.j(v.double()), rtol=1e-3, atol=1e-4)


def test_the_step_limit_withholds_naming_the_limit():
    torch.manual_seed(0)
    model = create("resnet8_gn", image_size=8)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    for field, value in (("max_products", 3), ("max_seconds", 1e-4)):
        config = GuardConfig(pixel_mean=MEAN, pixel_std=STD, **{field: value})
        model, optimizer, criterion = make_guarded(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                   nn.CrossEntropyLoss(), config)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        with pytest.raises(GuardFailure, match=f"{field}={value:g}"):
            optimizer.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert optimizer.guard_reports[-1].met is False


def test_none_switches_the_default_limit_off_and_both_survive_the_run_config():
    from flguard.flower.guard_mod import guard_config_from_run_config, guard_run_config

    config = GuardConfig(clip_per_sample="median", max_products=None)
    assert config.max_products is None and GuardConfig(max_products="none").max_products is None
    assert guard_config_from_run_config(guard_run_config(config)) == config
    assert guard_config_from_run_config(guard_run_config(GuardConfig())).max_products == GuardConfig().max_products
    with pytest.raises(ValueError, match="clip_per_sample"):
        GuardConfig(clip_per_sample=0.0)
