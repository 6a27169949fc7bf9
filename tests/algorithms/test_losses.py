"""Tests for rl_replay.algorithms.losses: returns, GAE, A2C / REINFORCE loss terms.

Hand-computed cases use gamma = lambda = 0.5 and small dyadic numbers so the
expected values below are exact in binary floating point.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rl_replay.algorithms.losses import (
    a2c_loss,
    compute_gae,
    discounted_returns,
    reinforce_loss,
    total_loss,
)

NAN = float("nan")


def col(*xs, dtype=torch.float32):
    """A (T, 1) tensor from a list of T numbers."""
    return torch.tensor(xs, dtype=dtype).reshape(-1, 1)


def bcol(*xs):
    return col(*xs, dtype=torch.bool)


# --------------------------------------------------------------------------- #
# A hand-computed rollout, T=5, N=1:
#   t0: r=1, v=1, nv=2                  (mid-episode)
#   t1: r=0, v=2, nv=NaN, terminated    (next_value ignored: no bootstrap)
#   t2: invalid autoreset row, everything garbage
#   t3: r=2, v=4, nv=8                  (new episode)
#   t4: r=1, v=8, nv=4                  (last row: bootstrap from nv=4)
# gamma = lambda = 0.5:
#   delta = [1+1-1, 0-2, -, 2+4-4, 1+2-8] = [1, -2, -, 2, -5]
#   A4 = -5, A3 = 2 + 0.25*(-5) = 0.75, A1 = -2, A0 = 1 + 0.25*(-2) = 0.5
#   returns = A + v = [1.5, 0, -, 4.75, 3]
#   MC returns (gamma 0.5): G4 = 1 + 0.5*4 = 3, G3 = 2 + 0.5*3 = 3.5, G1 = 0, G0 = 1
# --------------------------------------------------------------------------- #
def hand_rollout(garbage: float = NAN, requires_grad: bool = True) -> TensorDict:
    g = garbage
    td = TensorDict(
        {
            "reward": col(1, 0, g, 2, 1),
            "value": col(1, 2, g, 4, 8).requires_grad_(requires_grad),
            "next_value": col(2, NAN, g, 8, 4),
            "log_prob": col(-1, -0.5, g, -2, -1).requires_grad_(requires_grad),
            "entropy": col(1, 2, g, 0.5, 0.5).requires_grad_(requires_grad),
            "terminated": bcol(False, True, True, False, False),
            "truncated": bcol(False, False, True, False, False),
            "valid": bcol(True, True, False, True, True),
        },
        batch_size=[5, 1],
    )
    return td


def random_rollout(T=20, N=3, seed=0, dtype=torch.float32, p_done=0.15) -> TensorDict:
    """Random rollout with episodes ends, an invalid autoreset row after each
    end and garbage (NaN) in the invalid rows."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(T, N, generator=g)
    terminated = u < p_done / 2
    truncated = (u >= p_done / 2) & (u < p_done)
    done = terminated | truncated
    valid = torch.ones(T, N, dtype=torch.bool)
    valid[1:] = ~done[:-1]  # autoreset row after each episode end
    terminated &= valid
    truncated &= valid
    td = TensorDict(
        {
            "reward": torch.randn(T, N, generator=g, dtype=dtype),
            "value": torch.randn(T, N, generator=g, dtype=dtype),
            "next_value": torch.randn(T, N, generator=g, dtype=dtype),
            "log_prob": -torch.rand(T, N, generator=g, dtype=dtype) * 3,
            "entropy": torch.rand(T, N, generator=g, dtype=dtype),
            "terminated": terminated,
            "truncated": truncated,
            "valid": valid,
        },
        batch_size=[T, N],
    )
    for k in ("reward", "value", "next_value", "log_prob", "entropy"):
        td[k] = torch.where(valid, td[k], NAN)
    for k in ("value", "log_prob", "entropy"):
        td[k] = td[k].clone().requires_grad_(True)
    return td


