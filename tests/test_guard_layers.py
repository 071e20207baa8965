"""The layers practitioners' image models are built of, in the guard's products and the attacks' objectives.

Each layer sits in a small conv net; the operator's K products on the cached path and the direct one (vmapped
chunks, and one sample at a time with plain autograd, as a ResNet-18's on a CPU), in float64 and float32, are
checked against the dense K_i = J_iJ_iᵀ built column by column with plain reverse-over-reverse autograd in float64
(``risk_reference``). The guard's forward pass rewrites some layers (``flguard.risk.functional``): attention,
softmaxes and ``Hardsigmoid``, whose kernels lack a derivative the products take (every step withheld), and
LayerNorm and InstanceNorm, whose kernels' derivatives in the products' compositions are wrong (K off by 0.1–0.3%
on the cached path and 2–33% on the direct one: certificates on wrong numbers), and the recurrent layers, whose
kernels fail under ``vmap`` (``flguard.risk.recurrent``). Their references are independent: attention on PyTorch's
math kernel, Hardsigmoid written as a clamp, the norms and the recurrent layers by PyTorch's own kernels, whose plain
double backward is right. The model check lists every layer that drops at random while training, torchvision's and
timm's included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from flguard import check_model
from flguard.risk.operator import JacobianOperator
from risk_reference import dense_jacobians


class _Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _tokens_attention(x: torch.Tensor) -> torch.Tensor:
    """Self-attention over the pixels as tokens, through ``F.scaled_dot_product_attention``."""
    tokens = x.flatten(2).transpose(1, 2).unsqueeze(1)
    return F.scaled_dot_product_attention(tokens, tokens, tokens).squeeze(1).transpose(1, 2).reshape(x.shape)


class _ChannelsLastLayerNorm(nn.LayerNorm):
    """ConvNeXt's: LayerNorm over the channels of a channels-last view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _channels_last_layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x.permute(0, 2, 3, 1), (4,)).permute(0, 3, 1, 2)


class _MultiheadSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2).transpose(1, 2)
        return self.attention(tokens, tokens, tokens, need_weights=False)[0].transpose(1, 2).reshape(x.shape)


class _Recurrent(nn.Module):
    """A recurrent layer over the pixels as a sequence (N, 16, 4) — or (16, N, 4) sequence-first — its output back
    in the image's shape (4 features: the hidden size, or twice it bidirectional, or the LSTM's projection)."""

    def __init__(self, cell: type[nn.RNNBase], hidden: int = 4, **options) -> None:
        super().__init__()
        self.batch_first = options.setdefault("batch_first", True)
        self.rnn = cell(4, hidden, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2).transpose(1, 2)
        out = self.rnn(tokens if self.batch_first else tokens.transpose(0, 1))[0]
        return (out if self.batch_first else out.transpose(0, 1)).transpose(1, 2).reshape(x.shape)


