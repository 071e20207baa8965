"""The batched K product with ghost per-sample weight gradients (``flguard.risk.ghost_products``) against dense float64
Jacobians: a channels-last 3-channel GroupNorm ResNet-shaped model with every convolution setting the rewrite handles
(grouped and depthwise included) and a ConvNeXt-shaped one (LayerNorm, a layer scale, a position embedding), both ways
of taking a convolution's inner product (Gram matrices, formed weight), graphs kept or rebuilt in chunks, and a
ViT-shaped one (a class token, self-attention batch first and sequence first), 1-D convolutions, and weights used
several times (a convolution applied twice, recurrent layers and cells); torchvision's MobileNetV3, ConvNeXt and
VisionTransformer against the one-sample loop; and the models it refuses, whose products stay the loop's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flguard.risk import direct, ghost_convolutions, ghost_forward, ghost_products
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.ghost_convolutions import Convolution
from flguard.risk.ghost_forward import Unsupported, ghost_support
from flguard.risk.ghost_products import GhostKmv
from flguard.risk.operator import JacobianOperator
from risk_reference import dense_jacobians


def test_pass_ones_bytes_are_measured_once_per_model_and_input_shape(monkeypatch):
    """A guard builds a new operator at every step: pass 1's bytes per sample are measured at the first one and reused
    for the same model, input shape and parameters (its graphs kept, so that building them checks the forward pass);
    another input shape is measured again."""
    model = _model()
    x, y = _batch()
    measured = []
    original = GhostKmv._measure
    monkeypatch.setattr(GhostKmv, "_measure", lambda self: measured.append(1) or original(self))

    def ghost(x: torch.Tensor, y: torch.Tensor) -> GhostKmv:
        op = JacobianOperator(model, x, y, products="direct")
        return GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    first, again = ghost(x, y), ghost(x[:2], y[:2])
    assert len(measured) == 1 and again.sample_bytes == first.sample_bytes and again.retained
    ghost(torch.randn(3, 3, 8, 11, dtype=torch.float64), y)
    assert len(measured) == 2


def test_the_patches_count_in_the_memory_not_in_a_products_overhead(monkeypatch):
    """A ``Patched`` layer keeps its input's patches in pass 1's graph: counted in the bytes per sample (the memory),
    not in ``overhead_rows``' bytes (a row's work) — measured on the quickstart CNN's two layers: 1 → 6 channels,
    5×5 on 28×28 (25 × 576 floats a sample) and 6 → 16 on 12×12 (150 × 64), against the model with no layer patched."""
    from flguard.models.zoo import QuickstartCNN

    torch.manual_seed(0)
    model = QuickstartCNN(1, 10, 28)
    x, y = torch.randn(3, 1, 28, 28), torch.tensor([0, 1, 2])

    def ghost() -> GhostKmv:
        ghost_products._MEASURED.clear()
        op = JacobianOperator(model, x, y, products="direct")
        return GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    patched = ghost()
    monkeypatch.setattr(ghost_forward, "PATCHED_BELOW_CHANNELS", 0)
    plain = ghost()
    assert patched.patch_bytes == 4 * (25 * 576 + 150 * 64) and plain.patch_bytes == 0
    # the patches replace the two layers' saved inputs (1 × 28² and 6 × 12² floats)
    assert patched.sample_bytes == plain.sample_bytes + patched.patch_bytes - 4 * (28 * 28 + 6 * 144)
    assert patched.overhead_rows == pytest.approx(ghost_products.FIXED_BYTES_PER_PARAMETER * 10
                                                  / (plain.sample_bytes - 4 * (28 * 28 + 6 * 144)))


def test_an_operator_given_the_measure_knows_the_patch_bytes_before_it_builds(monkeypatch):
    """A GhostKmv given an earlier one's measure (a restricted copy's ``measured``) that rebuilds its graphs at each
    product (not kept) knows the patches' bytes before its first build: its ``overhead_rows`` — what the shrinking
    solve weighs a rebuild against — is the measuring one's from the start, not the bytes per sample's with the
    patches read as a row's work."""
    from flguard.models.zoo import QuickstartCNN

    torch.manual_seed(0)
    model = QuickstartCNN(1, 10, 28)
    op = JacobianOperator(model, torch.randn(3, 1, 28, 28), torch.tensor([0, 1, 2]), products="direct")
    ghost_products._MEASURED.clear()
    first = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    monkeypatch.setattr(ghost_products, "RETAINED_BYTES", 0)
    later = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y, first.measured)
    assert later.graphs is None and later.measured == first.measured == (first.sample_bytes, 4 * (25 * 576 + 150 * 64))
    assert later.overhead_rows == first.overhead_rows


