"""Multi-step FedAvg uploads: unrolling the K known local steps beats treating θ_K − θ_0 as a gradient."""

import pytest
import torch
import torch.nn.functional as F

from flguard import data
from flguard.attacks import metrics, reconstruct
from flguard.attacks.unroll import UnrolledObserver, simulate_update, step_batches
from flguard.models import create


pytestmark = pytest.mark.usefixtures("one_thread")


def test_step_batches_cycle_through_the_data():
    assert step_batches(4, 3) == [[0, 1, 2, 3]] * 3
    assert step_batches(5, 4, 2) == [[0, 1], [2, 3], [4], [0, 1]]
    with pytest.raises(ValueError, match="local_batch_size"):
        step_batches(4, 2, 5)


def test_simulated_update_equals_real_sgd_steps():
    torch.manual_seed(0)
    model = create("lenet", in_channels=1, num_classes=10, image_size=16)
    x, y = torch.rand(4, 1, 16, 16), torch.tensor([1, 2, 3, 4])
    update = simulate_update(model, x, y, local_steps=3, local_lr=0.1, local_batch_size=2)
    trained = create("lenet", in_channels=1, num_classes=10, image_size=16)
    trained.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    for batch in step_batches(4, 3, 2):
        optimizer.zero_grad()
        F.cross_entropy(trained(x[batch]), y[batch]).backward()
        optimizer.step()
    expected = torch.cat([(a - b).detach().reshape(-1) for a, b in zip(trained.parameters(), model.parameters())])
    assert torch.allclose(update, expected, atol=1e-6)


def test_unrolled_observer_vmap_matches_autograd():
    torch.manual_seed(1)
    model = create("lenet", in_channels=1, num_classes=10, image_size=12)
    x, y = torch.rand(2, 2, 1, 12, 12), torch.tensor([[1, 2], [1, 2]])
    outs = [UnrolledObserver(model, None, local_steps=2, local_lr=0.05, batches=[[0], [1]], mode=mode)(x, y)
            for mode in ("vmap", "autograd")]
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-6)


def test_unrolled_attack_beats_single_step_on_a_k_step_update():
    dataset = data.load("lfw-faces")
    torch.manual_seed(0)
    model = create("lenet", in_channels=1, num_classes=10, image_size=25, init="uniform")
    pixels = dataset.images[3:4]
    x, y = dataset.normalize(pixels), dataset.labels[3:4]
    steps, lr = 3, 0.01           # the update's direction differs from the first gradient's (cos ≈ 0.95)
    update = simulate_update(model, x, y, local_steps=steps, local_lr=lr)
    common = dict(method="gs", iterations=200, tv=0.0, mean=dataset.mean, std=dataset.std, seed=0)
    unrolled = reconstruct(model, update, (1, 25, 25), local_steps=steps, local_lr=lr, **common)
    single = reconstruct(model, -update, (1, 25, 25), **common)   # "the update is one gradient"
    psnr_unrolled = float(metrics.psnr(dataset.denormalize(unrolled.images).clamp(0, 1), pixels))
    psnr_single = float(metrics.psnr(dataset.denormalize(single.images).clamp(0, 1), pixels))
    print(f"K={steps} update: unrolled {psnr_unrolled:.1f} dB, single-step {psnr_single:.1f} dB")
    assert torch.equal(unrolled.labels, y)       # recovered from −update's last-layer signs
    assert psnr_unrolled > psnr_single + 5.0
    assert psnr_unrolled >= 22.0


def test_local_steps_need_the_learning_rate():
    torch.manual_seed(2)
    model = create("lenet", in_channels=1, num_classes=10, image_size=12)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with pytest.raises(ValueError, match="local_lr"):
        reconstruct(model, flat, (1, 12, 12), labels=[0], local_steps=2, iterations=1)
