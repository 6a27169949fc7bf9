"""What rl_replay keeps for compatibility: old names that still resolve, gathered in one place
with the version that drops them.

The one migration story (docs/checkpoints.md, "Migration from format 1"):

* **Checkpoint format 1** (a pickle) is no longer read by any command: it is refused with the
  command that converts a trusted file (``scripts/convert_checkpoint.py --trust``), which is
  the only code that knows the old layouts (:func:`rl_replay.rundir.legacy.convert_legacy`).
* **Module names inside pickled environments** (``env_state.pkl``, and the env pickles of a
  converted format-1 checkpoint) and **import paths in an older run's config.yaml**: while 0.1.0
  was developed the reference agents and envs were first the top-level packages ``agents`` /
  ``envs``, and the flat modules of ``rl_replay`` (``rl_replay.collector``...) then moved into
  ``rl_replay.rollout`` / ``rl_replay.run``. :func:`current_module_name` maps the old names.
* **Parameter names of the recurrent agents**: the recurrence of the LRU and minGRU agents moved
  into ``cell`` during 0.1.0 (``nu_log`` became ``cell.nu_log``, ``gate.weight``
  ``cell.gate.weight``), and ``cell`` / ``critic_cell`` were then named ``core`` / ``critic_core``,
  the word the code and the docs use for it. :func:`current_agent_keys` maps an older checkpoint's
  names where weights are loaded (evaluate, ``init_from``, a resume in one process or under FSDP,
  the optimizer state keyed by name included).
* **``ppo.norm_adv``** in an older config is read as ``loss.normalize_advantages``
  (:func:`translate_norm_adv`, called by ``rl_replay.config``).
* **An agent written to the docs before the one agent shape**: a subclass of ``rl_replay.Agent``
  whose ``forward`` takes one step (``(N, ...)`` rows) and returns ``dist``, ``value`` and
  ``state`` side by side. :func:`one_step_agent` (called by ``rl_replay.agent.build_agent``) tells
  it from a one-shape agent by a call on two sampled rows of its space, and runs it through the
  :class:`~rl_replay.StepwiseAgent` adapter (its ``forward`` becomes the step loop of the old one),
  with a DeprecationWarning. Its parameter names do not change, so its checkpoints load either way.
* **``collector.block_steps`` and ``ppo.block_steps``** (A2C / REINFORCE's and PPO's) are read as
  the one ``replay.block_steps`` (:func:`translate_block_steps`).

All of them are removed in :data:`REMOVED_IN`, the first release after 0.1.0: a test fails once
the package's version reaches it (``tests/project/test_packaging.py``), so they cannot outlive it.

What it relies on that its dependencies do not promise is NOTE [ Private APIs ], in
:mod:`rl_replay.private_apis`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

__all__ = [
    "RENAMED_PACKAGES",
    "RENAMED_MODULES",
    "current_module_name",
    "current_agent_key",
    "current_agent_keys",
    "translate_norm_adv",
    "translate_block_steps",
    "one_step_agent",
    "REMOVED_IN",
]

#: The version that drops every old name above (the first release after 0.1.0).
REMOVED_IN = "0.2.0"

# old top-level package -> where it lives now (a prefix: its submodules follow)
RENAMED_PACKAGES = {"agents": "rl_replay.agents", "envs": "rl_replay.envs"}

# old module -> new module (exact names); only what pickles or configs can name
RENAMED_MODULES = {
    "rl_replay.env_state": "rl_replay.rollout.env_state",
    "rl_replay.environment": "rl_replay.rollout.environment",
    "rl_replay.collector": "rl_replay.rollout.collector",
}


def current_module_name(module: str) -> str:
    """``module``, or its new name if it is an old one.

    ``agents.gru`` becomes ``rl_replay.agents.gru`` only where that module exists, so a
    user's own package that happens to be called ``agents`` keeps resolving to itself.
    """
    if module in RENAMED_MODULES:
        return RENAMED_MODULES[module]
    top, dot, rest = module.partition(".")
    if top not in RENAMED_PACKAGES:
        return module
    renamed = RENAMED_PACKAGES[top] + dot + rest
    try:
        found = importlib.util.find_spec(renamed) is not None
    except ImportError:  # a parent of ``renamed`` does not exist
        found = False
    return renamed if found else module


def translate_norm_adv(loaded: Mapping[str, Any], algorithm: str, path: str) -> Mapping[str, Any]:
    """``loaded`` with the retired ``ppo.norm_adv`` turned into ``loss.normalize_advantages``.

    Saved run configs (``RUN_DIR/config.yaml``) and older YAML files hold both keys with their
    old meanings: ``ppo.norm_adv`` was read by PPO only, and ``loss.normalize_advantages`` by
    a2c / reinforce only (config validation refused it true under PPO, so every old PPO file
    holds false there, which was no choice at all). So under ``loss.algorithm: ppo`` (this
    source's own, else ``algorithm``, the one loaded so far) ``norm_adv`` becomes the new key, refused if the
    source also sets ``loss.normalize_advantages: true`` against ``norm_adv: false``; under
    a2c / reinforce it is dropped, as it was ignored.
    """
    ppo = loaded.get("ppo")
    if not isinstance(ppo, Mapping) or "norm_adv" not in ppo:
        return loaded
    norm_adv = ppo["norm_adv"]
    if not isinstance(norm_adv, bool):
        raise ValueError(
            f"Invalid type for config key 'ppo.norm_adv': expected bool, got {type(norm_adv).__name__} {norm_adv!r}"
        )
    loaded = {**loaded, "ppo": {k: v for k, v in ppo.items() if k != "norm_adv"}}
    loss = loaded.get("loss")
    if loss is not None and not isinstance(loss, Mapping):
        return loaded  # the loader names the malformed section
    loss = dict(loss or {})
    if loss.get("algorithm", algorithm) != "ppo":
        return loaded
    if loss.get("normalize_advantages") is True and norm_adv is False:
        raise ValueError(
            f"Config {path!r} sets 'ppo.norm_adv: false' and 'loss.normalize_advantages: true'. "
            "ppo.norm_adv is now loss.normalize_advantages (one key for every algorithm): "
            "remove ppo.norm_adv and keep the value you mean in loss.normalize_advantages"
        )
    loss["normalize_advantages"] = norm_adv
    return {**loaded, "loss": loss}


def translate_block_steps(loaded: Mapping[str, Any], algorithm: str, path: str) -> Mapping[str, Any]:
    """``loaded`` with the retired ``collector.block_steps`` / ``ppo.block_steps`` turned into
    ``replay.block_steps``.

    Each old key was read by its own algorithms only, and a saved run config holds both (one of
    them a default nobody read): under ``loss.algorithm: ppo`` (this source's own, else
    ``algorithm``, the one loaded so far) ``ppo.block_steps`` becomes the new key, under a2c /
    reinforce ``collector.block_steps``; the other is dropped. A source that also sets
    ``replay.block_steps`` to another value is refused.
    """
    sections = {name: loaded.get(name) for name in ("collector", "ppo")}
    if not any(isinstance(sec, Mapping) and "block_steps" in sec for sec in sections.values()):
        return loaded
    loss = loaded.get("loss")
    own = loss.get("algorithm", algorithm) if isinstance(loss, Mapping) else algorithm
    read_by = "ppo" if own == "ppo" else "collector"
    out = dict(loaded)
    value = None
    for name, sec in sections.items():
        if isinstance(sec, Mapping) and "block_steps" in sec:
            if name == read_by:
                value = sec["block_steps"]
            out[name] = {k: v for k, v in sec.items() if k != "block_steps"}
    if value is None:
        return out
    replay = loaded.get("replay")
    if replay is not None and not isinstance(replay, Mapping):
        return out  # the loader names the malformed section
    replay = dict(replay or {})
    if "block_steps" in replay and replay["block_steps"] != value:
        raise ValueError(
            f"Config {path!r} sets '{read_by}.block_steps: {value}' and 'replay.block_steps: "
            f"{replay['block_steps']}'. {read_by}.block_steps is now replay.block_steps (one key for every "
            "algorithm): remove it and keep the value you mean in replay.block_steps"
        )
    replay["block_steps"] = value
    out["replay"] = replay
    return out


def current_agent_key(name: str, own: Any) -> str:
    """``name`` (a parameter or buffer name of an older checkpoint) as the agent with the names
    ``own`` calls it: ``cell.X`` / ``critic_cell.X`` as ``core.X`` / ``critic_core.X``, a bare ``X``
    as ``core.X``; a name the agent has, or none of those, is returned as it is."""
    if name in own:
        return name
    for old, new in (("cell.", "core."), ("critic_cell.", "critic_core."), ("", "core.")):
        if name.startswith(old) and new + name[len(old) :] in own:
            return new + name[len(old) :]
    return name


def current_agent_keys(weights: Mapping[str, Any], own: Any) -> dict[str, Any]:
    """``weights`` with every name renamed by :func:`current_agent_key` for the agent whose
    names are ``own`` (its ``state_dict()`` keys); a checkpoint that already fits is returned as it is."""
    own = set(own)
    return {current_agent_key(k, own): v for k, v in weights.items()}


_ADAPTED: dict[type, type] = {}


def one_step_agent(agent: Any, stepwise: type, step_loop: Any, rows: Any) -> Any:
    """``agent``, run through the ``stepwise`` adapter (``rl_replay.StepwiseAgent``) if its
    ``forward`` is a one-step forward written before the one agent shape (``step_loop``:
    ``rl_replay.agent.step_loop``; ``rows``: two observations of the agent's space, converted as the
    collector converts them, or None when the space gives none).

    The test is a call without grad on the two ``rows`` (RNG streams restored): the one shape,
    ``(1, 2)`` rows, returning ``outputs`` and ``state``, keeps the agent as it is; otherwise a
    call on ``(2,)`` rows returning ``state`` beside its outputs marks a one-step forward, and
    the agent's class becomes a subclass of its own and of the adapter whose ``forward`` is the step
    loop of the old ``forward`` (parameters, buffers, names and any ``step`` method of its own
    unchanged). An agent that fails both calls is
    left as it is, for :func:`rl_replay.contract.check_agent` to name what is wrong.
    """
    import warnings

    import torch
    from tensordict import TensorDictBase

    cls = type(agent)
    if rows is None or isinstance(agent, stepwise):  # a StepwiseAgent (or one adapted already)
        return agent

    def call(observation, is_first_shape):
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                return agent(
                    observation=observation,
                    state=agent.initial_state(2),
                    is_first=torch.ones(is_first_shape, dtype=torch.bool),
                )
            except Exception:
                return None

    out = call(rows.unsqueeze(0), (1, 2))
    if isinstance(out, TensorDictBase) and "outputs" in out.keys():
        return agent
    out = call(rows, (2,))
    if not (isinstance(out, TensorDictBase) and "state" in out.keys() and tuple(out.batch_size) == (2,)):
        return agent
    adapted = _ADAPTED.get(cls)
    if adapted is None:
        one_step = cls.forward

        def forward(self, observation, state, is_first):
            return step_loop(lambda *row: one_step(self, *row), observation, state, is_first)

        namespace = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        adapted = _ADAPTED[cls] = type(cls.__name__, (cls, stepwise), namespace)
    warnings.warn(
        f"{cls.__module__}.{cls.__qualname__}.forward takes one step: it runs through rl_replay.StepwiseAgent. "
        f"Subclass rl_replay.StepwiseAgent and rename forward to step, or write forward over (k, N) rows "
        f"(README, 'Plug in your own agent'); one-step forwards of rl_replay.Agent stop working in {REMOVED_IN}.",
        DeprecationWarning,
        stacklevel=3,
    )
    agent.__class__ = adapted
    return agent