class Block(nn.Module):
    """A ResNet block that halves the map: strided 3×3 convolution with a bias, GroupNorm, a grouped dilated convolution
    with uneven padding, and a strided 1×1 shortcut."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.norm1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=(2, 1), dilation=(2, 1), bias=False, groups=3)
        self.norm2 = nn.GroupNorm(3, cout)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride=2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


def _model() -> nn.Module:
    """Reflect-padded stem → depthwise convolution (two outputs per channel) → GroupNorm → ReLU → Block → pooling →
    Linear on [B, 4, 6] → Linear, float64."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
            self.depthwise = nn.Conv2d(4, 8, 3, padding=1, groups=4)
            self.norm = nn.GroupNorm(2, 8)
            self.block = Block(8, 6)
            self.mix = nn.Linear(6, 5)  # on [B, positions, channels]: a Linear with an inner batch dimension
            self.head = nn.Linear(20, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = F.adaptive_avg_pool2d(self.block(F.relu(self.norm(self.depthwise(self.stem(x))))), 2)
            return self.head(torch.tanh(self.mix(z.flatten(2).transpose(1, 2))).flatten(1))
    return Net().double()


class _ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: a depthwise 7×7 convolution, LayerNorm over channels-last features, an inverted fully connected
    bottleneck on [B, H, W, C], and a layer scale (a parameter of the block itself) on the residual branch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.norm = nn.LayerNorm(width)
        self.expand = nn.Linear(width, 2 * width)
        self.project = nn.Linear(2 * width, width)
        self.layer_scale = nn.Parameter(torch.rand(width, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.depthwise(x).permute(0, 2, 3, 1))
        return x + self.layer_scale * self.project(F.gelu(self.expand(h))).permute(0, 3, 1, 2)


def _convnext_model() -> nn.Module:
    """A patchify stem → ConvNeXt block → tokens with an added position embedding ([1, N, D]) → LayerNorm → mean →
    Linear, float64: the parameters that enter elementwise beside the activations."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 2, stride=2)
            self.block = _ConvNeXtBlock(4)
            self.position = nn.Parameter(0.1 * torch.randn(1, 16, 4))
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tokens = self.block(self.stem(x)).flatten(2).transpose(1, 2) + self.position
            return self.head(self.norm(tokens).mean(1))
    return Net().double()


class _ViT(nn.Module):
    """A vision transformer as torchvision writes one: 2×2 patches by a strided convolution, a class token [1, 1, D]
    expanded to the batch and put first, a position embedding, a pre-norm block — ``nn.MultiheadAttention`` in
    self-attention (batch first, or sequence first: tokens [L, N, D]) and a GELU MLP over the tokens — a final
    LayerNorm and a head on the class token."""

    def __init__(self, batch_first: bool = True, width: int = 4) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.patches = nn.Conv2d(3, width, 2, stride=2)
        self.class_token = nn.Parameter(0.1 * torch.randn(1, 1, width))
        self.position = nn.Parameter(0.1 * torch.randn(1, 17, width))
        self.norm1, self.norm2, self.norm = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=batch_first)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.class_token.expand(x.shape[0], -1, -1), tokens], dim=1) + self.position
        h = self.norm1(tokens) if self.batch_first else self.norm1(tokens).transpose(0, 1)
        attended = self.attention(h, h, h, need_weights=False)[0]
        tokens = tokens + (attended if self.batch_first else attended.transpose(0, 1))
        tokens = tokens + self.mlp(self.norm2(tokens))
        return self.head(self.norm(tokens)[:, 0])


class _CrossAttention(nn.Module):
    """Cross-attention as an encoder-decoder writes it: the image's 16 patch tokens split in two, the first half
    attending to the second through ``nn.MultiheadAttention`` with biases — one packed projection applied to queries,
    keys and values, or (``separate``) keys and values of their own width through q's, k's and v's own weights."""

    def __init__(self, separate: bool) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 4, 2, stride=2)
        self.memory = nn.Linear(4, 6 if separate else 4)
        width = 6 if separate else None
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True, kdim=width, vdim=width)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = torch.tanh(self.patches(x).flatten(2).transpose(1, 2))
        memory = torch.tanh(self.memory(tokens[:, 8:]))
        return self.head(self.attention(tokens[:, :8], memory, memory, need_weights=False)[0].mean(1))