def gae_reference(reward, value, next_value, terminated, truncated, gamma, lam):
    """Straightforward per-element python GAE."""
    T, N = reward.shape
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        nxt = 0.0
        for t in reversed(range(T)):
            term = bool(terminated[t, n])
            done = term or bool(truncated[t, n])
            boot = 0.0 if term else float(next_value[t, n])
            delta = float(reward[t, n]) + gamma * boot - float(value[t, n])
            a = delta + (0.0 if done else gamma * lam * nxt)
            adv[t][n] = a
            nxt = a
    adv = torch.tensor(adv, dtype=torch.float64)
    return adv, adv + value.double()


# --------------------------------------------------------------------------- #
# compute_gae
# --------------------------------------------------------------------------- #
def _gae_inputs():
    # reward [1, 0, 2], value [1, 2, 4], next_value [2, 4, 8] (consistent).
    return col(1, 0, 2), col(1, 2, 4), col(2, 4, 8), bcol(0, 0, 0), bcol(0, 0, 0)


def test_gae_hand_no_done():
    r, v, nv, te, tr = _gae_inputs()
    adv, ret = compute_gae(r, v, nv, te, tr, gamma=0.5, gae_lambda=0.5)
    # delta = [1, 0, 2]; A2 = 2, A1 = 0 + .25*2 = .5, A0 = 1 + .25*.5 = 1.125
    assert adv.flatten().tolist() == [1.125, 0.5, 2.0]
    assert ret.flatten().tolist() == [2.125, 2.5, 6.0]


def test_gae_termination_does_not_bootstrap():
    r, v, nv, te, tr = _gae_inputs()
    te[2] = True
    nv[2] = NAN  # ignored at a terminated step (masked with where, not multiply)
    adv, ret = compute_gae(r, v, nv, te, tr, gamma=0.5, gae_lambda=0.5)
    # delta2 = 2 + 0 - 4 = -2; A1 = 0 + .25*(-2) = -.5; A0 = 1 - .125 = .875
    assert adv.flatten().tolist() == [0.875, -0.5, -2.0]
    assert ret.flatten().tolist() == [1.875, 1.5, 2.0]


def test_gae_truncation_bootstraps_from_next_value_and_cuts():
    r, v, nv, te, tr = _gae_inputs()
    tr[1] = True
    nv[1] = 10.0  # V(final observation), differs from value[2] = 4
    adv, ret = compute_gae(r, v, nv, te, tr, gamma=0.5, gae_lambda=0.5)
    # delta1 = 0 + 5 - 2 = 3, A1 = 3 (cut), A2 = 2, A0 = 1 + .25*3 = 1.75
    assert adv.flatten().tolist() == [1.75, 3.0, 2.0]
    assert ret.flatten().tolist() == [2.75, 5.0, 6.0]


def test_gae_recursion_cut_at_done_per_env():
    # N=2: env 0 has no done, env 1 terminates at t=1.
    r = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    v = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]])
    nv = torch.tensor([[2.0, 2.0], [4.0, 4.0], [8.0, 8.0]])
    te = torch.tensor([[False, False], [False, True], [False, False]])
    tr = torch.zeros(3, 2, dtype=torch.bool)
    adv, _ = compute_gae(r, v, nv, te, tr, gamma=0.5, gae_lambda=0.5)
    # env 1: delta1 = 0 - 2 = -2 -> A1 = -2, A0 = 1 + .25*(-2) = .5, A2 = 2
    assert adv[:, 0].tolist() == [1.125, 0.5, 2.0]
    assert adv[:, 1].tolist() == [0.5, -2.0, 2.0]
    # anything after the boundary does not reach t <= 1 of env 1
    r2 = r.clone()
    r2[2, 1] = NAN
    adv2, _ = compute_gae(r2, v, nv, te, tr, gamma=0.5, gae_lambda=0.5)
    assert adv2[:2, 1].tolist() == [0.5, -2.0]
    assert torch.isnan(adv2[2, 1])
    assert torch.equal(adv2[:, 0], adv[:, 0])


