"""Environment construction: ids, imports and wrappers from the config, checked up front.

``env.id`` is any registered gymnasium id, or gymnasium's own ``module:EnvId`` form (the
module is imported first, which registers the id). ``env.imports`` names modules to import
before the env is made (e.g. ``popgym``), and ``env.wrappers`` lists gymnasium wrappers
applied to each sub-env in order, each ``{target: "module:Class", kwargs: {...}}``.
Last, a Dict observation keeps the keys ``env.observation_keys`` names; without that key its
non-tensor keys (MiniGrid's ``mission`` text) are dropped with a warning naming them.
Every mistake is a one-line :class:`~rl_replay.errors.SetupError` raised before anything
is built.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from rl_replay.config import EnvConfig
from rl_replay.errors import EnvStepError, SetupError, one_line, shown
from rl_replay.spaces import usable_keys
from rl_replay.targets import OWN, Importer, split_env_id

__all__ = [
    "import_env_modules",
    "resolve_env_id",
    "load_wrappers",
    "observation_filter",
    "make_env",
    "make_vector_env",
    "step_envs",
    "env_episode_return",
]

# info key of the episode statistics recorded beneath the configured wrappers (see make_vector_env).
RAW_EPISODE_KEY = "env_episode"

# Wrapper bounds from a config are Python floats (float64), and a float32 Box casting them makes
# gymnasium warn at every start (RescaleObservation's min_obs / max_obs): the cast is the point.
warnings.filterwarnings(
    "ignore", message=r".*Box (low|high)'s precision lowered by casting", module=r"gymnasium\.spaces\.box"
)

_REGISTER_HINT = (
    "A custom env must be registered (gymnasium.register(id=..., entry_point='pkg.mod:MyEnv')) "
    "in a module that is imported first: list it in env.imports, or write env.id=pkg.mod:MyEnv-v0."
)


def import_env_modules(modules: Sequence[str], importer: Importer = OWN) -> None:
    """Import each module (they register their env ids on import) through ``importer``."""
    import rl_replay.envs  # noqa: F401  (the project's own rl_replay/* ids)

    for name in modules:
        importer.import_module(name, "env.imports")


def resolve_env_id(env_id: str, imports: Sequence[str] = (), importer: Importer = OWN) -> str:
    """Import what ``env_id`` needs (through ``importer``) and return the registered id
    (``module:`` prefix removed)."""
    import_env_modules(imports, importer)
    module, env_id = split_env_id(env_id)
    if module is not None:
        importer.import_module(module, f"env.id {shown(f'{module}:{env_id}')}")
    if env_id not in gym.registry:
        stem = env_id.split("/")[-1].split("-")[0].lower()
        known = sorted(k for k in gym.registry if stem and stem in k.lower())
        hint = f" Similar ids: {', '.join(known[:8])}." if known else ""
        raise SetupError(f"unknown environment id {shown(env_id)}.{hint} {_REGISTER_HINT}")
    return env_id


# Wrappers that write files where their kwargs say, or open windows: not from a foreign config.
_ACTING_WRAPPERS = ("RecordVideo", "HumanRendering")


def load_wrappers(specs: Sequence[Mapping[str, Any]], importer: Importer = OWN) -> list[Callable[[gym.Env], gym.Env]]:
    """Turn ``[{target, kwargs}, ...]`` into wrapper callables ``env -> wrapped env``, in order,
    resolving their targets through ``importer``.

    ``functools.partial`` of an importable class pickles, so ``async`` vector envs work too.
    """
    wrappers = []
    for i, spec in enumerate(specs):
        what = f"env.wrappers[{i}].target"
        wrapper = importer.resolve(spec["target"], what)
        # A config may come from someone else's run directory: call nothing but a wrapper class.
        if not (isinstance(wrapper, type) and issubclass(wrapper, gym.Wrapper)):
            raise SetupError(f"{what} {shown(spec['target'])} is {shown(wrapper)}, not a gymnasium.Wrapper subclass.")
        why = importer.foreign
        if why is not None and wrapper.__name__ in _ACTING_WRAPPERS:
            raise SetupError(
                f"{what} {shown(spec['target'])} writes files or opens windows where its kwargs say; {why}"
            )
        wrappers.append(functools.partial(wrapper, **dict(spec.get("kwargs") or {})))
    return wrappers  # type: ignore[return-value]


class SelectKeys(gym.ObservationWrapper):
    """Keeps the ``keys`` of a Dict observation (gymnasium's ``FilterObservation`` holds a
    lambda, which would keep the envs out of the checkpoint's pickle)."""

    def __init__(self, env: gym.Env, keys: Sequence[str]):
        super().__init__(env)
        self.keys = list(keys)
        self.observation_space = gym.spaces.Dict({k: env.observation_space[k] for k in self.keys})  # type: ignore[index]

    def observation(self, observation):
        return {k: observation[k] for k in self.keys}


# The drop warnings already printed: a run makes its envs again for every evaluation.
_WARNED: set[str] = set()


def observation_filter(space: gym.Space, observation_keys: Sequence[str] = ()) -> Callable[[gym.Env], gym.Env] | None:
    """The wrapper that keeps ``observation_keys`` of a Dict observation ``space`` (or, without
    them, its tensor keys, with one warning line on stderr naming the others, once per process);
    None when nothing is to be dropped."""
    selection = usable_keys(space, list(observation_keys))
    if selection is None:
        return None
    kept, dropped = selection
    if dropped and not observation_keys:
        kinds = ", ".join(f"{k}: {type(space[k]).__name__}" for k in dropped)  # type: ignore[index]
        line = (
            f"warning: dropping the observation keys {dropped} ({kinds}), which hold no tensors; "
            f"keeping {kept}. Set env.observation_keys to choose the keys."
        )
        if line not in _WARNED:
            _WARNED.add(line)
            print(line, file=sys.stderr, flush=True)
    return functools.partial(SelectKeys, keys=kept)


def _make_kwargs(kwargs: Mapping[str, Any] | None, max_episode_steps: int | None) -> dict[str, Any]:
    out = dict(kwargs or {})
    if max_episode_steps is not None:
        out["max_episode_steps"] = max_episode_steps
    return out


def _record_env_episodes(env: gym.Env) -> gym.Env:
    # Beneath the configured wrappers: the env's own rewards, whatever they rescale.
    return gym.wrappers.RecordEpisodeStatistics(env, stats_key=RAW_EPISODE_KEY)


def _make(env_id: str, kwargs: Mapping[str, Any] | None, make_kwargs: dict[str, Any]) -> gym.Env:
    """``gym.make`` whose failures are one line naming the env (and, for a missing optional
    dependency, what to install)."""
    try:
        return gym.make(env_id, **make_kwargs)
    except TypeError as exc:
        raise SetupError(
            f"environment '{env_id}' rejected env.kwargs {shown(dict(kwargs or {}))}: {one_line(str(exc))[:300]}"
        ) from None
    except (gym.error.DependencyNotInstalled, ImportError) as exc:
        raise SetupError(
            f"environment '{env_id}' needs an optional dependency that is not installed: {one_line(str(exc))[:300]}"
        ) from None
    except SetupError:
        raise
    except Exception as exc:
        raise SetupError(
            f"environment '{env_id}' could not be made ({type(exc).__name__}: {one_line(str(exc))[:300]})"
        ) from None


def _culprit(exc: BaseException) -> str | None:
    """The innermost wrapper (or env) a traceback passed through: who raised ``exc``."""
    name = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, (gym.Wrapper, gym.Env)):
            name = type(owner).__name__
        tb = tb.tb_next
    return name


