"""Environment state in checkpoints: sub-envs pickled whole, wrapper statistics as plain arrays.

What goes into a checkpoint about the envs (through the collector's ``state_dict``):

* a :class:`StatefulVectorEnv` (a vector env that batches itself, such as
  :class:`rl_replay.envs.memory.MemoryCueVectorEnv`): its ``state_dict()``, plain data, so a
  resume continues exactly and nothing is unpickled;
* otherwise :func:`pickle_envs`: the sync sub-envs pickled whole (episode progress, RNGs, every
  wrapper's state), so a resume continues exactly. Several gymnasium wrappers keep a local
  function (``RescaleObservation``'s ``rescale_box.<locals>.forward``, the other
  ``Transform*`` subclasses), which plain pickle refuses; such a wrapper is pickled as its
  constructor call (``gym.utils.RecordConstructorArgs`` records the arguments) on the
  unpickled inner env, and then gets its other attributes back.
* :func:`wrapper_statistics`: the running mean / variance / count of every
  ``RunningMeanStd`` a sub-env's wrappers hold (``NormalizeObservation.obs_rms``,
  ``NormalizeReward.return_rms``), readable without unpickling any env. Evaluation applies
  them pooled over the sub-envs and frozen (:func:`apply_statistics`), so a
  ``NormalizeObservation`` agent is evaluated on inputs scaled as in training; an async run
  (whose sub-envs live in worker processes and cannot be pickled from here) gets them back
  on resume through :func:`set_vector_statistics`.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym
import numpy as np
from gymnasium.wrappers.utils import RunningMeanStd

from rl_replay.errors import SetupError

__all__ = [
    "StatefulVectorEnv",
    "pickle_envs",
    "wrapper_statistics",
    "vector_statistics",
    "set_vector_statistics",
    "pool_statistics",
    "apply_statistics",
    "training_statistics",
]

Stats = list[dict[str, Any]]  # one sub-env's: {"wrapper", "attr", "mean", "var", "count"} per RunningMeanStd


@runtime_checkable
class StatefulVectorEnv(Protocol):
    """A vector env that saves and restores its whole state as plain data (arrays, numbers,
    strings, lists and dicts of them: what a checkpoint holds without pickling objects)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ----------------------------------------------------------------------------- pickling
def _is_local_function(value: Any) -> bool:
    return isinstance(value, types.FunctionType) and "<locals>" in value.__qualname__


def _rebuild_wrapper(cls: type, env: gym.Env, kwargs: dict[str, Any], state: dict[str, Any]) -> gym.Wrapper:
    """The inverse of :class:`_EnvPickler`'s reduction: rebuild, then restore the attributes."""
    wrapper = cls(env, **kwargs)
    wrapper.__dict__.update(state)
    return wrapper


class _EnvPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if (
            isinstance(obj, gym.Wrapper)
            and isinstance(obj, gym.utils.RecordConstructorArgs)
            and any(_is_local_function(v) for v in vars(obj).values())
        ):
            # The constructor makes the local function again from its arguments and the inner env.
            state = {k: v for k, v in vars(obj).items() if not _is_local_function(v)}
            return _rebuild_wrapper, (type(obj), obj.env, dict(obj._saved_kwargs), state)
        return NotImplemented


def pickle_envs(obj: Any) -> bytes:
    """``pickle.dumps(obj)`` that also pickles gymnasium wrappers holding local functions."""
    buffer = io.BytesIO()
    _EnvPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


# ----------------------------------------------------------------------------- statistics
def _chain(env: gym.Env):
    """The wrappers of ``env`` from the outermost in."""
    while isinstance(env, gym.Wrapper):
        yield env
        env = env.env


def _holders(env: gym.Env):
    """``(wrapper, attribute name, RunningMeanStd)`` for each running statistic in ``env``'s wrappers."""
    for wrapper in _chain(env):
        for name, value in vars(wrapper).items():
            if isinstance(value, RunningMeanStd):
                yield wrapper, name, value


def _wrapper_name(wrapper: gym.Wrapper) -> str:
    return f"{type(wrapper).__module__}:{type(wrapper).__qualname__}"


def wrapper_statistics(env: gym.Env) -> Stats:
    """The running statistics held by ``env``'s wrappers (outermost first), as numpy copies."""
    return [
        {
            "wrapper": _wrapper_name(w),
            "attr": name,
            "mean": np.array(rms.mean),
            "var": np.array(rms.var),
            "count": float(rms.count),
        }
        for w, name, rms in _holders(env)
    ]