def _vit_model(batch_first: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return _ViT(batch_first).double()


def _batch(batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(batch, 3, 8, 9, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    return x, torch.arange(batch) % 3


def _dense_jacobians(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, dx, dθ] of the batch loss, attention on PyTorch's "math" kernel (its flash kernel has no double backward)."""
    with sdpa_kernel(SDPBackend.MATH):
        return dense_jacobians(model, x, y)[0]


def _dense_k(model: nn.Module, x: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    jac = _dense_jacobians(model, x, y)
    return torch.einsum("bap,bkp->bka", jac, torch.einsum("bap,bka->bkp", jac, u))


class _Recurrent(nn.Module):
    """An image as a sequence (6 steps of 36 features) through a recurrent layer, the last step to a head."""

    def __init__(self, cell: str, **settings) -> None:
        super().__init__()
        self.rnn = getattr(nn, cell)(36, 5, batch_first=True, **settings)
        width = settings.get("proj_size", 0) or 5
        self.head = nn.Linear(width * (2 if settings.get("bidirectional") else 1), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x.reshape(x.shape[0], 6, 36))[0][:, -1])


class _CellLoop(nn.Module):
    """An ``nn.LSTMCell`` stepped by hand over the same 6 steps, its last state to a head."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(36, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, state = x.reshape(x.shape[0], 6, 36), None
        for t in range(6):
            state = self.cell(steps[:, t], state)
        return self.head(state[0])


class _Series(nn.Module):
    """A time series' 1-D convolutions (the image as 3 channels of 72 steps): strided and padded, GroupNorm, a grouped
    dilated one and a reflect-padded one (``F.pad`` before the convolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv1d(3, 6, 5, stride=2, padding=2)
        self.norm = nn.GroupNorm(2, 6)
        self.grouped = nn.Conv1d(6, 6, 3, padding=2, dilation=2, groups=3)
        self.reflect = nn.Conv1d(6, 4, 3, padding=1, padding_mode="reflect")
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.norm(self.first(x.reshape(x.shape[0], 3, -1))))
        return self.head(torch.tanh(self.reflect(torch.tanh(self.grouped(z)))).mean(2))


class _ProjectedConstant(nn.Module):
    """Features gated by a projection of a constant expanded to the batch: a fully connected layer whose input the
    batch does not reach, but whose weight's per-sample gradient δ_i ⊗ c does depend on x_i (pass 1 once pruned it,
    and the products dropped that term)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.gate = nn.Linear(5, 4)
        self.register_buffer("constant", torch.randn(1, 5))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.tanh(self.conv(x)).mean((2, 3))
        return self.head(features * self.gate(self.constant.expand(x.shape[0], -1)))


def _recurrent_model(cell: str, **settings) -> nn.Module:
    torch.manual_seed(0)
    return _Recurrent(cell, **settings).double()


SHAPES = {"ResNet": lambda: _model(), "ConvNeXt": lambda: _convnext_model(), "ViT": lambda: _vit_model(),
          "ViT sequence first": lambda: _vit_model(batch_first=False),
          "cross-attention": lambda: (torch.manual_seed(0), _CrossAttention(separate=False).double())[1],
          "cross-attention, q, k and v weights of their own": lambda: (torch.manual_seed(0),
                                                                      _CrossAttention(separate=True).double())[1],
          "a convolution used twice": lambda: _TwiceUsed().double(),
          "1-D convolutions": lambda: (torch.manual_seed(0), _Series().double())[1],
          "a projection of a constant": lambda: (torch.manual_seed(0), _ProjectedConstant().double())[1],
          "LSTM": lambda: _recurrent_model("LSTM"),
          "stacked LSTM with a projection": lambda: _recurrent_model("LSTM", num_layers=2, proj_size=3),
          "bidirectional GRU": lambda: _recurrent_model("GRU", bidirectional=True),
          "ReLU RNN": lambda: _recurrent_model("RNN", nonlinearity="relu"),
          "LSTMCell stepped by hand": lambda: (torch.manual_seed(0), _CellLoop().double())[1]}


#: The shapes with convolutions, whose formed weight can also run with the batch folded into a convolution's groups
CONVOLUTIONAL = ("ResNet", "ConvNeXt", "a convolution used twice", "1-D convolutions", "a projection of a constant")
#: (Gram matrices, the batch folded into groups, convolutions of fewer channels than this taken on their patches)
ROUTES = {"Gram matrices": (True, False, 16), "formed weight on patches": (False, False, 16),
          "Gram matrices, no layer on its patches": (True, False, 0),
          "formed weight on patches, no layer on its patches": (False, False, 0),
          "formed weight by grouped convolutions": (False, True, 0)}


@pytest.mark.parametrize("route,kept,shape", [
    (route, kept, shape) for route in ROUTES for kept in (True, False) for shape in SHAPES
    if (ROUTES[route][2] or shape in CONVOLUTIONAL) and (not ROUTES[route][1] or (kept and shape in CONVOLUTIONAL))],
    ids=lambda value: {True: "graphs kept", False: "rebuilt in chunks of 2"}.get(value, value))
def test_ghost_k_product_matches_the_dense_jacobian(route, kept, shape, monkeypatch):
    """The K product, the clipping's images, J of a shared vector, the per-sample gradients and the summed Jᵀ against
    dense float64 Jacobians, on a ResNet-shaped model (grouped and depthwise convolutions among the settings), a
    ConvNeXt-shaped one (LayerNorm, a layer scale, a position embedding), a ViT-shaped one (a class token,
    ``nn.MultiheadAttention`` batch first and sequence first), cross-attention (the packed projection, or q's, k's and
    v's weights of their own), a time series' 1-D convolutions, a layer whose input the
    batch does not reach, and models that use one weight several times — a convolution applied twice, recurrent layers
    and a cell stepped by hand (W_hh at each of 6 steps): the cross terms between a weight's uses are in every
    product. The formed weight both on patches and as grouped convolutions of the batch (every layer, 1×1 and few
    channels included, where the rule takes patches); convolutions of few channels taken on their input's patches
    (``Patched``, the default) and as convolutions."""
    gram, folded, patched = ROUTES[route]
    monkeypatch.setattr(ghost_convolutions, "ghost_cheaper", lambda layer, positions=None: gram)
    monkeypatch.setattr(ghost_convolutions.Convolution, "folds_batch", lambda layer: folded)
    monkeypatch.setattr(ghost_forward, "PATCHED_BELOW_CHANNELS", patched)
    if not kept:
        monkeypatch.setattr(ghost_products, "RETAINED_BYTES", 0)
    model = SHAPES[shape]()
    assert ghost_support(model) is None
    x, y = _batch()
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    ghost = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    if not kept:  # two samples' graphs to a chunk
        ghost.chunk = 2
    assert ghost.retained == kept and (ghost.graphs is not None) == kept
    u = torch.randn(3, 2, op.dx, dtype=torch.float64)
    want = _dense_k(model, x, y, u)
    for _ in range(2):  # the second product on the same (kept or rebuilt) graphs
        torch.testing.assert_close(op.scale ** 2 * ghost(u), want, rtol=1e-9, atol=1e-12)
    unscaled = _dense_jacobians(model, x, y) / op.scale
    torch.testing.assert_close(ghost.gradient_images(),
                               torch.einsum("bap,bp->ba", unscaled, op.per_sample_gradients()), rtol=1e-9, atol=1e-12)
    v = torch.randn(op.dtheta, dtype=torch.float64)
    torch.testing.assert_close(ghost.shared_j(v), torch.einsum("bap,p->ba", unscaled, v), rtol=1e-9, atol=1e-12)
    # the per-sample gradients from pass 1, against plain autograd on each sample alone
    each = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
            for i in range(len(x))]
    torch.testing.assert_close(ghost.sample_gradients(), torch.stack([torch.cat([t.reshape(-1) for t in g])
                                                                      for g in each]), rtol=1e-9, atol=1e-12)
    # Σ_iJ̃_iᵀu_i: pass 2 alone, summed (twice: a kept graph serves again, a rebuilt one is built again)
    for _ in range(2):
        torch.testing.assert_close(ghost.transposed_sum(u[:, 0]), torch.einsum("bap,ba->p", unscaled, u[:, 0]),
                                   rtol=1e-9, atol=1e-12)


def test_the_direct_path_takes_the_ghost_product_one_sample_at_a_time_and_clipped():
    model = _model()
    x, y = _batch()
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    assert op.one_at_a_time and op.ghost_products
    u = torch.randn(3, 1, op.dx, dtype=torch.float64)
    jac, _ = dense_jacobians(model, x, y)
    torch.testing.assert_close(op.kmv(u), _dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    assert op._ghost is not None and getattr(op, "ghost_refused", None) is None
    # clipped at the median norm: K̄_iu = s_i²J_i(I − ĝ_iĝ_iᵀ)J_iᵀu against the dense blocks and gradients
    clip = float(op.per_sample_gradients().norm(dim=1).median())
    clipped = ClippedJacobian(op, clip)
    g = op.per_sample_gradients() * op.scale
    norms = op.per_sample_gradients().norm(dim=1)
    factor = torch.where(norms > clip, clip / norms, torch.ones_like(norms))
    unit = g / g.norm(dim=1, keepdim=True)
    rows = torch.einsum("bap,ba->bp", jac, u[:, 0])
    projected = torch.where((norms > clip).unsqueeze(1), rows - (rows * unit).sum(1, keepdim=True) * unit, rows)
    want = factor.square().unsqueeze(1) * torch.einsum("bap,bp->ba", jac, projected)
    torch.testing.assert_close(clipped.kmv(u)[:, 0], want, rtol=1e-9, atol=1e-12)
    # one v for every sample (the noise): J_iv and the clipped J̄_iv = s_iJ_iP_iv in one batched pass
    noise = torch.randn(op.dtheta, dtype=torch.float64)
    shared = noise.expand(3, -1).unsqueeze(1)
    before = op.applications
    torch.testing.assert_close(op.j(shared)[:, 0], torch.einsum("bap,p->ba", jac, noise), rtol=1e-9, atol=1e-12)
    assert op.applications - before == 1
    projected_noise = torch.where((norms > clip).unsqueeze(1), noise - (unit @ noise).unsqueeze(1) * unit, noise)
    torch.testing.assert_close(clipped.j(shared)[:, 0],
                               factor.unsqueeze(1) * torch.einsum("bap,bp->ba", jac, projected_noise),
                               rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.gradient_images(), torch.einsum("bap,bp->ba", jac, op.per_sample_gradients()),
                               rtol=1e-9, atol=1e-12)
    # the summed Jᵀ product (resolvent noise's) through the graphs, plain and clipped: Σ_i s_iP_iJ_iᵀu_i
    before = op.applications
    torch.testing.assert_close(op.jt_sum(u[:, 0]), torch.einsum("bap,ba->p", jac, u[:, 0]), rtol=1e-9, atol=1e-12)
    assert op.applications - before == 1
    torch.testing.assert_close(clipped.jt_sum(u[:, 0]), (factor.unsqueeze(1) * projected).sum(0),
                               rtol=1e-9, atol=1e-12)
    # a restricted copy builds graphs of its own rows
    sub = op.restricted(torch.tensor([2, 0]))
    torch.testing.assert_close(sub.kmv(u[[2, 0]]), _dense_k(model, x, y, u)[[2, 0]], rtol=1e-9, atol=1e-12)
    assert sub._ghost is not op._ghost


def _small_cnn() -> nn.Module:
    """The quickstart CNN's shape on 3 channels: a first convolution on the input itself (pass 2 skips its input
    gradient), pooling, fully connected layers on [B, features] (one position each), float64."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 5, 2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(5 * 2 * 2, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def test_products_ghost_takes_the_batched_products_where_the_cached_path_would_run():
    """``products="ghost"`` (the guard's operator on a CPU): a batch the cached pullbacks would hold runs one sample
    at a time with the batched ghost products on graphs built at once — its K product, summed Jᵀ, clipping images and the
    noise's J against the dense blocks; a model whose forward pass refuses them, or graphs too large to keep, stay
    cached."""
    model = _small_cnn()
    x, y = _batch(4)
    op = JacobianOperator(model, x, y, products="ghost")
    assert op.direct and op.one_at_a_time and op._ghost is not None and op._ghost.retained
    assert [layer.reads_input for layer in op._ghost.graphs[0].layers] == [True, False, False, False]
    assert not JacobianOperator(model, x, y).direct  # "auto" keeps the cached pullbacks
    jac, _ = dense_jacobians(model, x, y)
    u = torch.randn(4, 2, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), _dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.jt_sum(u[:, 0]), torch.einsum("bap,ba->p", jac, u[:, 0]), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.gradient_images(), torch.einsum("bap,bp->ba", jac, op.per_sample_gradients()),
                               rtol=1e-9, atol=1e-12)
    noise = torch.randn(op.dtheta, dtype=torch.float64)
    torch.testing.assert_close(op.j(noise.expand(4, -1).unsqueeze(1))[:, 0], torch.einsum("bap,p->ba", jac, noise),
                               rtol=1e-9, atol=1e-12)
    # per-sample vectors: one sample at a time, the same blocks
    w = torch.randn(4, 1, op.dtheta, dtype=torch.float64)
    torch.testing.assert_close(op.j(w)[:, 0], torch.einsum("bap,bp->ba", jac, w[:, 0]), rtol=1e-9, atol=1e-12)
    refused = JacobianOperator(_ScaledNorm().double(), x, y, products="ghost")
    assert not refused.direct and "takes the parameter norm" in refused.ghost_refused
    assert getattr(refused, "_ghost", None) is None


def test_products_ghost_keeps_the_cached_path_where_the_graphs_would_be_rebuilt(monkeypatch):
    monkeypatch.setattr(ghost_products, "RETAINED_BYTES", 0)
    x, y = _batch(4)
    op = JacobianOperator(_small_cnn(), x, y, products="ghost")
    assert not op.direct and getattr(op, "_ghost", None) is None


@pytest.mark.parametrize("kept", [True, False], ids=["graphs kept", "graphs rebuilt"])
def test_products_ghost_replaces_the_direct_paths_vmapped_chunks(kept, monkeypatch):
    """A batch the cached pullbacks would not hold, whose direct path would run vmapped chunks of several samples (a
    mid-size model: EfficientNet-B0 or a small ViT at B = 32) takes the ghost products under ``products="ghost"``, its
    graphs kept or rebuilt in chunks; the K product and the clipping's images against the dense blocks. A model whose
    forward pass refuses them keeps its chunks."""
    from flguard.risk import sizing

    if not kept:
        monkeypatch.setattr(ghost_products, "RETAINED_BYTES", 0)
    model = _vit_model()
    x, y = _batch(4)
    dtheta = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(sizing, "CACHED_UP_TO", 4 * dtheta - 1)  # the batch's pullbacks do not fit; 3 samples would
    assert JacobianOperator(model, x, y, products="auto").sample_chunk == 3  # the direct path's vmapped chunks
    op = JacobianOperator(model, x, y, products="ghost")
    assert op.direct and op.one_at_a_time and op._ghost is not None and op._ghost.retained == kept
    u = torch.randn(4, 2, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), _dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    jac = _dense_jacobians(model, x, y)
    torch.testing.assert_close(op.gradient_images(), torch.einsum("bap,bp->ba", jac, op.per_sample_gradients()),
                               rtol=1e-9, atol=1e-12)
    scaled = _ScaledNorm().double()
    monkeypatch.setattr(sizing, "CACHED_UP_TO", 4 * sum(p.numel() for p in scaled.parameters()) - 1)
    refused = JacobianOperator(scaled, x, y, products="ghost")
    assert refused.direct and refused.sample_chunk == 3 and getattr(refused, "_ghost", None) is None
    assert "takes the parameter norm" in refused.ghost_refused


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_ghost_products_on_cuda_keep_graphs_the_cpu_would_rebuild_and_match_the_dense_jacobian(monkeypatch):
    """On a CUDA device (``GUARD_GHOST_ON_CUDA``, off by default until measured there): graphs larger than
    ``RETAINED_BYTES`` are kept while they fit in ``CUDA_RETAINED_SHARE`` of the card's free memory — on the CPU the
    same batch is rebuilt — and the K product, the clipping's images, J of a shared vector and the summed Jᵀ on the card
    equal the dense float64 blocks taken on the CPU."""
    monkeypatch.setattr(ghost_products, "RETAINED_BYTES", 0)
    model = _model()
    x, y = _batch()
    assert ghost_products.graph_bytes(torch.device("cpu")) == (0, ghost_products.CHUNK_BYTES)
    assert ghost_products.graph_bytes(torch.device("cuda"))[0] > 0
    u = torch.randn(3, 2, x[0].numel(), dtype=torch.float64)
    want, jac = _dense_k(model, x, y, u), _dense_jacobians(model, x, y)
    model.cuda()
    op = JacobianOperator(model, x.cuda(), y.cuda(), products="direct")
    ghost = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    assert ghost.retained and ghost.graphs is not None
    unscaled = jac / op.scale
    for _ in range(2):  # the second product on the kept graphs
        torch.testing.assert_close(op.scale ** 2 * ghost(u.cuda()).cpu(), want, rtol=1e-9, atol=1e-12)
    grads = ghost.sample_gradients().cpu()
    torch.testing.assert_close(ghost.gradient_images().cpu(), torch.einsum("bap,bp->ba", unscaled, grads),
                               rtol=1e-9, atol=1e-12)
    v = torch.randn(op.dtheta, dtype=torch.float64)
    torch.testing.assert_close(ghost.shared_j(v.cuda()).cpu(), torch.einsum("bap,p->ba", unscaled, v), rtol=1e-9,
                               atol=1e-12)
    torch.testing.assert_close(ghost.transposed_sum(u[:, 0].cuda()).cpu(), torch.einsum("bap,ba->p", unscaled, u[:, 0]),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("channels", [3, 16], ids=["col2im backward", "slices backward"])
def test_patches_equal_unfold_and_its_gradient(channels):
    """``_Patches`` (a strided view copied, its backward strided slice additions or ``F.fold``) against ``F.unfold``
    on a channels-last input with uneven stride, padding and dilation."""
    from flguard.risk.ghost_convolutions import _Patches

    torch.manual_seed(3)
    x = torch.randn(2, channels, 9, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    settings = ((3, 2), (2, 1), (1, 2), (2, 1))  # kernel, stride, padding, dilation
    want = F.unfold(x, settings[0], dilation=settings[3], padding=settings[2], stride=settings[1])
    got = _Patches.apply(x, *settings)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    cotangent = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, x, cotangent)[0], torch.autograd.grad(want, x, cotangent)[0],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("channels, slices_from", [(3, 1024), (16, 1024), (3, 0), (16, 0)],
                         ids=["index_add-3", "index_add-16", "slices-3", "slices-16"])
def test_patches_and_their_fold_are_differentiable_twice(channels, slices_from, monkeypatch):
    """``unfold`` (``_Patches``) and its backward ``_Fold`` differentiated again — pass 1 records the fold of a
    convolution taken on its patches — against finite differences, and the fold against ``F.fold``, with stride,
    padding and dilation uneven: the CPU's two routes (one ``index_add_`` on small maps, strided slices on large
    ones)."""
    from flguard.risk import ghost_convolutions
    from flguard.risk.ghost_convolutions import _Fold, unfold

    monkeypatch.setattr(ghost_convolutions, "SLICES_FROM_POSITIONS", slices_from)
    torch.manual_seed(5)
    x = torch.randn(2, channels, 7, 6, dtype=torch.float64, requires_grad=True)
    settings = ((3, 2), (2, 1), (1, 2), (2, 1))  # kernel, stride, padding, dilation
    assert torch.autograd.gradgradcheck(lambda t: unfold(t, *settings), (x,))
    columns = unfold(x, *settings).detach().requires_grad_(True)
    torch.testing.assert_close(_Fold.apply(columns, x.shape, settings),
                               F.fold(columns, (7, 6), settings[0], settings[3], settings[2], settings[1]),
                               rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradgradcheck(lambda t: _Fold.apply(t, x.shape, settings), (columns,))


@pytest.mark.parametrize("channels", [1, 4])
def test_the_input_gradient_of_a_convolution_equals_autograds(channels):
    """``Convolution.transposed`` (a transposed convolution) against autograd's input gradient of the convolution,
    with stride, padding and dilation uneven and a last row and column the stride never reaches."""
    torch.manual_seed(4)
    x = torch.randn(2, channels, 10, 9, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, channels, 3, 2, dtype=torch.float64)
    settings = ((2, 3), (1, 2), (2, 1))  # stride, padding, dilation
    layer = Convolution(weight, "conv", settings, torch.zeros(()))
    y = layer.convolve(x)
    g = torch.randn_like(y)
    torch.testing.assert_close(layer.transposed(g, x.shape), torch.autograd.grad(y, x, g)[0], rtol=1e-12, atol=1e-12)


def test_a_fully_connected_layers_pairs_dot_the_per_sample_weight_gradients():
    """``pair_dot`` on a fully connected layer (P = 1, its pairs in one expression): Σ_j ⟨δ_j ⊗ x_j, Σ_pairs a_j ⊗ b_j⟩
    against the per-sample outer products formed, with a pair whose b is pass 1's x; its gradient in δ and x (pass 3)
    against autograd of the formed expression; no pairs, zero."""
    from flguard.risk.ghost_convolutions import Dense, pair_dot

    torch.manual_seed(8)
    delta = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    layer = Dense(torch.randn(5, 7, dtype=torch.float64), "fc", (), torch.zeros(()))
    layer.first = (delta, x)
    a1, a2 = torch.randn(2, 4, 5, dtype=torch.float64)
    b2 = torch.randn(4, 7, dtype=torch.float64)
    layer.pairs = [(a1, None), (a2, b2)]
    got = pair_dot(layer, True)
    w = torch.einsum("bo,bi->boi", a1, x.detach()) + torch.einsum("bo,bi->boi", a2, b2)
    want = (torch.einsum("bo,bi->boi", delta, x) * w).sum()
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    for g, h in zip(torch.autograd.grad(got, (delta, x)), torch.autograd.grad(want, (delta, x))):
        torch.testing.assert_close(g, h, rtol=1e-13, atol=1e-14)
    layer.pairs = []
    assert float(pair_dot(layer, True)) == 0.0


@pytest.mark.parametrize("channels", [1, 3, 6])
def test_a_convolution_on_its_patches_equals_autograds(channels):
    """``Patched`` on a channels-last input's patches: its output, its input gradient folded back, its summed and
    per-sample weight gradients against ``F.conv2d`` and autograd, with stride, padding and dilation uneven."""
    from flguard.risk.ghost_convolutions import Patched, output_positions, unfold

    torch.manual_seed(6)
    x = torch.randn(3, channels, 10, 9, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    weight = torch.randn(5, channels, 3, 2, dtype=torch.float64, requires_grad=True)
    settings = ((2, 3), (1, 2), (2, 1))  # stride, padding, dilation
    layer = Patched(weight.detach().reshape(5, -1), "conv", settings, torch.zeros(()))
    patches = unfold(x, (3, 2), *settings)
    want = F.conv2d(x, weight, None, *settings)
    got = layer.convolve(patches)
    torch.testing.assert_close(got.reshape(*got.shape[:2], *output_positions(x, (3, 2), *settings)), want,
                               rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    input_grad, weight_grad = torch.autograd.grad(want, (x, weight), g)
    folded = torch.autograd.grad(patches, x, layer.transposed(g.reshape(*got.shape), x.shape))[0]
    torch.testing.assert_close(folded, input_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight_gradient(g.reshape(*got.shape), patches.detach()),
                               weight_grad.reshape(5, -1), rtol=1e-12, atol=1e-12)
    each = torch.stack([torch.autograd.grad(F.conv2d(x[i:i + 1], weight, None, *settings), weight, g[i:i + 1])[0]
                        for i in range(3)])
    torch.testing.assert_close(layer.per_sample_weights(g.reshape(*got.shape), patches.detach()),
                               each.reshape(3, 5, -1), rtol=1e-12, atol=1e-12)


class _TwiceUsed(nn.Module):
    """One convolution applied twice: its weight's gradient is the sum of two uses, whose cross terms per-use inner
    products would miss (``weight_dot`` takes both uses as one layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(torch.tanh(self.conv(x)))).mean((2, 3)))


class _ScaledNorm(nn.Module):
    """A parent without parameters of its own that hands its GroupNorm's weight to another function."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(self.conv(x)) * self.norm.weight.sum()
        return self.head(z.mean((2, 3)))


class _RowByRow(nn.Module):
    """A [2, F] parameter added to a batch of two samples' [2, F] features: row i gets the parameter's row i, so a
    sample's output depends on its place in the batch — no per-sample view of the parameter is that map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.rows = nn.Parameter(torch.randn(2, 2 * 6 * 7))
        self.head = nn.Linear(2 * 6 * 7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x).flatten(1) + self.rows))


class _TiedTranspose(nn.Module):
    """A fully connected layer whose weight is used again transposed, as a tied decoder (or tied embeddings) uses it:
    the batched product does not take it."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 4, 2, stride=2)
        self.encode = nn.Linear(4, 6)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = torch.tanh(self.encode(self.patches(x).flatten(2).transpose(1, 2)))
        return self.head(F.linear(codes, self.encode.weight.t()).mean(1))


@pytest.mark.parametrize("case", ["BatchNorm in eval mode", "a weight used elsewhere", "'same' padding",
                                  "a weight used transposed"])
def test_models_the_ghost_product_refuses_keep_the_loop(case):
    torch.manual_seed(0)
    if case == "BatchNorm in eval mode":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
        model(torch.randn(2, 3, 8, 9))
        model.eval()
        static = "1: a BatchNorm2d with trainable parameters"
    elif case == "'same' padding":
        model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Conv2d(6, 6, 3, padding="same"), nn.Flatten(), nn.LazyLinear(3))
        model(torch.randn(2, 3, 8, 9))
        static = "1: a 'same'-padded convolution"
    else:
        model = {"a weight used elsewhere": _ScaledNorm, "a weight used transposed": _TiedTranspose}[case]()
        static = None
    model = model.double()
    assert ghost_support(model) == static
    x, y = _batch(2)
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    u = torch.randn(2, 1, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), _dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    assert getattr(op, "_ghost", None) is None
    if static is None:  # refused by the forward pass's check, and said why
        assert op.ghost_products
        expected = {"a weight used elsewhere": "takes the parameter norm",
                    "a weight used transposed": "t takes the parameter encode.weight"}[case]
        assert expected in op.ghost_refused
        with pytest.raises(Unsupported, match=expected.split(" is")[0]):
            GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    else:
        assert not op.ghost_products


def test_a_parameter_that_meets_the_batch_row_by_row_is_refused():
    """A parameter entering elementwise beside the activations is taken per sample only where it broadcasts over the
    batch; one whose rows meet the batch's rows (``_RowByRow``) is refused by the forward pass's check (on one
    sample, where the rows no longer match), and so is one added to a scalar or read through a tensor attribute."""
    model = _RowByRow().double()
    assert ghost_support(model) is None
    x, y = _batch(2)
    op = JacobianOperator(model, x, y, products="direct")
    with pytest.raises(Unsupported, match="the parameter rows meets a tensor of its own rank"):
        GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)

    class _Doubled(_RowByRow):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.conv(x).flatten(1) * (2 * self.head.bias).sum()))
    model = _Doubled().double()
    op = JacobianOperator(model, x, y, products="direct")
    with pytest.raises(Unsupported, match="an elementwise product or sum takes the parameter head.bias beside no batch"):
        GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)

    class _Transposed(_RowByRow):  # the parameter's transpose: an attribute of its per-sample view would be wrong
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.conv(x).flatten(1) @ self.rows.T))
    model = _Transposed().double()
    model.head = nn.Linear(2, 3).double()
    op = JacobianOperator(model, x, y, products="direct")
    with pytest.raises(Unsupported, match="a tensor attribute or comparison of the parameter rows"):
        GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)