def step_envs(envs: gym.vector.VectorEnv, actions: Any, env_id: str) -> tuple:
    """``envs.step(actions)``; an exception from the env or a wrapper is one
    :class:`~rl_replay.errors.EnvStepError` line naming the env and the wrapper it came from."""
    try:
        return envs.step(actions)
    except Exception as exc:
        raise EnvStepError(
            f"environment {shown(env_id)} failed when stepped, in {_culprit(exc) or shown(env_id)} "
            f"({type(exc).__name__}: {one_line(str(exc))[:300]})"
        ) from None


def _try_step(env: gym.Env, env_id: str) -> None:
    """Reset ``env`` and step it once: a wrapper whose kwargs fail only once called (a reward
    function that is not callable) is then one line naming it, before anything is written."""
    try:
        env.reset()
        env.step(env.action_space.sample())
    except Exception as exc:
        who = _culprit(exc) or env_id
        raise SetupError(
            f"environment '{env_id}' failed when stepped, in {who} ({type(exc).__name__}: "
            f"{one_line(str(exc))[:300]}): check env.kwargs and env.wrappers."
        ) from None


def _apply(env: gym.Env, wrappers: Sequence[Callable], specs: Sequence[Mapping[str, Any]]) -> gym.Env:
    for i, wrapper in enumerate(wrappers):
        try:
            env = wrapper(env)
        except Exception as exc:
            raise SetupError(
                f"env.wrappers[{i}] {shown(specs[i]['target'])} failed on {shown(env)}: {one_line(str(exc))[:300]}"
            ) from None
    return env


