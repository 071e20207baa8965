"""The batched K product with ghost per-sample weight gradients (``flguard.risk.ghost_products``) against dense float64
Jacobians: a channels-last 3-channel GroupNorm ResNet-shaped model with every convolution setting the rewrite handles
(grouped and depthwise included) and a ConvNeXt-shaped one (LayerNorm, a layer scale, a position embedding), both ways
of taking a convolution's inner product (Gram matrices, formed weight), graphs kept or rebuilt in chunks, and a
ViT-shaped one (a class token, self-attention batch first and sequence first), 1-D convolutions, and weights used
several times (a convolution applied twice, recurrent layers and cells); torchvision's MobileNetV3, ConvNeXt and
VisionTransformer against the one-sample loop. The shapes are in ``ghost_shapes``; the models the products refuse in
``test_ghost_refusals``, the convolution pieces in ``test_ghost_convolutions``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flguard.risk import ghost_convolutions, ghost_forward, ghost_products
from flguard.risk.clipped import ClippedJacobian
from flguard.risk.ghost_forward import ghost_support
from flguard.risk.ghost_products import GhostKmv
from flguard.risk.operator import JacobianOperator
from ghost_shapes import (CONVOLUTIONAL, SHAPES, ScaledNorm, dense_blocks, dense_k, resnet_shaped, sample_batch,
                          small_cnn, vit_shaped)
from risk_reference import dense_jacobians


def test_pass_ones_bytes_are_measured_once_per_model_and_input_shape(monkeypatch):
    """A guard builds a new operator at every step: pass 1's bytes per sample are measured at the first one and reused
    for the same model, input shape and parameters (its graphs kept, so that building them checks the forward pass);
    another input shape is measured again."""
    model = resnet_shaped()
    x, y = sample_batch()
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
    x, y = sample_batch()
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    ghost = GhostKmv(model, op.params, op.buffers, op.loss_fn, op.x, op.y)
    if not kept:  # two samples' graphs to a chunk
        ghost.chunk = 2
    assert ghost.retained == kept and (ghost.graphs is not None) == kept
    u = torch.randn(3, 2, op.dx, dtype=torch.float64)
    want = dense_k(model, x, y, u)
    for _ in range(2):  # the second product on the same (kept or rebuilt) graphs
        torch.testing.assert_close(op.scale ** 2 * ghost(u), want, rtol=1e-9, atol=1e-12)
    unscaled = dense_blocks(model, x, y) / op.scale
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
    model = resnet_shaped()
    x, y = sample_batch()
    op = JacobianOperator(model, x, y, products="direct")
    op.sample_chunk = 1
    assert op.one_at_a_time and op.ghost_products
    u = torch.randn(3, 1, op.dx, dtype=torch.float64)
    jac, _ = dense_jacobians(model, x, y)
    torch.testing.assert_close(op.kmv(u), dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
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
    torch.testing.assert_close(sub.kmv(u[[2, 0]]), dense_k(model, x, y, u)[[2, 0]], rtol=1e-9, atol=1e-12)
    assert sub._ghost is not op._ghost


def test_products_ghost_takes_the_batched_products_where_the_cached_path_would_run():
    """``products="ghost"`` (the guard's operator on a CPU): a batch the cached pullbacks would hold runs one sample
    at a time with the batched ghost products on graphs built at once — its K product, summed Jᵀ, clipping images and the
    noise's J against the dense blocks; a model whose forward pass refuses them, or graphs too large to keep, stay
    cached."""
    model = small_cnn()
    x, y = sample_batch(4)
    op = JacobianOperator(model, x, y, products="ghost")
    assert op.direct and op.one_at_a_time and op._ghost is not None and op._ghost.retained
    assert [layer.reads_input for layer in op._ghost.graphs[0].layers] == [True, False, False, False]
    assert not JacobianOperator(model, x, y).direct  # "auto" keeps the cached pullbacks
    jac, _ = dense_jacobians(model, x, y)
    u = torch.randn(4, 2, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.jt_sum(u[:, 0]), torch.einsum("bap,ba->p", jac, u[:, 0]), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(op.gradient_images(), torch.einsum("bap,bp->ba", jac, op.per_sample_gradients()),
                               rtol=1e-9, atol=1e-12)
    noise = torch.randn(op.dtheta, dtype=torch.float64)
    torch.testing.assert_close(op.j(noise.expand(4, -1).unsqueeze(1))[:, 0], torch.einsum("bap,p->ba", jac, noise),
                               rtol=1e-9, atol=1e-12)
    # per-sample vectors: one sample at a time, the same blocks
    w = torch.randn(4, 1, op.dtheta, dtype=torch.float64)
    torch.testing.assert_close(op.j(w)[:, 0], torch.einsum("bap,bp->ba", jac, w[:, 0]), rtol=1e-9, atol=1e-12)
    refused = JacobianOperator(ScaledNorm().double(), x, y, products="ghost")
    assert not refused.direct and "takes the parameter norm" in refused.ghost_refused
    assert getattr(refused, "_ghost", None) is None


def test_products_ghost_keeps_the_cached_path_where_the_graphs_would_be_rebuilt(monkeypatch):
    monkeypatch.setattr(ghost_products, "RETAINED_BYTES", 0)
    x, y = sample_batch(4)
    op = JacobianOperator(small_cnn(), x, y, products="ghost")
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
    model = vit_shaped()
    x, y = sample_batch(4)
    dtheta = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(sizing, "CACHED_UP_TO", 4 * dtheta - 1)  # the batch's pullbacks do not fit; 3 samples would
    assert JacobianOperator(model, x, y, products="auto").sample_chunk == 3  # the direct path's vmapped chunks
    op = JacobianOperator(model, x, y, products="ghost")
    assert op.direct and op.one_at_a_time and op._ghost is not None and op._ghost.retained == kept
    u = torch.randn(4, 2, op.dx, dtype=torch.float64)
    torch.testing.assert_close(op.kmv(u), dense_k(model, x, y, u), rtol=1e-9, atol=1e-12)
    jac = dense_blocks(model, x, y)
    torch.testing.assert_close(op.gradient_images(), torch.einsum("bap,bp->ba", jac, op.per_sample_gradients()),
                               rtol=1e-9, atol=1e-12)
    scaled = ScaledNorm().double()
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
    model = resnet_shaped()
    x, y = sample_batch()
    assert ghost_products.graph_bytes(torch.device("cpu")) == (0, ghost_products.CHUNK_BYTES)
    assert ghost_products.graph_bytes(torch.device("cuda"))[0] > 0
    u = torch.randn(3, 2, x[0].numel(), dtype=torch.float64)
    want, jac = dense_k(model, x, y, u), dense_blocks(model, x, y)
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


def test_dropping_the_product_frees_its_graphs_without_the_cyclic_collector():
    """The kept graphs hold each convolution's δ, whose graph holds the convolution's backward node: that node refers
    to its layer weakly, so no reference cycle runs through autograd's C++ graph (one did: 10 MB a step of ResNet-8-GN
    at B = 16 stayed allocated, gc.collect or not, until the weak reference)."""
    import gc
    import weakref

    model = resnet_shaped()
    x, y = sample_batch()
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
    model = resnet_shaped()
    x, y = sample_batch()
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