# The running statistics of gymnasium's own normalizers: the attributes an async worker's env
# is asked for (get_attr / set_attr reach the first wrapper holding the name).
_ASYNC_ATTRS = ("obs_rms", "return_rms")


def vector_statistics(envs: gym.vector.VectorEnv) -> list[Stats]:
    """:func:`wrapper_statistics` of each sub-env (async: those of gymnasium's normalizers)."""
    if isinstance(envs, gym.vector.SyncVectorEnv):
        return [wrapper_statistics(env) for env in envs.envs]
    out: list[Stats] = [[] for _ in range(envs.num_envs)]
    if not isinstance(envs, gym.vector.AsyncVectorEnv):  # an env's own vector env: no wrappers
        return out
    for attr in _ASYNC_ATTRS:
        # Asked first: a worker asked for a missing attribute dies of the AttributeError.
        if not all(envs.call("has_wrapper_attr", attr)):
            continue
        for stats, rms in zip(out, envs.get_attr(attr)):
            if isinstance(rms, RunningMeanStd):
                stats.append(
                    {
                        "wrapper": None,
                        "attr": attr,
                        "mean": np.array(rms.mean),
                        "var": np.array(rms.var),
                        "count": float(rms.count),
                    }
                )
    return out


def _rms(entry: dict[str, Any]) -> RunningMeanStd:
    rms = RunningMeanStd(shape=np.shape(entry["mean"]))
    rms.mean, rms.var, rms.count = np.array(entry["mean"]), np.array(entry["var"]), entry["count"]
    return rms


def set_vector_statistics(envs: gym.vector.VectorEnv, saved: list[Stats]) -> None:
    """Put :func:`vector_statistics` back into ``envs`` (one sub-env each, in order)."""
    for attr in _ASYNC_ATTRS:
        values = [next((_rms(e) for e in stats if e["attr"] == attr), None) for stats in saved]
        if all(v is not None for v in values) and len(values) == envs.num_envs:
            envs.set_attr(attr, values)  # type: ignore[attr-defined]


def pool_statistics(per_env: Sequence[Stats]) -> Stats:
    """One set of statistics from several sub-envs': counts add, means and variances are pooled
    (the parallel-variance formula RunningMeanStd itself uses)."""
    per_env = [stats for stats in per_env if stats]
    if not per_env:
        return []
    if len({tuple((e["wrapper"], e["attr"]) for e in stats) for stats in per_env}) != 1:
        raise ValueError("the sub-envs hold different wrapper statistics; they cannot be pooled")
    pooled = []
    for entries in zip(*per_env):
        counts = np.array([e["count"] for e in entries])
        total = counts.sum()
        means = np.stack([np.asarray(e["mean"], dtype=np.float64) for e in entries])
        weights = (counts / total).reshape(-1, *([1] * (means.ndim - 1)))
        mean = (weights * means).sum(0)
        var = (
            weights * (np.stack([np.asarray(e["var"], dtype=np.float64) for e in entries]) + (means - mean) ** 2)
        ).sum(0)
        pooled.append({**entries[0], "mean": mean, "var": var, "count": float(total)})
    return pooled


def apply_statistics(env: gym.Env, stats: Stats, *, freeze: bool = True) -> None:
    """Give ``env``'s wrappers the running statistics ``stats`` (from :func:`pool_statistics`)
    and, with ``freeze``, stop them updating (``update_running_mean = False``), as evaluation
    must see inputs scaled as in training and must not move the scale.

    Raises SetupError if ``env``'s wrappers hold other statistics than ``stats`` describes.
    """
    holders = list(_holders(env))
    have = [(_wrapper_name(w), name) for w, name, _ in holders]
    want = [(e["wrapper"] or _wrapper_name(w), e["attr"]) for e, (w, _, _) in zip(stats, holders)]
    if len(holders) != len(stats) or have != want:
        raise SetupError(
            f"the checkpoint's environment statistics ({[e['attr'] for e in stats]}) do not fit the "
            f"wrappers of the environment as configured ({[name for _, name in have]}): evaluate with the "
            "run's own env.wrappers."
        )
    for (wrapper, name, _), entry in zip(holders, stats):
        setattr(wrapper, name, _rms(entry))
        if freeze and hasattr(wrapper, "update_running_mean"):
            wrapper.update_running_mean = False


def training_statistics(collector_states: Sequence[dict[str, Any]]) -> Stats | None:
    """The wrapper statistics of a checkpoint's collectors (one per rank) pooled over every
    sub-env; None for a checkpoint written before they were saved."""
    if any("env_statistics" not in state for state in collector_states):
        return None
    return pool_statistics([stats for state in collector_states for stats in state["env_statistics"]])