def make_env(
    env_id: str,
    *,
    imports: Sequence[str] = (),
    wrappers: Sequence[Mapping[str, Any]] = (),
    kwargs: Mapping[str, Any] | None = None,
    max_episode_steps: int | None = None,
    render_mode: str | None = None,
    observation_keys: Sequence[str] = (),
    importer: Importer = OWN,
) -> gym.Env:
    """One wrapped env (evaluation videos); the same ids, imports, wrappers and observation keys
    as training (with the same episode statistics beneath them as :func:`make_vector_env`)."""
    env_id = resolve_env_id(env_id, imports, importer)
    loaded = load_wrappers(wrappers, importer)
    make_kwargs = _make_kwargs(kwargs, max_episode_steps)
    if render_mode is not None:
        make_kwargs["render_mode"] = render_mode
    env = _make(env_id, kwargs, make_kwargs)
    env = _apply(_record_env_episodes(env) if loaded else env, loaded, wrappers)
    select = observation_filter(env.observation_space, observation_keys)
    return env if select is None else select(env)


def make_vector_env(
    env_id: str,
    num_envs: int,
    *,
    vectorization: str = "sync",
    kwargs: Mapping[str, Any] | None = None,
    max_episode_steps: int | None = None,
    imports: Sequence[str] = (),
    wrappers: Sequence[Mapping[str, Any]] = (),
    observation_keys: Sequence[str] = (),
    importer: Importer = OWN,
) -> gym.vector.VectorEnv:
    """Build ``num_envs`` copies of ``env_id``, each wrapped by ``wrappers`` in order, then by
    the selection of a Dict observation's keys (:func:`observation_filter`).

    With wrappers, each sub-env first gets a ``RecordEpisodeStatistics`` beneath them, so the
    env's own episode return is still known when a wrapper rescales rewards (``NormalizeReward``);
    read it with :func:`env_episode_return`.

    ``vectorization`` is ``sync``, ``async``, ``vector_entry_point`` (the env's own batched
    vector env, registered as its ``vector_entry_point``, which takes no wrappers) or ``envpool``
    (:class:`~rl_replay.rollout.envpool_env.EnvPoolVectorEnv`: EnvPool's envs, configured by their
    own options in ``kwargs``, no wrappers).

    The project's own environments (``rl_replay/...``) are registered on import of ``rl_replay.envs``.
    """
    if vectorization == "envpool":
        return _make_envpool(env_id, num_envs, kwargs, max_episode_steps, wrappers, observation_keys)
    env_id = resolve_env_id(env_id, imports, importer)
    if vectorization == "vector_entry_point":
        return _make_own_vector_env(env_id, num_envs, kwargs, max_episode_steps, wrappers, observation_keys)
    loaded = load_wrappers(wrappers, importer)
    # Try the wrappers once on a throwaway env so a bad wrapper is one clear line here,
    # not a traceback from inside a vector env (or an async worker process); its observation
    # space says which Dict keys each sub-env keeps.
    probe = _apply(_make(env_id, kwargs, _make_kwargs(kwargs, max_episode_steps)), loaded, wrappers)
    try:
        if loaded:
            _try_step(probe, env_id)
    finally:
        probe.close()
    select = observation_filter(probe.observation_space, observation_keys)
    try:
        if loaded:
            loaded = [_record_env_episodes, *loaded]
        if select is not None:
            loaded = [*loaded, select]
        return gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode=vectorization,
            wrappers=loaded,  # type: ignore[arg-type]
            **_make_kwargs(kwargs, max_episode_steps),
        )
    except TypeError as exc:
        raise SetupError(
            f"environment '{env_id}' rejected env.kwargs {shown(dict(kwargs or {}))}: {one_line(str(exc))[:300]}"
        ) from None