class _Cells(nn.Module):
    """A cell module (``nn.LSTMCell``, ``nn.GRUCell``, ``nn.RNNCell``) stepped by hand over the pixels as a sequence (16
    steps of 4 features, the state starting at zero), each step's output back in the image's shape."""

    def __init__(self, cell: type[nn.RNNCellBase], **options) -> None:
        super().__init__()
        self.cell = cell(4, 4, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, state, steps = x.flatten(2).transpose(1, 2), None, []
        for t in range(tokens.shape[1]):
            state = self.cell(tokens[:, t], state)
            steps.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(steps, 2).reshape(x.shape)


def _frozen_batchnorm() -> nn.Module:
    """A pretrained BatchNorm's eval-mode map, kept in any mode (``fix_model(model, batchnorm="frozen")``)."""
    from flguard.guard import FrozenBatchNorm

    norm = nn.BatchNorm2d(4)
    with torch.no_grad():
        for tensor, low, high in ((norm.running_mean, -0.5, 0.5), (norm.running_var, 0.5, 2.0),
                                  (norm.weight, 0.5, 1.5), (norm.bias, -0.3, 0.3)):
            tensor.uniform_(low, high)
    return FrozenBatchNorm.from_batchnorm(norm)


LAYERS = {
    "hardsigmoid": (lambda: nn.Hardsigmoid(), lambda: _Lambda(lambda x: torch.clamp(x / 6 + 0.5, 0, 1))),
    "hardswish": (lambda: nn.Hardswish(), None), "silu": (lambda: nn.SiLU(), None), "gelu": (lambda: nn.GELU(), None),
    "mish": (lambda: nn.Mish(), None), "elu": (lambda: nn.ELU(), None), "prelu": (lambda: nn.PReLU(), None),
    "max_pool": (lambda: nn.MaxPool2d(2), None), "adaptive_avg_pool": (lambda: nn.AdaptiveAvgPool2d(2), None),
    "bilinear_upsample": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), None),
    "group_norm": (lambda: nn.GroupNorm(2, 4), None), "frozen_batchnorm": (_frozen_batchnorm, None),
    "instance_norm": (lambda: nn.InstanceNorm2d(4, affine=True), None),
    "instance_norm_without_affine": (lambda: nn.InstanceNorm2d(4), None),
    "layer_norm": (lambda: nn.LayerNorm([4, 4, 4]), None),
    "layer_norm_without_bias": (lambda: nn.LayerNorm([4, 4, 4], bias=False), None),
    "channels_last_layer_norm": (lambda: _ChannelsLastLayerNorm(4), None),
    "functional_layer_norm": (lambda: _Lambda(_channels_last_layer_norm), None),
    "rms_norm": (lambda: nn.RMSNorm([4, 4, 4]), None),
    "depthwise_conv": (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4), None),
    "reflect_padded_conv": (lambda: nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), None),
    "transposed_conv": (lambda: nn.ConvTranspose2d(4, 4, 2, stride=2), None),
    "squeeze_excitation": (lambda: _Lambda(lambda x: x * torch.sigmoid(F.adaptive_avg_pool2d(x, 1))), None),
    "scaled_dot_product_attention": (lambda: _Lambda(_tokens_attention), None),
    "multihead_attention": (_MultiheadSelfAttention, None),
    "softmax_over_channels": (lambda: nn.Softmax(dim=1), None),
    "log_softmax_over_channels": (lambda: nn.LogSoftmax(dim=1), None),
    "lstm": (lambda: _Recurrent(nn.LSTM), None),
    "lstm_stacked_bidirectional_projected": (
        lambda: _Recurrent(nn.LSTM, hidden=3, num_layers=2, bidirectional=True, proj_size=2), None),
    "gru_sequence_first": (lambda: _Recurrent(nn.GRU, batch_first=False), None),
    "gru_stacked_without_bias": (lambda: _Recurrent(nn.GRU, num_layers=2, bias=False), None),
    "rnn_tanh": (lambda: _Recurrent(nn.RNN), None),
    "rnn_relu_bidirectional": (lambda: _Recurrent(nn.RNN, hidden=2, nonlinearity="relu", bidirectional=True), None),
    "lstm_cell": (lambda: _Cells(nn.LSTMCell), None),
    "gru_cell_without_bias": (lambda: _Cells(nn.GRUCell, bias=False), None),
    "rnn_relu_cell": (lambda: _Cells(nn.RNNCell, nonlinearity="relu"), None),
}


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("name", list(LAYERS))
def test_each_layer_runs_in_the_products_and_matches_dense_float64(name, device):
    """In float64 and float32; on a CUDA device the products run there (its own kernels), the reference on the CPU."""
    layer, reference_layer = LAYERS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), layer(), nn.Flatten(), nn.LazyLinear(3)).double()
    x, y = torch.randn(3, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2])
    model(x)  # the lazy layer's shape
    reference = model
    if reference_layer is not None:
        reference = nn.Sequential(model[0], reference_layer(), model[2], model[3])
    with sdpa_kernel(SDPBackend.MATH):
        jac, _ = dense_jacobians(reference, x, y)
    kernel = jac @ jac.transpose(1, 2)
    u = torch.randn(3, 2, jac.shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = torch.einsum("bij,bkj->bki", kernel, u)
    for dtype in (torch.float64, torch.float32):  # float32: the kernels users train with (measured: ≤ 1e-6)
        model.to(device, dtype)
        for products, chunk in (("cached", None), ("direct", 2), ("direct", 1)):
            op = JacobianOperator(model, x.to(device, dtype), y.to(device), products=products)
            if chunk is not None:  # vmapped chunks of two samples, or one at a time with plain autograd
                op.sample_chunk = chunk
            got = op.kmv(u.to(device, dtype)).cpu().double()
            where = f"{name} in {dtype} on the {products} path, chunks of {chunk}"
            if dtype == torch.float64:
                torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12, msg=where)
            else:
                assert float((got - expected).norm() / expected.norm()) < 1e-5, where


def test_the_attacks_gradient_matching_differentiates_through_attention():
    """The attacks' observer (what a candidate input would upload) on a small ViT: its gradient at the true input
    is the client's, and the matching loss's input gradient — a second derivative, which the default attention
    kernel does not have — agrees with a central finite difference, for one candidate (autograd) and two (vmap)."""
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    from flguard.attacks.objectives import GradientObserver, l2_matching

    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(image_size=6, patch_size=3, num_layers=1, num_heads=2, hidden_dim=8,
                                                 mlp_dim=16, num_classes=4).double()
    x, y = torch.randn(1, 3, 6, 6, dtype=torch.float64), torch.tensor([2])
    target = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    observer = GradientObserver(model)
    for uploaded, sent in zip(observer(x.unsqueeze(0), y.unsqueeze(0)), target):
        torch.testing.assert_close(uploaded[0], sent, rtol=1e-10, atol=1e-12)
    start = torch.randn(2, 1, 3, 6, 6, dtype=torch.float64)
    direction = torch.randn_like(start)
    labels = y.expand(2, 1)

    def matching(candidates: torch.Tensor) -> torch.Tensor:
        uploads = observer(candidates, labels[:len(candidates)])
        return torch.stack([l2_matching([u[r] for u in uploads], target) for r in range(len(candidates))]).sum()

    for candidates in (start[:1], start):  # one candidate: autograd; two: vmap
        leaf = candidates.clone().requires_grad_(True)
        slope = float((torch.autograd.grad(matching(leaf), leaf)[0] * direction[:len(candidates)]).sum())
        h = 1e-5
        step = h * direction[:len(candidates)]
        finite = float(matching(candidates + step) - matching(candidates - step)) / (2 * h)
        assert slope == pytest.approx(finite, rel=1e-6)


