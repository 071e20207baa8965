"""Model shapes shared by the batched products' tests (``flguard.risk.ghost_products``): a channels-last 3-channel
GroupNorm ResNet-shaped model with every convolution setting the rewrite handles, ConvNeXt-, ViT- and cross-attention
shapes, 1-D convolutions, recurrent layers and cells, weights used several times, the quickstart CNN's shape on
3 channels, the models the products refuse, and the dense float64 references they are checked against."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from risk_reference import dense_jacobians


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


def resnet_shaped() -> nn.Module:
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


class ConvNeXtBlock(nn.Module):
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


def convnext_shaped() -> nn.Module:
    """A patchify stem → ConvNeXt block → tokens with an added position embedding ([1, N, D]) → LayerNorm → mean →
    Linear, float64: the parameters that enter elementwise beside the activations."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 2, stride=2)
            self.block = ConvNeXtBlock(4)
            self.position = nn.Parameter(0.1 * torch.randn(1, 16, 4))
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tokens = self.block(self.stem(x)).flatten(2).transpose(1, 2) + self.position
            return self.head(self.norm(tokens).mean(1))
    return Net().double()


class ViT(nn.Module):
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


class CrossAttention(nn.Module):
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


def vit_shaped(batch_first: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return ViT(batch_first).double()


def sample_batch(batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(batch, 3, 8, 9, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    return x, torch.arange(batch) % 3


def dense_blocks(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, dx, dθ] of the batch loss, attention on PyTorch's "math" kernel (its flash kernel has no double backward)."""
    with sdpa_kernel(SDPBackend.MATH):
        return dense_jacobians(model, x, y)[0]


def dense_k(model: nn.Module, x: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    jac = dense_blocks(model, x, y)
    return torch.einsum("bap,bkp->bka", jac, torch.einsum("bap,bka->bkp", jac, u))


class Recurrent(nn.Module):
    """An image as a sequence (6 steps of 36 features) through a recurrent layer, the last step to a head."""

    def __init__(self, cell: str, **settings) -> None:
        super().__init__()
        self.rnn = getattr(nn, cell)(36, 5, batch_first=True, **settings)
        width = settings.get("proj_size", 0) or 5
        self.head = nn.Linear(width * (2 if settings.get("bidirectional") else 1), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x.reshape(x.shape[0], 6, 36))[0][:, -1])


class CellLoop(nn.Module):
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


class Series(nn.Module):
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


class ProjectedConstant(nn.Module):
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


def recurrent_shaped(cell: str, **settings) -> nn.Module:
    torch.manual_seed(0)
    return Recurrent(cell, **settings).double()


SHAPES = {"ResNet": lambda: resnet_shaped(), "ConvNeXt": lambda: convnext_shaped(), "ViT": lambda: vit_shaped(),
          "ViT sequence first": lambda: vit_shaped(batch_first=False),
          "cross-attention": lambda: (torch.manual_seed(0), CrossAttention(separate=False).double())[1],
          "cross-attention, q, k and v weights of their own": lambda: (torch.manual_seed(0),
                                                                      CrossAttention(separate=True).double())[1],
          "a convolution used twice": lambda: TwiceUsed().double(),
          "1-D convolutions": lambda: (torch.manual_seed(0), Series().double())[1],
          "a projection of a constant": lambda: (torch.manual_seed(0), ProjectedConstant().double())[1],
          "LSTM": lambda: recurrent_shaped("LSTM"),
          "stacked LSTM with a projection": lambda: recurrent_shaped("LSTM", num_layers=2, proj_size=3),
          "bidirectional GRU": lambda: recurrent_shaped("GRU", bidirectional=True),
          "ReLU RNN": lambda: recurrent_shaped("RNN", nonlinearity="relu"),
          "LSTMCell stepped by hand": lambda: (torch.manual_seed(0), CellLoop().double())[1]}


#: The shapes with convolutions, whose formed weight can also run with the batch folded into a convolution's groups
CONVOLUTIONAL = ("ResNet", "ConvNeXt", "a convolution used twice", "1-D convolutions", "a projection of a constant")
#: (Gram matrices, the batch folded into groups, convolutions of fewer channels than this taken on their patches)
def small_cnn() -> nn.Module:
    """The quickstart CNN's shape on 3 channels: a first convolution on the input itself (pass 2 skips its input
    gradient), pooling, fully connected layers on [B, features] (one position each), float64."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 5, 2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(5 * 2 * 2, 6), nn.Tanh(), nn.Linear(6, 3)).double()


class TwiceUsed(nn.Module):
    """One convolution applied twice: its weight's gradient is the sum of two uses, whose cross terms per-use inner
    products would miss (``weight_dot`` takes both uses as one layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(torch.tanh(self.conv(x)))).mean((2, 3)))


class ScaledNorm(nn.Module):
    """A parent without parameters of its own that hands its GroupNorm's weight to another function."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(self.conv(x)) * self.norm.weight.sum()
        return self.head(z.mean((2, 3)))


class RowByRow(nn.Module):
    """A [2, F] parameter added to a batch of two samples' [2, F] features: row i gets the parameter's row i, so a
    sample's output depends on its place in the batch — no per-sample view of the parameter is that map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.rows = nn.Parameter(torch.randn(2, 2 * 6 * 7))
        self.head = nn.Linear(2 * 6 * 7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x).flatten(1) + self.rows))


class TiedTranspose(nn.Module):
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
