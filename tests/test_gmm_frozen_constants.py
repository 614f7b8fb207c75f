"""The GMM's no-autograd path (decoding, validation) reuses its per-cluster constants while the
parameters are unchanged, and never a stale copy of them."""

import torch

from fairseq_modattn.modules.gmm import DiagonalGMM


def _stats(gmm, x):
    with torch.no_grad():
        return gmm(x, noise_var=0.1, need_kl=True)


def test_no_grad_path_equals_the_autograd_function():
    torch.manual_seed(0)
    gmm = DiagonalGMM(4, 8, 3, init="spread").double()
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    frozen = _stats(gmm, x)
    with_grad = gmm(x, noise_var=0.1, need_kl=True)
    for a, b in zip(frozen, with_grad):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_constants_follow_in_place_updates_and_loads():
    torch.manual_seed(1)
    gmm = DiagonalGMM(3, 4, 2, init="spread")
    x = torch.randn(1, 2, 6, 4)
    first = _stats(gmm, x)
    assert torch.equal(_stats(gmm, x).log_post, first.log_post)  # unchanged parameters: same values

    with torch.no_grad():  # an optimizer step changes the parameters in place
        gmm.means.add_(0.5)
    moved = _stats(gmm, x)
    assert not torch.allclose(moved.log_joint, first.log_joint)
    reference = gmm(x, noise_var=0.1, need_kl=True)  # the autograd path recomputes everything
    torch.testing.assert_close(moved.log_joint, reference.log_joint.detach())

    other = DiagonalGMM(3, 4, 2, init="spread")
    gmm.load_state_dict(other.state_dict())  # copy_ into the same storage
    torch.testing.assert_close(_stats(gmm, x).log_joint, _stats(other, x).log_joint)

    gmm.double()  # new storage and dtype
    assert _stats(gmm, x.double()).log_joint.dtype == torch.float64


def test_constants_are_computed_once_while_the_parameters_are_unchanged():
    gmm = DiagonalGMM(3, 4, 2)
    x = torch.randn(1, 2, 3, 4)
    _stats(gmm, x)
    kept = gmm._constants
    _stats(gmm, x)
    assert gmm._constants is kept
    with torch.no_grad():
        gmm.logits.mul_(2.0)
    _stats(gmm, x)
    assert gmm._constants is not kept