def test_gae_matches_python_reference_random():
    g = torch.Generator().manual_seed(1)
    T, N = 20, 3
    r = torch.randn(T, N, generator=g, dtype=torch.float64)
    v = torch.randn(T, N, generator=g, dtype=torch.float64)
    nv = torch.randn(T, N, generator=g, dtype=torch.float64)
    u = torch.rand(T, N, generator=g)
    te = u < 0.1
    tr = (u >= 0.1) & (u < 0.2)
    assert te.any() and tr.any() and not (te | tr).all()
    for gamma, lam in [(0.99, 0.95), (0.5, 0.5), (0.9, 0.0), (0.7, 1.0)]:
        adv, ret = compute_gae(r, v, nv, te, tr, gamma=gamma, gae_lambda=lam)
        ref_adv, ref_ret = gae_reference(r, v, nv, te, tr, gamma, lam)
        torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-12)


def test_gae_detaches_value_and_builds_no_graph():
    r, v, nv, te, tr = _gae_inputs()
    v.requires_grad_(True)
    adv, ret = compute_gae(r, v, nv, te, tr, gamma=0.5, gae_lambda=0.5)
    assert not adv.requires_grad and not ret.requires_grad
    assert ret.flatten().tolist() == [2.125, 2.5, 6.0]


def test_gae_input_errors():
    r, v, nv, te, tr = _gae_inputs()
    with pytest.raises(ValueError, match=r"'value'.*\(2, 1\).*'reward'.*\(3, 1\)"):
        compute_gae(r, v[:2], nv, te, tr, gamma=0.5, gae_lambda=0.5)
    with pytest.raises(ValueError, match=r"gae_lambda must be in \[0, 1\]"):
        compute_gae(r, v, nv, te, tr, gamma=0.5, gae_lambda=1.5)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        compute_gae(r, v, nv, te, tr, gamma=-0.1, gae_lambda=0.5)
    with pytest.raises(ValueError, match=r"'reward' must have shape \(T, N\)"):
        compute_gae(r[:, 0], v[:, 0], nv[:, 0], te[:, 0], tr[:, 0], gamma=0.5, gae_lambda=0.5)


# --------------------------------------------------------------------------- #
# discounted_returns
# --------------------------------------------------------------------------- #
def test_discounted_returns_hand():
    r, _, nv, te, tr = _gae_inputs()
    # G2 = 2 + .5*8 = 6, G1 = 0 + .5*6 = 3, G0 = 1 + .5*3 = 2.5
    assert discounted_returns(r, nv, te, tr, gamma=0.5).flatten().tolist() == [2.5, 3.0, 6.0]
    # next_value is read only at truncation / last row: interior values are ignored
    nv_garbage = nv.clone()
    nv_garbage[:2] = NAN
    assert discounted_returns(r, nv_garbage, te, tr, gamma=0.5).flatten().tolist() == [2.5, 3.0, 6.0]


def test_discounted_returns_termination_and_truncation():
    r, _, nv, te, tr = _gae_inputs()
    te[1] = True  # G1 = 0 (nv[1] ignored), G0 = 1 + 0 = 1
    nv[1] = NAN
    assert discounted_returns(r, nv, te, tr, gamma=0.5).flatten().tolist() == [1.0, 0.0, 6.0]
    tr[0] = True
    nv[0] = 4.0  # G0 = 1 + .5*4 = 3, cut from G1
    assert discounted_returns(r, nv, te, tr, gamma=0.5).flatten().tolist() == [3.0, 0.0, 6.0]
    # a terminated last row does not bootstrap either
    te[2] = True
    nv[2] = NAN
    assert discounted_returns(r, nv, te, tr, gamma=0.5).flatten().tolist() == [3.0, 0.0, 2.0]