def _make_own_vector_env(env_id, num_envs, kwargs, max_episode_steps, wrappers, observation_keys):
    # gymnasium's vector_entry_point mode takes no per-env wrappers: the env batches itself.
    spec = gym.spec(env_id)
    if spec.vector_entry_point is None:
        raise SetupError(
            f"env.vectorization=vector_entry_point: environment '{env_id}' registers no vector_entry_point; "
            "use env.vectorization=sync."
        )
    if wrappers or observation_keys:
        raise SetupError(
            "env.vectorization=vector_entry_point steps the env's own vector env, which takes no "
            "env.wrappers or env.observation_keys; remove them or use env.vectorization=sync."
        )
    try:
        return gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode="vector_entry_point",
            **_make_kwargs(kwargs, max_episode_steps),
        )
    except (TypeError, ValueError) as exc:
        raise SetupError(
            f"environment '{env_id}' rejected env.kwargs {shown(dict(kwargs or {}))}: {one_line(str(exc))[:300]}"
        ) from None


def _make_envpool(env_id, num_envs, kwargs, max_episode_steps, wrappers, observation_keys):
    # EnvPool preprocesses in C++ by its own options (env.kwargs); gymnasium wrappers cannot reach in.
    if wrappers or observation_keys:
        raise SetupError(
            "env.vectorization=envpool steps EnvPool's envs, which take no env.wrappers or env.observation_keys: "
            "configure EnvPool's own preprocessing in env.kwargs (frame_skip, noop_max, episodic_life, "
            "reward_clip, stack_num...), or use env.vectorization=sync."
        )
    from rl_replay.rollout.envpool_env import EnvPoolVectorEnv

    return EnvPoolVectorEnv(env_id, num_envs, kwargs, max_episode_steps)


def envs_from_config(
    env: EnvConfig, num_envs: int | None = None, *, vectorization: str = "sync", importer: Importer = OWN
) -> gym.vector.VectorEnv:
    """:func:`make_vector_env` with every setting of a config's ``env`` section
    (``num_envs`` copies, default ``env.num_envs``), importing through the config's ``importer``."""
    return make_vector_env(
        env.id,
        env.num_envs if num_envs is None else num_envs,
        vectorization=vectorization,
        kwargs=env.kwargs,
        max_episode_steps=env.max_episode_steps,
        imports=env.imports,
        wrappers=env.wrappers,
        observation_keys=env.observation_keys,
        importer=importer,
    )


def env_episode_return(info: Mapping[str, Any], i: int, summed: float) -> float:
    """Sub-env ``i``'s finished episode return as the env itself paid it.

    ``summed`` is the sum of the rewards the vector env returned; a configured reward wrapper
    (``NormalizeReward``) changes those, so the statistics recorded beneath the wrappers win.
    """
    stats = info.get(RAW_EPISODE_KEY)
    if stats is not None and info.get("_" + RAW_EPISODE_KEY, np.ones(i + 1, bool))[i]:
        return float(stats["r"][i])
    return float(summed)
