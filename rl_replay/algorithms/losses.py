"""Policy-gradient loss terms (A2C, REINFORCE, PPO) over a rollout; returns and GAE are in
:mod:`rl_replay.algorithms.returns`.

Everything here operates on a rollout :class:`~tensordict.TensorDict` of batch
shape ``[T, N]`` (``T`` timesteps, ``N`` environments) as produced by the
collector. Every entry used here has shape ``(T, N)`` exactly:

``reward``      float, reward of step ``t``.
``terminated``  bool, the episode ended by termination at step ``t`` (no bootstrap).
``truncated``   bool, the episode ended by a time limit at step ``t`` (bootstrap).
``valid``       bool, False for rows that are not real transitions (gymnasium's
                autoreset step after an episode end, or padding after an episode
                ended in full-episode mode). Their values are arbitrary (possibly
                NaN); they contribute nothing to any loss, statistic or gradient.
``value``       float, critic estimate ``V(s_t)``, carries the autograd graph.
``log_prob``    float, ``log pi(a_t | s_t)``, carries the autograd graph.
``entropy``     float, policy entropy at ``s_t``, carries the autograd graph.
``next_value``  float, detached, ``V`` of the observation after step ``t`` (for a
                truncated step ``V(final observation)``; for the last row the
                bootstrap value of the observation after the rollout). It is
                multiplied by ``(1 - terminated)`` here, not by the caller.

Loss functions return a TensorDict with ``batch_size=[]``: entries whose key
starts with ``loss_`` are the terms to optimise (see :func:`total_loss`);
everything else is a detached diagnostic scalar.

Invalid rows are removed with :func:`torch.where` (never by multiplying with a
0/1 mask) *before* any arithmetic, so NaN/inf garbage in them cannot leak into
values or gradients: the gradient reaching an invalid row is exactly 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import TensorDict

from rl_replay.algorithms.returns import check_same_shapes, compute_gae, discounted_returns

__all__ = [
    "compute_gae",  # re-exported from rl_replay.algorithms.returns
    "discounted_returns",
    "a2c_loss",
    "reinforce_loss",
    "gae_targets",
    "ppo_loss",
    "total_loss",
]

LOSS_PREFIX = "loss_"

_FLAG_KEYS = ("terminated", "truncated", "valid")
_ROLLOUT_KEYS = (
    "reward",
    "terminated",
    "truncated",
    "valid",
    "value",
    "log_prob",
    "entropy",
    "next_value",
)


# --------------------------------------------------------------------------- #
# Validation helpers
# --------------------------------------------------------------------------- #
def _validate_rollout(rollout: TensorDict) -> dict[str, torch.Tensor]:
    """Check keys, shapes, flag dtypes and that at least one row is valid.

    Cheap: one pass over the eight keys plus a single ``valid.any()``.

    Returns:
        dict mapping each rollout key to its tensor (T, N).

    Raises:
        KeyError: a required key is missing (names it and lists the rollout's keys).
        ValueError: shapes differ between keys, or no row is valid.
        TypeError: a flag (terminated / truncated / valid) is not a bool tensor.
    """
    present = set(rollout.keys())
    missing = [k for k in _ROLLOUT_KEYS if k not in present]
    if missing:
        raise KeyError(f"rollout is missing key(s) {missing}; rollout has keys {sorted(str(k) for k in present)}")
    tensors = {k: rollout.get(k) for k in _ROLLOUT_KEYS}
    check_same_shapes(tensors.items())
    for k in _FLAG_KEYS:
        if tensors[k].dtype != torch.bool:
            raise TypeError(f"rollout key {k!r} must be a bool tensor, got {tensors[k].dtype}")
    if not bool(tensors["valid"].any()):
        raise ValueError("rollout has no valid row (valid is False everywhere)")
    return tensors


def _sanitize(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero every float entry on invalid rows and mark invalid rows as done.

    ``torch.where`` is used so that NaN/inf in invalid rows neither reaches
    the forward values nor produces NaN gradients (the gradient flowing to
    the discarded branch is exactly 0).
    """
    valid = t["valid"]  # (T, N)
    out = {"valid": valid}
    for k in ("reward", "value", "log_prob", "entropy", "next_value"):
        out[k] = torch.where(valid, t[k], 0.0)  # (T, N)
    out["terminated"] = t["terminated"] & valid  # (T, N)
    # An invalid row is its own one-step "episode": the GAE recursion of the
    # row before it never reads it (that row is done) and it yields 0.
    out["truncated"] = t["truncated"] | ~valid  # (T, N)
    return out


# --------------------------------------------------------------------------- #
# Masked statistics
# --------------------------------------------------------------------------- #
def _masked_mean(x: torch.Tensor, valid: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over rows where ``valid`` (n_valid = valid.sum() > 0)."""
    return torch.where(valid, x, 0.0).sum() / n_valid


def _masked_var(x: torch.Tensor, valid: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """Unbiased variance (like ``x[valid].var()``) over valid rows; 0 for one row."""
    mean = _masked_mean(x, valid, n_valid)
    sq = torch.where(valid, (x - mean) ** 2, 0.0).sum()
    return sq / (n_valid - 1).clamp(min=1)


def _normalize(adv: torch.Tensor, valid: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """(adv - mean) / (std + 1e-8) with mean / std over valid rows only."""
    mean = _masked_mean(adv, valid, n_valid)
    std = _masked_var(adv, valid, n_valid).sqrt()
    return torch.where(valid, (adv - mean) / (std + 1e-8), 0.0)  # (T, N)


def _explained_variance(
    returns: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, n_valid: torch.Tensor
) -> torch.Tensor:
    """1 - Var(returns - value) / Var(returns) over valid rows; 0 if Var(returns) == 0."""
    var_y = _masked_var(returns, valid, n_valid)
    var_res = _masked_var(returns - value, valid, n_valid)
    safe = torch.where(var_y > 0, var_y, torch.ones_like(var_y))
    return torch.where(var_y > 0, 1.0 - var_res / safe, torch.zeros_like(var_y))


# --------------------------------------------------------------------------- #
# Loss terms
# --------------------------------------------------------------------------- #
def _policy_terms(
    t: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    returns: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    value_coef: float,
    entropy_coef: float,
    normalize_advantages: bool,
    with_value_loss: bool,
) -> TensorDict:
    """Shared loss/diagnostic assembly on sanitized (T, N) tensors."""
    valid = t["valid"]  # (T, N)
    value = t["value"]  # (T, N), with graph
    adv_raw = advantages.detach()  # (T, N)
    adv = _normalize(adv_raw, valid, n_valid) if normalize_advantages else adv_raw

    loss_policy = -_masked_mean(adv * t["log_prob"], valid, n_valid)
    entropy_mean = _masked_mean(t["entropy"], valid, n_valid)
    loss_entropy = -entropy_coef * entropy_mean
    if with_value_loss:
        loss_value = value_coef * 0.5 * _masked_mean((value - returns) ** 2, valid, n_valid)
    else:
        loss_value = torch.zeros((), dtype=value.dtype, device=value.device)

    value_d = value.detach()
    return TensorDict(
        {
            "loss_policy": loss_policy,
            "loss_value": loss_value,
            "loss_entropy": loss_entropy,
            "entropy": entropy_mean.detach(),
            "advantage_mean": _masked_mean(adv_raw, valid, n_valid),
            "value_mean": _masked_mean(value_d, valid, n_valid),
            "return_mean": _masked_mean(returns, valid, n_valid),
            "explained_variance": _explained_variance(returns, value_d, valid, n_valid),
        },
        batch_size=[],
    )


def _gae(t: Mapping[str, torch.Tensor], gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns of a validated, sanitized rollout."""
    return compute_gae(
        t["reward"], t["value"], t["next_value"], t["terminated"], t["truncated"], gamma=gamma, gae_lambda=gae_lambda
    )


def a2c_loss(
    rollout: TensorDict,
    *,
    gamma: float = 0.99,
    gae_lambda: float = 0.95,
    value_coef: float = 0.5,
    entropy_coef: float = 0.01,
    normalize_advantages: bool = True,
) -> TensorDict:
    """Advantage actor-critic loss terms with GAE, masked to valid rows.

    Args:
        rollout: TensorDict of batch shape [T, N] with the keys listed in the
            module docstring, each (T, N).
        gamma: discount factor.
        gae_lambda: GAE lambda.
        value_coef: weight of the value loss.
        entropy_coef: weight of the entropy bonus.
        normalize_advantages: normalise advantages to zero mean / unit std
            (std + 1e-8) over valid rows before the policy loss.

    Returns:
        TensorDict (batch_size []) with
        ``loss_policy = -mean_valid(adv.detach() * log_prob)``,
        ``loss_value = value_coef * 0.5 * mean_valid((value - returns)^2)``,
        ``loss_entropy = -entropy_coef * mean_valid(entropy)`` and the detached
        diagnostics ``entropy`` (mean), ``advantage_mean`` (before
        normalisation), ``value_mean``, ``return_mean``, ``explained_variance``.

    Raises:
        KeyError: a required key is missing.
        ValueError: shape mismatch between keys, or no valid row.
        TypeError: terminated / truncated / valid is not bool.
    """
    t = _sanitize(_validate_rollout(rollout))
    n_valid = t["valid"].sum()  # () int
    advantages, returns = _gae(t, gamma, gae_lambda)  # (T, N) each
    return _policy_terms(
        t,
        advantages,
        returns,
        n_valid,
        value_coef=value_coef,
        entropy_coef=entropy_coef,
        normalize_advantages=normalize_advantages,
        with_value_loss=True,
    )


def reinforce_loss(
    rollout: TensorDict,
    *,
    gamma: float = 0.99,
    baseline: bool = True,
    value_coef: float = 0.5,
    entropy_coef: float = 0.0,
    normalize_advantages: bool = False,
) -> TensorDict:
    """REINFORCE loss terms with Monte-Carlo returns, masked to valid rows.

    Returns are :func:`discounted_returns` (bootstrapped from ``next_value``
    at truncation and at the last row). With ``baseline`` the advantage is
    ``returns - value.detach()`` and the critic is trained with ``loss_value``;
    without it the advantage is ``returns`` and ``loss_value`` is an exact 0
    tensor without graph (still present so logs are uniform). The rollout must
    hold all keys either way (``value`` feeds the diagnostics).

    Args:
        rollout: TensorDict of batch shape [T, N] with the keys listed in the
            module docstring, each (T, N).
        gamma: discount factor.
        baseline: subtract the critic's value from the returns and train it.
        value_coef: weight of the value loss (only with ``baseline``).
        entropy_coef: weight of the entropy bonus.
        normalize_advantages: normalise advantages over valid rows.

    Returns:
        TensorDict (batch_size []) with ``loss_policy``, ``loss_value``,
        ``loss_entropy`` and the diagnostics of :func:`a2c_loss`.

    Raises:
        KeyError: a required key is missing.
        ValueError: shape mismatch between keys, or no valid row.
        TypeError: terminated / truncated / valid is not bool.
    """
    t = _sanitize(_validate_rollout(rollout))
    n_valid = t["valid"].sum()  # () int
    returns = discounted_returns(t["reward"], t["next_value"], t["terminated"], t["truncated"], gamma=gamma)  # (T, N)
    advantages = returns - t["value"].detach() if baseline else returns  # (T, N)
    return _policy_terms(
        t,
        advantages,
        returns,
        n_valid,
        value_coef=value_coef,
        entropy_coef=entropy_coef,
        normalize_advantages=normalize_advantages,
        with_value_loss=baseline,
    )


def gae_targets(
    rollout: TensorDict, *, gamma: float = 0.99, gae_lambda: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE advantages and returns of a detached rollout, for updates that reuse it (PPO).

    The same validation, invalid-row sanitising and truncation bootstrap as
    :func:`a2c_loss`; computed once per rollout.

    Args:
        rollout: TensorDict of batch shape [T, N] with the keys of the module docstring.
        gamma: discount factor.
        gae_lambda: GAE lambda.

    Returns:
        ``(advantages, returns, explained_variance)``: two detached (T, N) tensors (0 on
        invalid rows) and the scalar explained variance of the rollout's values.

    Raises:
        KeyError, ValueError, TypeError: as :func:`a2c_loss`.
    """
    t = _sanitize(_validate_rollout(rollout))
    advantages, returns = _gae(t, gamma, gae_lambda)  # (T, N) each
    valid = t["valid"]
    advantages = torch.where(valid, advantages, 0.0)
    returns = torch.where(valid, returns, 0.0)
    ev = _explained_variance(returns, t["value"].detach(), valid, valid.sum())
    return advantages, returns, ev


_PPO_KEYS = ("log_prob", "entropy", "value", "old_log_prob", "old_value", "advantage", "return", "valid")


def ppo_loss(
    batch: TensorDict,
    *,
    clip_coef: float = 0.2,
    clip_vloss: bool = True,
    value_coef: float = 0.5,
    entropy_coef: float = 0.0,
    normalize_advantages: bool = True,
) -> TensorDict:
    """Clipped-surrogate PPO loss terms of one minibatch, masked to valid rows.

    CleanRL's ``ppo.py`` objective: with ``ratio = exp(log_prob - old_log_prob)``,
    ``loss_policy = mean(max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c)))``; the value
    loss is ``value_coef * 0.5 * mean(max((v - R)^2, (v_clip - R)^2))`` with
    ``v_clip = old_value + clip(v - old_value, -c, c)`` when ``clip_vloss``, else
    ``value_coef * 0.5 * mean((v - R)^2)``; ``loss_entropy = -entropy_coef * mean(entropy)``.

    Args:
        batch: TensorDict whose entries are all (T, n): ``log_prob``, ``entropy`` and
            ``value`` of the re-run policy (with graph), the collected ``old_log_prob``
            and ``old_value``, the rollout's ``advantage`` and ``return`` and ``valid``.
        clip_coef: the clip range c of the ratio (and of the value, with ``clip_vloss``).
        clip_vloss: clip the value update around the collected value.
        value_coef: weight of the value loss.
        entropy_coef: weight of the entropy bonus.
        normalize_advantages: normalise the advantages over this minibatch's valid rows.

    Returns:
        TensorDict (batch_size []) with ``loss_policy``, ``loss_value``, ``loss_entropy``
        and the detached diagnostics ``entropy``, ``approx_kl`` (``mean((ratio - 1) -
        log ratio)``), ``old_approx_kl`` (``mean(-log ratio)``) and ``clipfrac``.

    Raises:
        KeyError: a required key is missing.
        ValueError: shape mismatch between keys, or no valid row.
    """
    missing = [k for k in _PPO_KEYS if k not in batch.keys()]
    if missing:
        raise KeyError(f"PPO batch is missing key(s) {missing}; it has {sorted(map(str, batch.keys()))}")
    raw = {k: batch.get(k) for k in _PPO_KEYS}
    check_same_shapes(raw.items())
    valid = raw["valid"].bool()  # (T, n)
    if not bool(valid.any()):
        raise ValueError("PPO batch has no valid row (valid is False everywhere)")
    n_valid = valid.sum()
    # Invalid rows are zeroed before any arithmetic (see the module docstring).
    t = {k: torch.where(valid, raw[k], 0.0) for k in _PPO_KEYS if k != "valid"}
    adv = t["advantage"].detach()
    if normalize_advantages:
        adv = _normalize(adv, valid, n_valid)
    log_ratio = t["log_prob"] - t["old_log_prob"].detach()  # (T, n)
    ratio = log_ratio.exp()
    surrogate = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef))
    loss_policy = _masked_mean(surrogate, valid, n_valid)

    value, ret, old_value = t["value"], t["return"].detach(), t["old_value"].detach()
    value_err = (value - ret) ** 2
    if clip_vloss:
        clipped = old_value + (value - old_value).clamp(-clip_coef, clip_coef)
        value_err = torch.max(value_err, (clipped - ret) ** 2)
    loss_value = value_coef * 0.5 * _masked_mean(value_err, valid, n_valid)
    entropy_mean = _masked_mean(t["entropy"], valid, n_valid)
    with torch.no_grad():
        approx_kl = _masked_mean((ratio - 1.0) - log_ratio, valid, n_valid)
        old_approx_kl = _masked_mean(-log_ratio, valid, n_valid)
        clipfrac = _masked_mean(((ratio - 1.0).abs() > clip_coef).to(ratio.dtype), valid, n_valid)
    return TensorDict(
        {
            "loss_policy": loss_policy,
            "loss_value": loss_value,
            "loss_entropy": -entropy_coef * entropy_mean,
            "entropy": entropy_mean.detach(),
            "approx_kl": approx_kl,
            "old_approx_kl": old_approx_kl,
            "clipfrac": clipfrac,
        },
        batch_size=[],
    )


def total_loss(terms: TensorDict) -> torch.Tensor:
    """Sum of the entries whose key starts with ``loss_``.

    Args:
        terms: TensorDict returned by a loss function.

    Returns:
        Scalar tensor to call ``backward()`` on.

    Raises:
        ValueError: ``terms`` holds no ``loss_*`` entry.
    """
    keys = [k for k in terms.keys() if isinstance(k, str) and k.startswith(LOSS_PREFIX)]
    if not keys:
        raise ValueError(f"no '{LOSS_PREFIX}*' entry to sum; keys are {sorted(map(str, terms.keys()))}")
    total = terms.get(keys[0])
    for k in keys[1:]:
        total = total + terms.get(k)
    return total