def test_lambda_one_equals_discounted_returns():
    g = torch.Generator().manual_seed(2)
    T, N = 20, 3
    r = torch.randn(T, N, generator=g, dtype=torch.float64)
    v = torch.randn(T, N, generator=g, dtype=torch.float64)
    u = torch.rand(T, N, generator=g)
    te = u < 0.1
    tr = (u >= 0.1) & (u < 0.2)
    done = te | tr
    # consistent rollout: inside an episode next_value_t == value_{t+1}
    nv = torch.randn(T, N, generator=g, dtype=torch.float64)
    nv[:-1] = torch.where(done[:-1], nv[:-1], v[1:])
    _, ret = compute_gae(r, v, nv, te, tr, gamma=0.9, gae_lambda=1.0)
    mc = discounted_returns(r, nv, te, tr, gamma=0.9)
    torch.testing.assert_close(ret, mc, rtol=0, atol=1e-12)
    # and both match the reference with lambda=1
    _, ref = gae_reference(r, v, nv, te, tr, 0.9, 1.0)
    torch.testing.assert_close(mc, ref, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- #
# a2c_loss
# --------------------------------------------------------------------------- #
def test_a2c_hand_computed():
    out = a2c_loss(
        hand_rollout(),
        gamma=0.5,
        gae_lambda=0.5,
        value_coef=0.5,
        entropy_coef=0.25,
        normalize_advantages=False,
    )
    # A = [.5, -2, -, .75, -5], log_prob = [-1, -.5, -, -2, -1]
    # A*lp = [-.5, 1, -1.5, 5] -> mean 1 -> loss_policy = -1
    assert out["loss_policy"].item() == -1.0
    # returns = [1.5, 0, 4.75, 3], v = [1, 2, 4, 8]; (v-R)^2 = [.25, 4, .5625, 25]
    # mean = 29.8125/4 = 7.453125; * 0.5 * 0.5 = 1.86328125
    assert out["loss_value"].item() == 1.86328125
    # entropy mean = (1 + 2 + .5 + .5)/4 = 1 -> -0.25
    assert out["loss_entropy"].item() == -0.25
    assert out["entropy"].item() == 1.0
    assert out["advantage_mean"].item() == -1.4375  # (.5 - 2 + .75 - 5)/4
    assert out["value_mean"].item() == 3.75  # (1 + 2 + 4 + 8)/4
    assert out["return_mean"].item() == 2.3125  # (1.5 + 0 + 4.75 + 3)/4
    # residual = R - v = [.5, -2, .75, -5], mean -1.4375, sum sq dev = 21.546875
    # R mean 2.3125, sum sq dev = 12.421875 (same n-1 divisor cancels)
    assert out["explained_variance"].item() == pytest.approx(1 - 21.546875 / 12.421875, abs=1e-6)
    assert total_loss(out).item() == -1.0 + 1.86328125 - 0.25
    for k in ("entropy", "advantage_mean", "value_mean", "return_mean", "explained_variance"):
        assert not out[k].requires_grad, k
        assert out[k].shape == torch.Size([])
    assert out.batch_size == torch.Size([])


def test_a2c_hand_gradients_and_invalid_row_gets_exact_zero():
    td = hand_rollout()
    out = a2c_loss(td, gamma=0.5, gae_lambda=0.5, value_coef=0.5, entropy_coef=0.25, normalize_advantages=False)
    total_loss(out).backward()
    # d loss_policy / d lp = -A / 4
    assert td["log_prob"].grad.flatten().tolist() == [-0.125, 0.5, 0.0, -0.1875, 1.25]
    # d loss_value / d v = 0.5 * 0.5 * 2 * (v - R) / 4 = (v - R) / 8, v - R = [-.5, 2, -.75, 5]
    assert td["value"].grad.flatten().tolist() == [-0.0625, 0.25, 0.0, -0.09375, 0.625]
    # d loss_entropy / d ent = -0.25 / 4
    assert td["entropy"].grad.flatten().tolist() == [-0.0625, -0.0625, 0.0, -0.0625, -0.0625]


@pytest.mark.parametrize("loss_fn", [a2c_loss, reinforce_loss])
def test_invalid_rows_contribute_nothing(loss_fn):
    kw = dict(gamma=0.5, normalize_advantages=True, entropy_coef=0.1)
    outs, grads = [], []
    for garbage in (NAN, 1e6, -1e6, 0.0):
        td = hand_rollout(garbage)
        out = loss_fn(td, **kw)
        total_loss(out).backward()
        outs.append(out.detach())
        grads.append({k: td[k].grad.clone() for k in ("value", "log_prob", "entropy")})
    for out in outs:
        for k in out.keys():
            assert torch.isfinite(out[k]), k
            assert torch.equal(out[k], outs[0][k]), k
    for g in grads:
        for k, grad in g.items():
            assert grad[2, 0].item() == 0.0, k  # the invalid row, exactly 0 (not NaN)
            assert torch.equal(grad, grads[0][k]), k
            assert torch.isfinite(grad).all(), k


def test_invalid_rows_random_match_valid_only_reference():
    """On a random rollout with NaN in invalid rows: the loss equals the one
    computed from the valid rows alone, and invalid rows get exactly 0 grad."""
    td = random_rollout(T=20, N=3, seed=3)
    valid = td["valid"]
    assert (~valid).any()
    out = a2c_loss(td, gamma=0.9, gae_lambda=0.8, normalize_advantages=False)
    total_loss(out).backward()
    for k in ("value", "log_prob", "entropy"):
        grad = td[k].grad
        assert torch.isfinite(grad).all()
        assert (grad[~valid] == 0).all()
        assert (grad[valid] != 0).any()
    # reference: GAE where invalid rows are replaced by zeros (they are never
    # read since the row before is done), per-element python loop
    z = {k: torch.where(valid, td[k].detach(), 0.0) for k in ("reward", "value", "next_value")}
    ref_adv, ref_ret = gae_reference(
        z["reward"], z["value"], z["next_value"], td["terminated"], td["truncated"] | ~valid, 0.9, 0.8
    )
    lp = td["log_prob"].detach().double()[valid]
    v = td["value"].detach().double()[valid]
    exp_policy = -(ref_adv[valid] * lp).mean()
    exp_value = 0.5 * 0.5 * ((v - ref_ret[valid]) ** 2).mean()
    assert out["loss_policy"].item() == pytest.approx(exp_policy.item(), rel=1e-5)
    assert out["loss_value"].item() == pytest.approx(exp_value.item(), rel=1e-5)
    assert out["entropy"].item() == pytest.approx(td["entropy"].detach()[valid].mean().item(), rel=1e-6)


@pytest.mark.parametrize(
    "loss_fn, kw",
    [(a2c_loss, dict(gae_lambda=0.9)), (reinforce_loss, dict(normalize_advantages=True))],
)
def test_normalisation_zero_mean_unit_std_over_valid_rows(loss_fn, kw):
    td = random_rollout(T=20, N=3, seed=4)
    valid = td["valid"]
    n = int(valid.sum())
    out = loss_fn(td, gamma=0.9, **kw)
    (grad_lp,) = torch.autograd.grad(out["loss_policy"], td["log_prob"])
    adv_n = -grad_lp * n  # loss_policy = -sum_valid(adv_n * lp) / n
    assert (adv_n[~valid] == 0).all()
    assert adv_n[valid].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert adv_n[valid].std().item() == pytest.approx(1.0, abs=1e-4)
    # the diagnostic advantage_mean is the raw (un-normalised) mean: not ~0
    assert abs(out["advantage_mean"].item()) > 1e-3


def test_a2c_without_normalisation_policy_gradient_is_raw_advantage():
    td = random_rollout(T=20, N=3, seed=5)
    valid = td["valid"]
    n = int(valid.sum())
    out = a2c_loss(td, gamma=0.9, gae_lambda=0.8, normalize_advantages=False)
    (grad_lp,) = torch.autograd.grad(out["loss_policy"], td["log_prob"])
    adv, _ = compute_gae(
        torch.where(valid, td["reward"], 0.0),
        torch.where(valid, td["value"], 0.0),
        torch.where(valid, td["next_value"], 0.0),
        td["terminated"],
        td["truncated"] | ~valid,
        gamma=0.9,
        gae_lambda=0.8,
    )
    torch.testing.assert_close(-grad_lp * n, torch.where(valid, adv, 0.0), rtol=1e-5, atol=1e-6)


def test_loss_terms_gradients_flow_to_their_inputs():
    td = random_rollout(T=10, N=2, seed=6)
    out = a2c_loss(td)
    inputs = (td["value"], td["log_prob"], td["entropy"])
    expected_flow = {
        "loss_policy": (False, True, False),
        "loss_value": (True, False, False),
        "loss_entropy": (False, False, True),
    }
    for key, flows in expected_flow.items():
        assert out[key].requires_grad, key
        grads = torch.autograd.grad(out[key], inputs, allow_unused=True, retain_graph=True)
        for grad, should in zip(grads, flows):
            if should:
                assert grad is not None and grad.abs().sum() > 0, key
            else:
                assert grad is None or (grad == 0).all(), key


# --------------------------------------------------------------------------- #
# reinforce_loss
# --------------------------------------------------------------------------- #
def test_reinforce_hand_with_baseline():
    td = hand_rollout()
    out = reinforce_loss(td, gamma=0.5, baseline=True, value_coef=0.5)
    # G = [1, 0, -, 3.5, 3]; adv = G - v = [0, -2, -.5, -5]
    # adv*lp = [0, 1, 1, 5] -> mean 1.75 -> loss_policy = -1.75
    assert out["loss_policy"].item() == -1.75
    # (v - G)^2 = [0, 4, .25, 25] -> 29.25/4 = 7.3125 -> * .25
    assert out["loss_value"].item() == 1.828125
    assert out["loss_entropy"].item() == 0.0  # default entropy_coef = 0
    assert out["return_mean"].item() == 1.875  # (1 + 0 + 3.5 + 3)/4
    assert out["advantage_mean"].item() == -1.875  # (0 - 2 - .5 - 5)/4
    assert out["value_mean"].item() == 3.75
    total_loss(out).backward()
    # d loss_value / d v = (v - G)/8
    assert td["value"].grad.flatten().tolist() == [0.0, 0.25, 0.0, 0.0625, 0.625]
    assert td["log_prob"].grad.flatten().tolist() == [0.0, 0.5, 0.0, 0.125, 1.25]


def test_reinforce_hand_without_baseline():
    td = hand_rollout()
    out = reinforce_loss(td, gamma=0.5, baseline=False, entropy_coef=0.5)
    # adv = G = [1, 0, 3.5, 3]; adv*lp = [-1, 0, -7, -3] -> mean -2.75
    assert out["loss_policy"].item() == 2.75
    assert out["loss_entropy"].item() == -0.5  # entropy mean 1
    lv = out["loss_value"]
    assert lv.shape == torch.Size([]) and lv.item() == 0.0 and not lv.requires_grad
    assert set(out.keys()) == set(a2c_loss(hand_rollout()).keys())
    total_loss(out).backward()
    assert td["value"].grad is None  # the critic is not trained
    assert td["log_prob"].grad.flatten().tolist() == [-0.25, 0.0, 0.0, -0.875, -0.75]


# --------------------------------------------------------------------------- #
# total_loss
# --------------------------------------------------------------------------- #
def test_total_loss_sums_only_loss_entries():
    terms = TensorDict(
        {
            "loss_a": torch.tensor(1.5),
            "loss_b": torch.tensor(-0.25),
            "entropy": torch.tensor(100.0),
            "value_mean": torch.tensor(1000.0),
            "my_loss_like": torch.tensor(7.0),
        },
        batch_size=[],
    )
    assert total_loss(terms).item() == 1.25
    out = a2c_loss(random_rollout(seed=7))
    expected = out["loss_policy"] + out["loss_value"] + out["loss_entropy"]
    assert torch.equal(total_loss(out), expected)
    assert total_loss(out).requires_grad


def test_total_loss_without_loss_entries_raises():
    with pytest.raises(ValueError, match=r"no 'loss_\*' entry.*entropy"):
        total_loss(TensorDict({"entropy": torch.tensor(1.0)}, batch_size=[]))


# --------------------------------------------------------------------------- #
# Rollout validation
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("loss_fn", [a2c_loss, reinforce_loss])
def test_missing_key_raises_keyerror(loss_fn):
    td = hand_rollout()
    del td["log_prob"]
    with pytest.raises(KeyError, match=r"missing key\(s\) \['log_prob'\].*has keys.*'reward'"):
        loss_fn(td)


@pytest.mark.parametrize("loss_fn", [a2c_loss, reinforce_loss])
def test_shape_mismatch_raises_valueerror(loss_fn):
    td = hand_rollout()
    td["value"] = td["value"].detach().unsqueeze(-1)  # (5, 1, 1) passes the [5, 1] batch
    with pytest.raises(ValueError, match=r"'value' has shape \(5, 1, 1\).*'reward' has shape \(5, 1\)"):
        loss_fn(td)
    # batch [T] lets N differ between keys
    T = 4
    td = TensorDict(
        {k: torch.zeros(T, 2) for k in ("reward", "value", "next_value", "log_prob", "entropy")},
        batch_size=[T],
    )
    for k in ("terminated", "truncated", "valid"):
        td[k] = torch.ones(T, 2, dtype=torch.bool)
    td["entropy"] = torch.zeros(T, 3)
    with pytest.raises(ValueError, match=r"'entropy' has shape \(4, 3\).*'reward' has shape \(4, 2\)"):
        loss_fn(td)


@pytest.mark.parametrize("loss_fn", [a2c_loss, reinforce_loss])
def test_no_valid_row_raises_valueerror(loss_fn):
    td = hand_rollout()
    td["valid"] = torch.zeros(5, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="no valid row"):
        loss_fn(td)


def test_non_bool_flag_raises_typeerror():
    td = hand_rollout()
    td["valid"] = td["valid"].float()
    with pytest.raises(TypeError, match="'valid' must be a bool tensor"):
        a2c_loss(td)


@pytest.mark.parametrize("loss_fn", [a2c_loss, reinforce_loss])
def test_validation_raises_before_any_computation(loss_fn, monkeypatch):
    """Each error is raised up front, before returns / advantages are computed."""
    import rl_replay.algorithms.losses as losses

    def boom(*args, **kwargs):
        raise AssertionError("computation started before validation finished")

    monkeypatch.setattr(losses, "compute_gae", boom)
    monkeypatch.setattr(losses, "discounted_returns", boom)
    monkeypatch.setattr(losses, "_sanitize", boom)

    td = hand_rollout()
    del td["entropy"]
    with pytest.raises(KeyError, match="entropy"):
        loss_fn(td)
    td = hand_rollout()
    td["next_value"] = td["next_value"].unsqueeze(-1)
    with pytest.raises(ValueError, match="'next_value' has shape"):
        loss_fn(td)
    td = hand_rollout()
    td["valid"] = torch.zeros(5, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="no valid row"):
        loss_fn(td)
    # sanity: a good rollout does reach the (patched) computation
    with pytest.raises(AssertionError, match="before validation"):
        loss_fn(hand_rollout())
