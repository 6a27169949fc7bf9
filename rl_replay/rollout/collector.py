"""Rollout collection: step a gymnasium vector env with the policy, one timestep at a time.

Autoreset (gymnasium >= 1.0, the default ``NEXT_STEP`` mode): after a sub-env's episode
ends at step ``t``, its step ``t + 1`` ignores the action and returns the reset
observation with reward 0. That row is not a transition: it is marked ``valid=False``.
Its block still runs on the *final* observation of the finished episode, and its value
output is exactly the bootstrap value ``V(final obs)`` a truncated step needs, so
``next_value[t] = value[t + 1]`` holds for every row.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from rl_replay.agent import Policy
from rl_replay.errors import NonFiniteError
from rl_replay.gathered import gathered
from rl_replay.guards import non_finite_env_step
from rl_replay.rollout.env_state import StatefulVectorEnv, pickle_envs, set_vector_statistics, vector_statistics
from rl_replay.rollout.environment import step_envs
from rl_replay.rollout.episodes import EpisodeTracker, env_action
from rl_replay.rollout.sequence import append_outputs, cat_outputs, step_inputs, truncate
from rl_replay.spaces import obs_converter
from rl_replay.targets import unpickle

__all__ = ["Collector", "Rollout"]


def _same_layout(saved: Any, own: Any) -> bool:
    """Whether ``saved`` (plain tensors, arrays and dicts) has the keys, shapes and dtypes of ``own``."""
    if isinstance(own, TensorDict):
        own = own.to_dict()
    if own is None or isinstance(own, dict):
        return (saved is None and own is None) or (
            isinstance(saved, dict)
            and isinstance(own, dict)
            and saved.keys() == own.keys()
            and all(_same_layout(saved[k], own[k]) for k in own)
        )
    if isinstance(own, (torch.Tensor, np.ndarray)):
        return type(saved) is type(own) and saved.shape == own.shape and saved.dtype == own.dtype
    return True


@dataclass
class Rollout:
    """One update's worth of experience.

    ``data`` has batch size ``[T, N]`` with keys ``observation``, ``action``, ``reward``,
    ``terminated``, ``truncated``, ``valid``, ``is_first``, ``log_prob``, ``entropy``,
    ``value`` and ``next_value``. ``log_prob``, ``entropy`` and ``value`` are attached to
    autograd when the collection's ``forward`` built a graph (see :meth:`Collector.collect`),
    detached otherwise; ``next_value`` is always detached. ``start_state`` is each env's
    recurrent state before its first row (detached): what an update re-running the rollout
    starts from.
    """

    data: TensorDict
    start_state: TensorDict
    env_steps: int
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    episode_successes: list[float] = field(default_factory=list)


#: Under FSDP with collection on gathered parameters, episode mode checks whether every rank's
#: episodes have ended once per this many steps (:class:`Collector`, ``gather_once``).
EPISODE_SYNC_STEPS = 16


class Collector:
    """Runs ``agent`` in ``envs`` for one rollout at a time; never sees losses or optimizers.

    Args:
        envs: a gymnasium vector env (``NEXT_STEP`` autoreset, the default).
        agent: the policy; pass the FSDP-wrapped module under FSDP.
        num_steps: T, steps per rollout (``fixed``) or the step cap (``episode``).
        mode: ``"fixed"`` carries env and recurrent state across rollouts; ``"episode"``
            resets all envs at the start of each rollout and stops when every env has
            finished one episode (later rows of a finished env are invalid) or at the cap.
        bptt_truncate: if set, detach the recurrent state every K steps.
        device: where observations and the policy live.
        seed: seeds the envs' first reset.
        reduce_sums: under FSDP, ``reduce_sums({name: value})`` sums scalars over ranks (one
            collective per step). Episode mode stops only once every rank's envs have
            finished, so all ranks run the same number of (collective) forwards; a
            non-finite env output on one rank stops every rank at the same step instead of
            leaving the others waiting in their next forward's all-gather.
        gather_once: under FSDP, gather the parameters once per rollout
            (:func:`rl_replay.gathered.gathered`) instead of at every step's forward
            (:func:`rl_replay.gathered.collection_plan` decides). No forward is then a
            collective, so the ranks sync less often than every step (a collective at every
            step holds every rank to the slowest one's pace): a fixed-mode rollout once, at its
            end; an episode-mode rollout every :data:`EPISODE_SYNC_STEPS` steps, so it may run
            up to that many steps past its last episode's end (rows marked invalid). A rank
            whose env went non-finite stops there and joins the next sync, where every rank raises.
    """

    def __init__(
        self,
        envs: gym.vector.VectorEnv,
        agent: torch.nn.Module,
        *,
        num_steps: int,
        mode: str = "fixed",
        bptt_truncate: int | None = None,
        device: torch.device | str = "cpu",
        seed: int | None = None,
        reduce_sums: Callable[[dict[str, float]], dict[str, float]] | None = None,
        gather_once: bool = False,
    ) -> None:
        if mode not in ("fixed", "episode"):
            raise ValueError(f"collector mode must be 'fixed' or 'episode', got {mode!r}")
        self.envs = envs
        self.policy = Policy.of(agent)  # the Agent and the module that runs it (under FSDP the wrapper)
        self.num_envs = envs.num_envs
        self.num_steps = num_steps
        self.mode = mode
        self.bptt_truncate = bptt_truncate
        self.device = torch.device(device)
        self.seed = seed
        self.reduce_sums = reduce_sums
        self.gather_once = gather_once
        self._env_id = getattr(getattr(envs, "spec", None), "id", None) or type(envs).__name__
        # numpy -> tensor (uint8 stays uint8, Discrete -> one-hot) or TensorDict (Dict/Tuple).
        self._to_tensor = obs_converter(envs.single_observation_space, self.device)
        self._obs: torch.Tensor | TensorDict | None = None
        self._state: TensorDict | None = None
        self._is_first: torch.Tensor | None = None
        self.episodes = EpisodeTracker(self.num_envs)
        self._warned_unsaved_envs = False

    # ------------------------------------------------------------------ helpers
    def _reset(self, seed: int | None) -> None:
        obs, _ = self.envs.reset(seed=seed)
        self._obs = self._to_tensor(obs)
        self._state = self.policy.agent.initial_state(self.num_envs, self.device)
        self._is_first = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        self.episodes.reset()

    def _block_inputs(self) -> TensorDict:
        """The current step's agent inputs, a one-row call (after a reset)."""
        assert self._obs is not None and self._state is not None and self._is_first is not None
        return step_inputs(self._obs, self._state, self._is_first)

    def probe_inputs(self) -> TensorDict:
        """The first block's inputs after a seeded reset, for checking the agent before a run.

        The collector forgets them: the first :meth:`collect` resets with the same seed.
        """
        self._reset(self.seed)
        inputs = self._block_inputs()
        self._obs = self._state = self._is_first = None
        return inputs

    # ------------------------------------------------------------------ collect
    def collect(self, forward: Callable[[TensorDict], TensorDict] | None = None) -> Rollout:
        """Run one rollout.

        By default the policy runs under ``torch.no_grad``: the rollout is data, and an
        update that needs gradients re-runs its rows from ``start_state`` (PPO, and A2C or
        REINFORCE with ``block_steps`` > 1). With ``forward``, each step's outputs are
        ``forward(inputs)`` for the step's input TensorDict, e.g.
        ``functools.partial(rl_replay.replay, model, accumulator)``: the rollout's
        ``log_prob``, ``entropy`` and ``value`` then stay attached to whatever graph it
        built. The collector itself never builds one.
        """
        with gathered(self.policy.module) if self.gather_once else contextlib.nullcontext():
            if forward is not None:
                return self._collect(forward)
            with torch.no_grad():
                return self._collect(lambda inputs: self.policy.module(**inputs))

    def _collect(self, forward: Callable[[TensorDict], TensorDict]) -> Rollout:
        if self.mode == "episode":
            self._reset(None if self._obs is not None else self.seed)
        elif self._obs is None:
            self._reset(self.seed)
        assert self._state is not None  # set by the reset above
        start_state = self._state.detach().clone()
        N = self.num_envs
        # Per-key columns, stacked once at the end (cheaper than a TensorDict per step).
        cols: dict[str, list] = {k: [] for k in ("observation", "is_first", "action")}
        outputs: dict = {}  # the agent's outputs but the state, key by key
        flags: dict[str, list[np.ndarray]] = {k: [] for k in ("reward", "terminated", "truncated", "valid")}
        finished = np.zeros(N, dtype=bool)  # episode mode: env already ended its episode
        returns, lengths, successes = [], [], []
        env_steps = 0
        # Under FSDP ranks agree on stopping at every step while each forward is a collective (a rank
        # stopping alone would strand the others in it); otherwise every EPISODE_SYNC_STEPS steps
        # in episode mode, and once, after the loop, in fixed mode. The sync steps are the same on
        # every rank, and a rank that stops early joins the next one.
        reduce_sums = self.reduce_sums
        distributed = reduce_sums is not None
        every = 1 if not self.gather_once else EPISODE_SYNC_STEPS if self.mode == "episode" else None
        synced = True
        problem = None
        for t in range(self.num_steps):
            observation, is_first_now = self._obs, self._is_first
            out = forward(self._block_inputs())
            with torch.no_grad():  # only to sample: log-probs and entropy come at the end
                action = self.policy.agent.distribution(out["outputs"]).sample()[0]
            append_outputs(outputs, out["outputs"])
            valid_np = self.episodes.real_steps(skip=finished)
            obs, reward, terminated, truncated, info = step_envs(
                self.envs, env_action(action, self.envs.single_action_space), self._env_id
            )
            problem = non_finite_env_step(self._env_id, obs, reward)
            if problem and self.reduce_sums is None:
                raise NonFiniteError(problem)
            env_steps += N
            done = (terminated | truncated) & valid_np
            ended, is_first = self.episodes.step(reward, terminated, truncated, info, valid_np)
            for episode in ended:
                returns.append(episode.ret)
                lengths.append(episode.length)
                if episode.success is not None:
                    successes.append(episode.success)
            for key, value in (("observation", observation), ("is_first", is_first_now), ("action", action)):
                cols[key].append(value)
            flags["reward"].append(reward)
            flags["terminated"].append(terminated & valid_np)
            flags["truncated"].append(truncated & valid_np)
            flags["valid"].append(valid_np)
            state = truncate(out["state"], t, self.bptt_truncate)
            # The step after an episode end is gymnasium's autoreset step.
            self._is_first = torch.as_tensor(is_first, device=self.device)
            self._obs, self._state = self._to_tensor(obs), state
            if self.mode == "episode":
                finished |= done
            everyone_finished = self.mode == "episode" and bool(finished.all())
            synced = not distributed
            if reduce_sums is not None and (problem or (every is not None and (t + 1) % every == 0)):
                sums = reduce_sums({"bad": float(problem is not None), "unfinished": float(not everyone_finished)})
                self._raise_if_bad(sums, problem)
                everyone_finished, synced = self.mode == "episode" and not sums["unfinished"], True
            if everyone_finished and synced:
                break
        if reduce_sums is not None and not synced:  # the last sync: the rollout ended between sync steps
            self._raise_if_bad(reduce_sums({"bad": 0.0, "unfinished": 0.0}), None)
        # Bootstrap value of the observation after the last row (no gradient needed).
        with torch.no_grad():
            bootstrap = self.policy.module(**self._block_inputs())["outputs", "value"][0]
        self._state = state.detach()  # the state after the last row
        data = {key: torch.stack(column) for key, column in cols.items()}  # (T, N, ...)
        T = data["action"].shape[0]
        # One distribution over the stacked (T, N) outputs: the loss's graph gets a few
        # nodes in all instead of a few per step (each kept until the backward).
        stacked = cat_outputs(outputs, T, N)
        del outputs
        dist = self.policy.agent.distribution(stacked)
        data.update(log_prob=dist.log_prob(data["action"]), entropy=dist.entropy(), value=stacked["value"])
        for key, column in flags.items():
            dtype = torch.float32 if key == "reward" else torch.bool
            data[key] = torch.as_tensor(np.stack(column), dtype=dtype, device=self.device)
        data["next_value"] = torch.cat([data["value"][1:].detach(), bootstrap.unsqueeze(0)])
        return Rollout(TensorDict(data, batch_size=[T, N]), start_state, env_steps, returns, lengths, successes)

    def _raise_if_bad(self, sums: dict[str, float], problem: str | None) -> None:
        if sums["bad"]:
            raise NonFiniteError(
                problem
                or f"environment '{self._env_id}' returned a non-finite "
                "value on another rank (its own error names it); every rank stops."
            )

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue collection exactly (sync envs are pickled whole; the
        wrappers' running statistics are also kept as arrays, for evaluation and async envs)."""
        state: dict[str, Any] = {
            # Plain tensors and dicts only: checkpoints store no TensorDict objects.
            "obs": self._obs.to_dict() if isinstance(self._obs, TensorDict) else self._obs,
            "obs_is_tensordict": isinstance(self._obs, TensorDict),
            "state": None if self._state is None else self._state.to_dict(),
            "is_first": self._is_first,
            "autoreset": self.episodes.autoreset.copy(),
            "ep_return": self.episodes.ep_return.copy(),
            "ep_length": self.episodes.ep_length.copy(),
            "envs": None,
            "env_statistics": vector_statistics(self.envs),
        }
        if isinstance(self.envs, StatefulVectorEnv):
            # Plain data (arrays, ints): saved with the numbers, loaded without unpickling.
            state["vector_env"] = self.envs.state_dict()
        elif isinstance(self.envs, gym.vector.SyncVectorEnv):
            try:
                # The sub-envs (with their RNGs) plus the vector env's own autoreset flags.
                state["envs"] = pickle_envs((self.envs.envs, self.envs._autoreset_envs))
            except Exception as exc:  # depends on the env: a user's wrapper holding a lambda
                if not self._warned_unsaved_envs:
                    self._warned_unsaved_envs = True
                    warnings.warn(
                        f"environments cannot be pickled ({exc}); a resume starts fresh episodes "
                        "(with the saved wrapper statistics)",
                        stacklevel=2,
                    )
        return state

    def _check_envs(self, envs: Any, autoreset: Any) -> None:
        """Raise ValueError unless unpickled sub-envs can stand in for this collector's own: as
        many, each with the observation and action spaces of the envs this run was built with."""
        if not isinstance(envs, (list, tuple)) or len(envs) != self.num_envs:
            raise ValueError(f"the env state holds {_count(envs)} envs, not this run's {self.num_envs}")
        own = self.envs.single_observation_space, self.envs.single_action_space
        for i, env in enumerate(envs):
            spaces = getattr(env, "observation_space", None), getattr(env, "action_space", None)
            for name, theirs, mine in zip(("observation", "action"), spaces, own):
                if theirs != mine:
                    raise ValueError(f"the env state's env {i} has {name} space {theirs}, not this run's {mine}")
        if np.shape(autoreset) != (self.num_envs,):
            raise ValueError(
                f"the env state's autoreset flags have shape {np.shape(autoreset)}, not ({self.num_envs},)"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`. ``state["envs"]`` is unpickled: the caller decides
        whether it may be (it sets ``envs`` None and ``fresh_envs`` to ``(why, what to do)``
        when not).

        Raises ValueError, before anything is changed, if the arrays of ``state`` are not laid
        out as this collector's (shapes, dtypes, keys): a checkpoint of other envs or agent, or
        one crafted to fail later, mid-run.
        """
        empty = gym.vector.utils.create_empty_array(self.envs.single_observation_space, n=self.num_envs)
        own = {  # the layout of a reset, made without stepping the envs or drawing random numbers
            "obs": self._to_tensor(empty),
            "state": self.policy.agent.initial_state(self.num_envs, self.device),
            "is_first": torch.ones(self.num_envs, dtype=torch.bool),
            "autoreset": self.episodes.autoreset,
            "ep_return": self.episodes.ep_return,
            "ep_length": self.episodes.ep_length,
        }
        for key, mine in own.items():
            if key == "obs" and state.get(key) is None:
                continue
            if key not in state or not _same_layout(state[key], mine):
                raise ValueError(f"the collector state's {key!r} does not fit this run's envs and agent")
        if state.get("vector_env") is not None and isinstance(self.envs, StatefulVectorEnv):
            self.envs.load_state_dict(state["vector_env"])
        elif state.get("envs") is not None:
            # unpickle: sync envs pickled before the agents/envs packages moved under rl_replay
            envs, autoreset = unpickle(state["envs"])
            self._check_envs(envs, autoreset)
            self.envs.envs, self.envs._autoreset_envs = envs, autoreset  # type: ignore[attr-defined]
        elif state.get("obs") is not None:
            # The envs could not be saved (async workers, an unpicklable wrapper): fresh
            # episodes instead of mixing, scaled by the saved wrapper statistics.
            if state.get("env_statistics"):
                set_vector_statistics(self.envs, state["env_statistics"])
            self._reset(None)
            if state.get("fresh_envs") is not None:  # the run layer would not unpickle them
                why, fix = state["fresh_envs"]
                warnings.warn(
                    f"the checkpoint's environment state is not used ({why}): the resumed run keeps "
                    "weights, optimizer and counters but starts fresh episodes with the saved wrapper "
                    f"statistics, so it does not continue exactly; {fix}.",
                    stacklevel=2,
                )
                return
            if isinstance(self.envs, gym.vector.SyncVectorEnv):
                why, fix = "the envs could not be pickled", "make the env's wrappers picklable"
            elif type(self.envs).__name__ == "EnvPoolVectorEnv":
                why, fix = "env.vectorization=envpool: EnvPool's envs live in its threads", "use env.vectorization=sync"
            else:
                why, fix = "env.vectorization=async", "use env.vectorization=sync"
            warnings.warn(
                f"the checkpoint holds no environment state ({why}): the resumed run starts fresh "
                "episodes with the saved wrapper statistics, so it does not continue exactly; "
                f"{fix} for runs that must resume exactly.",
                stacklevel=2,
            )
            return

        # Checkpoints load onto the CPU; the policy may live on a GPU.
        def to(t):
            return None if t is None else t.to(self.device)

        obs = state["obs"]
        if state.get("obs_is_tensordict"):
            obs = TensorDict(obs, batch_size=[self.num_envs])
        self._obs = to(obs)
        self._state = (
            None if state["state"] is None else TensorDict(state["state"], batch_size=[self.num_envs]).to(self.device)
        )
        self._is_first = to(state["is_first"])
        self.episodes.autoreset = state["autoreset"]
        self.episodes.ep_return = state["ep_return"]
        self.episodes.ep_length = state["ep_length"]


def _count(envs: Any) -> str:
    return str(len(envs)) if isinstance(envs, (list, tuple)) else f"a {type(envs).__name__} of"