def test_check_model_lists_every_layer_that_drops_at_random_while_training_and_is_not_replayed():
    torchvision = pytest.importorskip("torchvision")

    class DropPath(nn.Module):  # timm's, by name and attribute
        def __init__(self, drop_prob: float) -> None:
            super().__init__()
            self.drop_prob = drop_prob

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = nn.Sequential(nn.Linear(4, 4), torchvision.ops.StochasticDepth(0.1, "row"), DropPath(0.2),
                          nn.MultiheadAttention(4, 2, dropout=0.3), torchvision.ops.StochasticDepth(0.0, "row"),
                          DropPath(0.0), nn.MultiheadAttention(4, 2))
    problems = check_model(model)  # attention dropout is replayed (tests/test_guard_dropout.py): not listed
    assert [p.split(":")[0] for p in problems] == ["1", "2"]
    assert "StochasticDepth(p=0.1)" in problems[0] and "DropPath(drop_prob=0.2)" in problems[1]
    assert "fix_model" in problems[0]
    model[1].eval()
    assert len(check_model(model)) == 1
    convnext = torchvision.models.convnext_tiny(num_classes=10)  # stochastic depth 0.1 by default, no BatchNorm
    assert sum("StochasticDepth" in p for p in check_model(convnext)) == 17  # 18 blocks, the first at p = 0
    assert check_model(torchvision.models.convnext_tiny(num_classes=10, stochastic_depth_prob=0.0)) == []


def test_a_convnext_block_runs_batched_on_the_cached_path():
    """torchvision's ConvNeXt (LayerNorm on a permuted, channels-last view, then global average pooling): the cached
    K product runs without ``vmap``'s per-sample fallback (the pooling kernel's double backward on a channels-last
    gradient takes an ``as_strided_`` it has no batching rule for; the guard pools by a mean), and matches the direct
    path's one-sample products."""
    convnext = pytest.importorskip("torchvision.models.convnext")
    torch.manual_seed(0)
    model = convnext.ConvNeXt([convnext.CNBlockConfig(8, 16, 1), convnext.CNBlockConfig(16, None, 1)],
                              stochastic_depth_prob=0.0, num_classes=4).double()
    x, y = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 3])
    u = torch.randn(3, 1, x[0].numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = JacobianOperator(model, x, y, products="cached").kmv(u)
    assert not [w for w in caught if "batching rule" in str(w.message)]
    torch.testing.assert_close(cached, JacobianOperator(model, x, y, products="direct").kmv(u), rtol=1e-9, atol=1e-12)


class _Attend(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        other = 6 if variant == "other_key_width" else None
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True, kdim=other, vdim=other)
        self.keys = nn.Linear(8, other or 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        given = {"bool_mask": {"attn_mask": causal},
                 "float_mask": {"attn_mask": torch.randn(length, length, generator=torch.Generator().manual_seed(0),
                                                         dtype=x.dtype)},
                 "per_sample_head_mask": {"attn_mask": causal.expand(x.shape[0] * 2, length, length)},
                 "key_padding": {"key_padding_mask": torch.arange(length).expand(x.shape[0], length) >= length - 1},
                 "causal_hint": {"attn_mask": causal, "is_causal": True},
                 "weights": {"need_weights": True}, "per_head_weights": {"need_weights": True,
                                                                          "average_attn_weights": False}}
        kwargs = {"need_weights": False, **given.get(self.variant, {})}
        out, weights = self.attention(x, self.keys(x), self.keys(x), **kwargs)
        return out if weights is None else out + weights.sum()


@pytest.mark.parametrize("variant", ["plain", "bool_mask", "float_mask", "per_sample_head_mask", "key_padding",
                                     "causal_hint", "weights", "per_head_weights", "other_key_width"])
def test_multi_head_attention_in_plain_operators_equals_pytorchs(variant, monkeypatch):
    """``nn.MultiheadAttention`` through the guard's forward pass (its softmax in plain operators: PyTorch's has a
    forward-mode rule whose output reverse mode cannot differentiate, so one-sample products through attention
    failed) gives PyTorch's own outputs, with its masks, weights and projections."""
    import flguard.risk.functional as functional

    calls = []
    rewrite = functional._multi_head_attention
    monkeypatch.setattr(functional, "_multi_head_attention", lambda *a, **k: calls.append(1) or rewrite(*a, **k))
    torch.manual_seed(0)
    model = _Attend(variant).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    expected = model(x)
    got = functional.functional_forward(model, dict(model.named_parameters()), x)
    assert calls, "the rewrite was not taken"
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