def test_the_switch_turns_the_loop_back_on(monkeypatch):
    monkeypatch.setattr(direct, "GHOST_KMV", False)
    model = _model()
    x, y = _batch(2)
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    assert not op.ghost_products
    u = torch.randn(2, 1, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), _dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    assert getattr(op, "_ghost", None) is None


def test_dropping_the_product_frees_its_graphs_without_the_cyclic_collector():
    """The kept graphs hold each convolution's δ, whose graph holds the convolution's backward node: that node refers
    to its layer weakly, so no reference cycle runs through autograd's C++ graph (one did: 10 MB a step of ResNet-8-GN
    at B = 16 stayed allocated, gc.collect or not, until the weak reference)."""
    import gc
    import weakref

    model = _model()
    x, y = _batch()
    op = JacobianOperator(model, x, y, products="direct")
    ghost = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    ghost(torch.randn(3, 1, op.dx, dtype=torch.float64))
    kept = weakref.ref(ghost.graphs[0].layers[0].first[0])
    gc.disable()
    try:
        del ghost
        assert kept() is None
    finally:
        gc.enable()


def test_a_batch_sliced_from_a_dataset_is_measured_by_its_own_extent():
    """The chunks are sized by the bytes pass 1 keeps for one sample: a batch that is a slice of a whole dataset
    counts its own rows, not the dataset's storage (which had cut a ResNet-18's chunks in half)."""
    model = _model()
    x, y = _batch()
    dataset = torch.cat([x, torch.randn(500, *x.shape[1:], dtype=x.dtype)])
    op = JacobianOperator(model, dataset[:3], y, products="direct")
    assert op.x.untyped_storage().nbytes() == dataset.untyped_storage().nbytes()  # the operator keeps the view
    sliced = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    copied = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x.clone(), op.y)
    assert sliced._measure() == copied._measure() < dataset.untyped_storage().nbytes() / 10


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "convnext_tiny", "vision_transformer"])
def test_torchvisions_mobile_and_modern_networks_take_the_batched_products(name):
    """torchvision's MobileNetV3 (depthwise convolutions, squeeze-and-excitation, Hardswish, dropout), ConvNeXt
    (depthwise 7×7, LayerNorm2d, layer scales, stochastic depth) and VisionTransformer (a class token,
    ``nn.MultiheadAttention``, its dropouts) through ``fix_model`` take the ghost products on the guard's CPU path —
    their dropout and drop-path masks replayed — and give the one-sample loop's K product and per-sample gradients on
    the same masks, in float64."""
    torchvision = pytest.importorskip("torchvision")
    from flguard import fix_model

    torch.manual_seed(0)
    if name == "vision_transformer":  # a small one on 32×32 images: 16 patches of 8×8, dropout in its blocks
        model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                     hidden_dim=16, mlp_dim=32, dropout=0.1, num_classes=3)
    else:
        model = getattr(torchvision.models, name)(num_classes=3)
    model = fix_model(model).double().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y = torch.tensor([0, 2])
    ghost = JacobianOperator(model, x, y, products="ghost")
    assert ghost._ghost is not None and ghost.draws
    loop = JacobianOperator(model, x, y, products="direct", draws=ghost.draws)
    loop.sample_chunk = 1
    loop.ghost_refused = "the reference: one sample at a time"
    u = torch.randn(2, 1, ghost.dx, dtype=torch.float64)
    torch.testing.assert_close(ghost.kmv(u), loop.kmv(u), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ghost.per_sample_gradients(), loop.per_sample_gradients(), rtol=1e-9, atol=1e-12)
    assert getattr(loop, "_ghost", None) is None
