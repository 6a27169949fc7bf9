"""Helpers for the distributed replay tests: spawned gloo workers on CPU.

``run_workers(name, world_size, outdir)`` spawns ``world_size`` processes with
``torch.multiprocessing.spawn``; each joins a gloo process group on a free local TCP
port, calls the module-level function ``name(rank, world_size)`` and saves what it
returns to ``outdir/rank<r>.pt``. The parent gets the list of per-rank results. An
exception that escapes a worker makes ``spawn`` raise in the parent with the worker's
traceback; the scenario runners below instead catch per scenario and return the
traceback text, so one broken scenario fails its own test and no other.

The gradient comparisons themselves happen in the parent (``assert_grads_match``), so
the per-family worst-difference table covers the distributed tests too.
"""

from __future__ import annotations

import copy
import functools
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from _policies import GRUPolicy, MLPPolicy, gru_loss, step_loss  # noqa: F401  (also used as _dist.X)
from tensordict import TensorDict

from rl_replay import (
    GradientAccumulator,
    ReplayError,
    checkpoint_fsdp_forward,
    replay,
    replay_sequence_call,
    replay_steps,
)
from rl_replay.algorithms.stored import OneStep

OK = "ok"
#: seconds a spawned pair of ranks may take (run_ranks)
WORKER_TIMEOUT_S = 240


# ------------------------------------------------------------------------- plumbing
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, name: str, outdir: str, backend: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=60),
    )
    try:
        result = globals()[name](rank, world_size)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        # Leave together: a rank tearing gloo down while its peer still talks to it
        # aborts ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalisation, where gloo's C++ teardown aborts now and then.
    os._exit(0)


def run_workers(name: str, world_size: int, outdir, backend: str = "gloo") -> list:
    mp.spawn(
        _entry,
        args=(world_size, free_port(), name, str(outdir), backend),
        nprocs=world_size,
        join=True,
    )
    return [torch.load(os.path.join(str(outdir), f"rank{r}.pt")) for r in range(world_size)]


def _env_entry(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        fn(rank, world_size, *args)
        if dist.is_initialized():
            # Leave together: a rank tearing gloo down while its peer still talks to it
            # aborts ("terminate called without an active exception").
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Skip interpreter finalisation, where gloo's C++ teardown aborts now and then.
    os._exit(0)


def run_ranks(fn, *args, world_size: int = 2, timeout: float = WORKER_TIMEOUT_S) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    A worker's exception is re-raised here (with the worker's traceback); a run that
    exceeds ``timeout`` seconds (e.g. ranks deadlocked in a collective) is killed.
    """
    port = free_port()
    context = mp.start_processes(
        _env_entry, args=(world_size, port, fn, args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed workers did not finish within {timeout:.0f} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join()


def run_scenarios(scenarios: dict, *args) -> dict:
    """``{name: result or {"error": traceback}}`` for each scenario."""
    results = {}
    for name, fn in scenarios.items():
        try:
            results[name] = fn(*args)
        except Exception:  # reported to the parent, which fails that scenario's test
            results[name] = {"error": traceback.format_exc()}
    return results


def clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def rank_data(r: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 + r))


def _fsdp(module, wrap, **kwargs):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs.setdefault("sharding_strategy", ShardingStrategy.FULL_SHARD)
    kwargs.setdefault("use_orig_params", True)
    return FSDP(
        module,
        auto_wrap_policy=ModuleWrapPolicy(wrap) if wrap else None,
        device_id=torch.device("cpu"),
        **kwargs,
    )


def _full_grads(fsdp_model) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(fsdp_model, with_grads=True):
        return {clean(n): None if p.grad is None else p.grad.detach().clone() for n, p in fsdp_model.named_parameters()}


def _full_params(fsdp_model) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(fsdp_model):
        return {clean(n): p.detach().clone() for n, p in fsdp_model.named_parameters()}


def _ref_step(ref, max_norm, lr):
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    return norm


def _fsdp_mlp(rank: int, world: int, wrap=(nn.Linear,)) -> dict:
    """Independent blocks, every Linear its own FSDP unit, checkpoint_fsdp_forward."""
    T, B = 10, 4
    torch.manual_seed(0)  # identical initial weights on every rank
    ref = MLPPolicy()
    model = _fsdp(copy.deepcopy(ref), set(wrap))
    data = [rank_data(r, T, B, 6) for r in range(world)]

    acc = GradientAccumulator()
    loss = sum(step_loss(*checkpoint_fsdp_forward(model, acc, observation=data[rank][t])) for t in range(T))
    loss.backward()
    grads = _full_grads(model)

    # Reference: plain autograd on each rank's data, averaged (FSDP averages over ranks).
    for r in range(world):
        sum(step_loss(*ref(data[r][t])) for t in range(T)).backward()
    for p in ref.parameters():
        p.grad /= world
    expected = {n: p.grad.clone() for n, p in ref.named_parameters()}

    max_norm, lr = 0.05, 0.1
    norm = model.clip_grad_norm_(max_norm)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    ref_norm = _ref_step(ref, max_norm, lr)
    return {
        "grads": grads,
        "expected": expected,
        "norm": norm.detach().reshape(1),
        "ref_norm": ref_norm.detach().reshape(1),
        "params": _full_params(model),
        "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()},
        "counters": (acc.num_blocks, acc.blocks_replayed, acc.backward_passes),
    }


def _fsdp_gru(rank: int, world: int, **fsdp_kwargs) -> dict:
    """Recurrent state across blocks, Linear and GRUCell units, replay() API, two
    rollouts accumulating into .grad (the second starts with the first's gradients)."""
    T, B, H = 12, 3, 12
    torch.manual_seed(1)
    ref = GRUPolicy()
    model = _fsdp(copy.deepcopy(ref), {nn.Linear, nn.GRUCell}, **fsdp_kwargs)
    obs = [[rank_data(r + 10 * k, T, B, 5) for r in range(world)] for k in range(2)]
    h0 = [rank_data(r + 100, B, H) for r in range(world)]
    out: dict = {}

    for k in range(2):  # two rollouts, no zero_grad in between
        h_rep = h0[rank].clone().requires_grad_()
        acc = GradientAccumulator()
        gru_loss(model, obs[k][rank], h_rep, acc).backward()
        assert acc.blocks_replayed == T and acc.backward_passes == 1
        out[f"grads{k}"] = _full_grads(model)
        for r in range(world):
            h_ref = h0[r].clone().requires_grad_()
            loss = gru_loss(ref, obs[k][r], h_ref) / world
            loss.backward()
            if r == rank:
                # The input gradient is local to the rank; undo the 1/world scaling.
                out[f"h0_{k}"], out[f"h0_ref{k}"] = h_rep.grad, h_ref.grad * world
        out[f"expected{k}"] = {n: p.grad.clone() for n, p in ref.named_parameters()}

    max_norm, lr = 0.5, 0.2
    out["norm"] = model.clip_grad_norm_(max_norm).detach().reshape(1)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    out["ref_norm"] = _ref_step(ref, max_norm, lr).detach().reshape(1)
    out["params"] = _full_params(model)
    out["ref_params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return out


class TDGRUPolicy(GRUPolicy):
    """GRUPolicy returning a TensorDict, as rl_replay.Agent subclasses do."""

    def forward(self, observation, h):
        logits, value, h = super().forward(observation, h)
        return TensorDict(
            logits=logits, value=value, state=TensorDict(h=h, batch_size=h.shape[:1]), batch_size=h.shape[:1]
        )


def _fsdp_gru_tensordict(rank: int, world: int) -> dict:
    """A model returning a TensorDict, wrapped with plain FSDP1 (no rl_replay helper):
    FSDP1 does not see tensors inside TensorDicts, so the engine hooks them itself."""
    T, B, H = 8, 3, 12
    torch.manual_seed(2)
    ref = TDGRUPolicy()
    model = _fsdp(copy.deepcopy(ref), {nn.Linear})  # the GRUCell stays in the root unit
    obs = [rank_data(r + 50, T, B, 5) for r in range(world)]

    def rollout(m, x, acc=None):
        h, loss = torch.zeros(B, H), 0.0
        for t in range(T):
            inputs = TensorDict(observation=x[t], h=h, batch_size=[B])
            out = m(**inputs) if acc is None else replay(m, acc, inputs)
            h = out["state", "h"]
            loss = loss + step_loss(out["logits"], out["value"])
        return loss + h.square().sum()

    acc = GradientAccumulator()
    rollout(model, obs[rank], acc).backward()
    grads = _full_grads(model)
    for r in range(world):
        (rollout(ref, obs[r]) / world).backward()
    return {"grads": grads, "expected": {n: p.grad.clone() for n, p in ref.named_parameters()}}


class StateGRUPolicy(GRUPolicy):
    """GRUPolicy in the multi-step calling convention: ``forward(observation, state)``."""

    def forward(self, observation, state):
        logits, value, h = super().forward(observation, state["h"])
        return TensorDict(
            logits=logits, value=value, state=TensorDict(h=h, batch_size=h.shape[:1]), batch_size=h.shape[:1]
        )


def _fsdp_gru_steps(rank: int, world: int) -> dict:
    """Multi-step blocks (replay_steps, 3 steps per block, the last block 2) under FSDP1:
    k forwards of the root per block, k nested backwards per block in its backward."""
    T, B, H, k = 8, 3, 12, 3
    torch.manual_seed(3)
    ref = StateGRUPolicy()
    model = _fsdp(copy.deepcopy(ref), {nn.Linear})
    obs = [rank_data(r + 70, T, B, 5) for r in range(world)]

    acc = GradientAccumulator()
    state, loss = TensorDict(h=torch.zeros(B, H), batch_size=[B]), 0.0
    for t0 in range(0, T, k):
        steps = TensorDict(observation=obs[rank][t0 : t0 + k], batch_size=[min(k, T - t0), B])
        heads, state = replay_steps(model, acc, steps, state)
        loss = loss + sum(step_loss(heads["logits"][i], heads["value"][i]) for i in range(heads.batch_size[0]))
    (loss + state["h"].square().sum()).backward()
    grads = _full_grads(model)
    for r in range(world):
        h, ref_loss = torch.zeros(B, H), 0.0
        for t in range(T):
            out = ref(observation=obs[r][t], state=TensorDict(h=h, batch_size=[B]))
            h = out["state", "h"]
            ref_loss = ref_loss + step_loss(out["logits"], out["value"])
        ((ref_loss + h.square().sum()) / world).backward()
    return {
        "grads": grads,
        "expected": {n: p.grad.clone() for n, p in ref.named_parameters()},
        "blocks": acc.blocks_replayed,
    }


class _CountGathers:
    """Counts FSDP1's parameter all-gathers (and the bytes they gather) and its gradient
    reductions (reduce-scatters or, under NO_SHARD, all-reduces; one per unit each) while it is
    entered."""

    def __enter__(self):
        from torch.distributed.fsdp import _runtime_utils
        from torch.distributed.fsdp._flat_param import FlatParamHandle

        self.calls, self.bytes, self.reductions = 0, 0, 0
        self._real = FlatParamHandle._all_gather_flat_param
        self._real_reduce = {n: getattr(_runtime_utils, n) for n in ("_reduce_grad", "_reduce_grad_no_shard")}
        counter = self

        def counting(handle, padded_unsharded_flat_param):
            counter.calls += 1
            counter.bytes += padded_unsharded_flat_param.numel() * padded_unsharded_flat_param.element_size()
            return counter._real(handle, padded_unsharded_flat_param)

        def reducing(real):
            def reduce(state, handle):
                counter.reductions += 1
                return real(state, handle)

            return reduce

        FlatParamHandle._all_gather_flat_param = counting
        for name, real in self._real_reduce.items():
            setattr(_runtime_utils, name, reducing(real))
        return self

    def __exit__(self, *exc):
        from torch.distributed.fsdp import _runtime_utils
        from torch.distributed.fsdp._flat_param import FlatParamHandle

        FlatParamHandle._all_gather_flat_param = self._real
        for name, real in self._real_reduce.items():
            setattr(_runtime_utils, name, real)


def _fsdp_agent_sequence(rank: int, world: int, kind: str = "gru", **fsdp_kwargs) -> dict:
    """The shipped GRU (LSTM, windowed transformer) agent under FSDP1, its core (attention layers) and every Linear units of their
    own: 3-step blocks as one sequence call each (replay_sequence_call) against plain
    autograd over the same calls on an unwrapped copy; the all-gathers of the update counted,
    and those of the same blocks called step by step (replay_steps over one-row calls)."""
    import gymnasium as gym
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from rl_replay.agents.attention import WindowLayer
    from rl_replay.agents.cores import GRUCore, LSTMCore
    from rl_replay.agents.gru import GRUAgent
    from rl_replay.agents.gtrxl import WindowTransformerAgent
    from rl_replay.agents.lstm import LSTMAgent

    T, B, k = 8, 3, 3
    torch.manual_seed(5)
    spaces = (gym.spaces.Box(-1, 1, (5,)), gym.spaces.Discrete(3))
    if kind == "gtrxl":  # each attention layer its own unit; windows of 2 < k: keys cross blocks
        ref = WindowTransformerAgent(*spaces, d_model=12, num_heads=2, window=2, encoder_sizes=(10,))
        Core, key = WindowLayer, "memory"
    else:
        Agent, Core = (GRUAgent, GRUCore) if kind == "gru" else (LSTMAgent, LSTMCore)
        ref, key = Agent(*spaces, hidden_size=12, encoder_sizes=(10,)), "h"
    obs = [rank_data(r + 90, T, B, 5) for r in range(world)]
    first = torch.zeros(T, B, dtype=torch.bool)
    first[4, 1] = True  # a reset inside the second block

    def loss_of(heads, state):
        return heads["dist", "logits"].square().sum() + heads["value"].sum() + state[key].square().sum() * 0.0

    out = {}
    for sequence in (True, False):
        model = _fsdp(copy.deepcopy(ref), {nn.Linear, Core}, **fsdp_kwargs)
        acc = GradientAccumulator()
        with _CountGathers() as gathers:
            state, loss = ref.initial_state(B), 0.0
            for t0 in range(0, T, k):
                t1 = min(T, t0 + k)
                steps = TensorDict(observation=obs[rank][t0:t1], is_first=first[t0:t1], batch_size=[t1 - t0, B])
                if sequence:
                    heads, state = replay_sequence_call(model, acc, steps, state)
                else:
                    heads, state = replay_steps(OneStep(model), acc, steps, state)
                loss = loss + loss_of(heads, state)
            with _CountGathers() as in_backward:
                (loss + state[key].square().sum()).backward()
        out["sequence" if sequence else "stepwise"] = {
            "grads": _full_grads(model),
            "gathers": gathers.calls,
            "gathered_bytes": gathers.bytes,
            "backward_gathers": in_backward.calls,
            "reductions": in_backward.reductions,
            "blocks": acc.blocks_replayed,
        }
    out["units"] = len(FSDP.fsdp_modules(model))
    for r in range(world):
        state, ref_loss = ref.initial_state(B), 0.0
        for t0 in range(0, T, k):
            t1 = min(T, t0 + k)
            o = ref(observation=obs[r][t0:t1], state=state, is_first=first[t0:t1])
            state = o["state"]
            ref_loss = ref_loss + loss_of(o["outputs"], state)
        ((ref_loss + state[key].square().sum()) / world).backward()
    out["expected"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
    return out


def fsdp_parity(rank: int, world: int) -> dict:
    return run_scenarios(
        {
            "mlp": _fsdp_mlp,
            "mlp_root_only": lambda r, w: _fsdp_mlp(r, w, wrap=()),
            "gru": _fsdp_gru,
            "gru_tensordict": _fsdp_gru_tensordict,
            "gru_steps": _fsdp_gru_steps,
            "agent_sequence": _fsdp_agent_sequence,
            "lstm_agent_sequence": lambda r, w: _fsdp_agent_sequence(r, w, "lstm"),
            "gtrxl_agent_sequence": lambda r, w: _fsdp_agent_sequence(r, w, "gtrxl"),
        },
        rank,
        world,
    )


def _strategy(name: str, world: int, mesh: tuple[int, int] | None = None) -> dict:
    """FSDP1 keyword arguments for the sharding strategy ``name``; HYBRID_SHARD gets a 2-D
    (replicate, shard) device mesh of shape ``mesh``, as a launch over nodes builds from
    LOCAL_WORLD_SIZE."""
    from torch.distributed.fsdp import ShardingStrategy

    kwargs: dict = {"sharding_strategy": ShardingStrategy[name]}
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
    return kwargs


class _NoGradient(torch.autograd.Function):
    """The identity whose backward gives its input no gradient: the block behind it is visited
    by the backward with no gradient for any output (NOTE [ Replay blocks ], Rule 9)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def _fsdp_reduce_once_edges(rank: int, world: int, name: str) -> dict:
    """Rule 11's edges, independent MLP blocks (every Linear a unit): (a) the last block visited
    gets no gradient, yet the sum of the others is reduced, equal to plain autograd averaged
    over ranks; (b) a block the backward never reaches is refused in one ReplayError, FSDP's
    synchronisation is restored, and the next rollout is exact again."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(3)
    ref = MLPPolicy()
    model = _fsdp(copy.deepcopy(ref), {nn.Linear}, **_strategy(name, world))
    data = [rank_data(r + 40, 3, 4, 6) for r in range(world)]

    def losses(policy, x, acc=None):
        outs = [
            policy(x[t]) if acc is None else checkpoint_fsdp_forward(policy, acc, observation=x[t]) for t in range(3)
        ]
        return [step_loss(*out) for out in outs], outs

    def reference(pick):
        ref.zero_grad()
        for r in range(world):
            parts, _ = losses(ref, data[r])
            (pick(parts) / world).backward()
        return {n: p.grad.clone() for n, p in ref.named_parameters()}

    out: dict = {}
    # (a) block 0 is visited last (its node is the oldest), with no gradient for its outputs.
    acc = GradientAccumulator()
    parts, outs = losses(model, data[rank], acc)
    with _CountGathers() as counted:
        (_NoGradient.apply(outs[0][0]).sum() + parts[1] + parts[2]).backward()
    out["unused_last"] = {"grads": _full_grads(model), "reductions": counted.reductions}
    out["unused_last_expected"] = reference(lambda p: p[1] + p[2])
    # (b) block 2's outputs are not in the loss at all: the backward never visits it.
    model.zero_grad(set_to_none=True)
    acc = GradientAccumulator()
    parts, _ = losses(model, data[rank], acc)
    try:
        (parts[0] + parts[1]).backward()
        out["missed"] = "no error"
    except ReplayError as e:
        out["missed"] = str(e)
    out["synchronised_after"] = all(m._sync_gradients for m in FSDP.fsdp_modules(model))
    model.zero_grad(set_to_none=True)
    acc = GradientAccumulator()
    parts, _ = losses(model, data[rank], acc)
    sum(parts).backward()
    out["after"] = _full_grads(model)
    out["after_expected"] = reference(sum)
    # the units with parameters of their own: every Linear (the root holds none, so reduces nothing)
    out["units"] = sum(isinstance(m.module, nn.Linear) for m in FSDP.fsdp_modules(model))
    # (c) the last block does not run the value head's unit, which the others ran.
    partial = _fsdp(_PartialMLP(copy.deepcopy(ref)), {nn.Linear}, **_strategy(name, world))
    acc = GradientAccumulator()
    parts = [
        step_loss(*checkpoint_fsdp_forward(partial, acc, observation=data[rank][t], value=t > 0)) for t in range(3)
    ]
    try:
        sum(parts).backward()
        out["skipped_unit"] = "no error"
    except ReplayError as e:
        out["skipped_unit"] = str(e)
    return out


class _PartialMLP(nn.Module):
    """An MLPPolicy whose value head runs only when asked (keyword ``value``)."""

    def __init__(self, mlp) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, observation, value):
        inner = self.mlp
        z = inner.body(observation)
        return inner.pi(z), (inner.v(z).squeeze(-1) if value else z.sum(-1) * 0.0)


def fsdp_strategies(rank: int, world: int) -> dict:
    """The gru and gtrxl parity scenarios under the FSDP1 strategies served besides FULL_SHARD,
    and the edges of reducing once per backward."""
    cases = {"SHARD_GRAD_OP": ("SHARD_GRAD_OP", None), "NO_SHARD": ("NO_SHARD", None)}
    scenarios = {}
    for label, (name, mesh) in cases.items():
        scenarios[f"{label}/gru"] = lambda r, w, n=name, m=mesh: _fsdp_gru(r, w, **_strategy(n, w, m))
        scenarios[f"{label}/gtrxl"] = lambda r, w, n=name, m=mesh: _fsdp_agent_sequence(
            r, w, "gtrxl", **_strategy(n, w, m)
        )
        scenarios[f"{label}/edges"] = lambda r, w, n=name: _fsdp_reduce_once_edges(r, w, n)
    scenarios["FULL_SHARD/gtrxl"] = lambda r, w: _fsdp_agent_sequence(r, w, "gtrxl")
    return run_scenarios(scenarios, rank, world)


def _gathered_forwards(rank: int, world: int, **fsdp_kwargs) -> dict:
    """The windowed transformer agent under FSDP1 run without a graph in 3-step calls, as collection
    runs it: each unit gathered per call, and inside rl_replay.gathered.gathered (once for all calls);
    the outputs of both, those of the unwrapped agent, and the all-gathers of each."""
    import contextlib
    import functools

    import gymnasium as gym

    from rl_replay.agents.attention import WindowLayer
    from rl_replay.agents.gtrxl import WindowTransformerAgent
    from rl_replay.gathered import gathered

    T, B, k = 9, 3, 3
    torch.manual_seed(5)
    spaces = (gym.spaces.Box(-1, 1, (5,)), gym.spaces.Discrete(3))
    ref = WindowTransformerAgent(*spaces, d_model=12, num_heads=2, window=2, encoder_sizes=(10,))
    model = _fsdp(copy.deepcopy(ref), {nn.Linear, WindowLayer}, **fsdp_kwargs)
    obs = rank_data(rank + 90, T, B, 5)
    first = torch.zeros(T, B, dtype=torch.bool)
    first[4, 1] = True
    out = {"units": sum(unit._handle is not None for unit in model.fsdp_modules(model))}
    runs = {"plain": (ref, contextlib.nullcontext), "per_step": (model, contextlib.nullcontext)}
    runs["gathered"] = (model, functools.partial(gathered, model))
    with torch.no_grad():
        for name, (module, context) in runs.items():
            with _CountGathers() as gathers, context():
                state, values = ref.initial_state(B), []
                for t0 in range(0, T, k):
                    o = module(observation=obs[t0 : t0 + k], state=state, is_first=first[t0 : t0 + k])
                    state = o["state"]
                    values.append(o["outputs"]["value"])
            out[name] = {"values": torch.cat(values), "gathers": gathers.calls}
    return out


def fsdp_hybrid4(rank: int, world: int) -> dict:
    """HYBRID_SHARD over "2 nodes x 2 ranks": sharded within a node, replicated across nodes."""
    mesh = (world // 2, 2)
    return run_scenarios(
        {
            "gru": lambda r, w: _fsdp_gru(r, w, **_strategy("HYBRID_SHARD", w, mesh)),
            "gtrxl": lambda r, w: _fsdp_agent_sequence(r, w, "gtrxl", **_strategy("HYBRID_SHARD", w, mesh)),
            "gathered": lambda r, w: _gathered_forwards(r, w, **_strategy("HYBRID_SHARD", w, mesh)),
        },
        rank,
        world,
    )


# ---------------------------------------------------------------- FSDP setup errors
def _expect(exc_type, pattern, fn):
    import pytest

    with pytest.raises(exc_type, match=pattern):
        fn()


def _err_orig_params(rank: int, world: int) -> str:
    model = _fsdp(MLPPolicy(), {nn.Linear}, use_orig_params=False)
    acc = GradientAccumulator()
    _expect(
        ReplayError,
        r"use_orig_params=False",
        lambda: checkpoint_fsdp_forward(model, acc, observation=torch.randn(2, 6)),
    )
    assert acc.num_blocks == 0
    return OK


def _err_strategy(rank: int, world: int) -> str:
    model = _fsdp(MLPPolicy(), {nn.Linear}, **_strategy("_HYBRID_SHARD_ZERO2", world, (1, world)))
    acc = GradientAccumulator()
    _expect(
        ReplayError,
        r"sharding strategy _HYBRID_SHARD_ZERO2; replay serves FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD",
        lambda: checkpoint_fsdp_forward(model, acc, observation=torch.randn(2, 6)),
    )
    assert acc.num_blocks == 0
    return OK


def _err_no_sync(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = _fsdp(MLPPolicy(), {nn.Linear})
    x = torch.randn(2, 6)
    # Forward under no_sync: rejected before anything is recorded.
    acc = GradientAccumulator()
    with model.no_sync():
        _expect(ReplayError, r"no_sync", lambda: checkpoint_fsdp_forward(model, acc, observation=x))
    assert acc.num_blocks == 0
    # Forward outside, backward under no_sync: rejected, no gradient written.
    loss = step_loss(*checkpoint_fsdp_forward(model, acc, observation=x))
    assert acc.num_blocks == 1
    with model.no_sync():
        _expect(ReplayError, r"no_sync", loss.backward)
    assert all(p.grad is None for p in model.parameters())
    assert acc.blocks_replayed == 0
    return OK


def fsdp_errors(rank: int, world: int) -> dict:
    return run_scenarios(
        {
            "use_orig_params_false": _err_orig_params,
            "shard_grad_op": _err_strategy,
            "no_sync": _err_no_sync,
        },
        rank,
        world,
    )


# ------------------------------------------------------------ CUDA (world size 1)
def cuda_fsdp_offload() -> dict:
    """FSDP1 + CPUOffload(offload_params=True) on one GPU, in a one-rank process group.

    With one rank FSDP1 turns FULL_SHARD into NO_SHARD; with CPU offload each backward
    overwrites the (host) gradient instead of adding to it, so this exercises the
    accumulator's absorb path. Dropout in the policy checks the CUDA RNG replay.
    Two rollouts without zero_grad: the second must add to the first one's gradient.
    Returns the gradients (on the host) and the plain single-process references.
    """
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    device = torch.device("cuda", torch.cuda.current_device())
    T, B, H = 16, 4, 12
    torch.manual_seed(2)
    ref = GRUPolicy(dropout=0.3).to(device)
    model = FSDP(
        copy.deepcopy(ref).cpu(),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear, nn.GRUCell}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        cpu_offload=CPUOffload(offload_params=True),
        device_id=device,
    )
    out: dict = {"strategy": model.sharding_strategy.name}
    for k in range(2):
        obs = rank_data(k, T, B, 5).to(device)
        h0 = rank_data(100 + k, B, H).to(device)
        h_rep, h_ref = h0.clone().requires_grad_(), h0.clone().requires_grad_()
        acc = GradientAccumulator()
        torch.manual_seed(10 + k)
        gru_loss(model, obs, h_rep, acc).backward()
        out[f"rng{k}"] = torch.rand(4, device=device).cpu()
        assert acc.blocks_replayed == T
        torch.manual_seed(10 + k)
        gru_loss(ref, obs, h_ref).backward()
        out[f"rng_ref{k}"] = torch.rand(4, device=device).cpu()
        # NO_SHARD: each original parameter's .grad is the full gradient (on the host
        # under CPU offload), so no summon_full_params is needed.
        out[f"grads{k}"] = {clean(n): p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        out[f"expected{k}"] = {n: p.grad.detach().cpu().clone() for n, p in ref.named_parameters()}
        out[f"h0_{k}"], out[f"h0_ref{k}"] = h_rep.grad.cpu(), h_ref.grad.cpu()
    return out


# ----------------------------------------------------------------- one spawn for all
def _stored_steps(rank: int, T: int, B: int, resets: tuple[tuple[int, int], ...]) -> TensorDict:
    """A rank's stored rollout of T steps of B envs (5-dim observations, 3 actions), episodes
    starting at the ``(t, env)`` of ``resets``."""
    g = torch.Generator().manual_seed(90 + rank)
    first = torch.zeros(T, B, dtype=torch.bool)
    for t, env in resets:
        first[t, env] = True
    return TensorDict(
        observation=torch.randn(T, B, 5, generator=g),
        is_first=first,
        action=torch.randint(0, 3, (T, B), generator=g),
        batch_size=[T, B],
    )


def loss_of(out: TensorDict) -> torch.Tensor:
    return out["log_prob"].sum() + out["value"].square().sum()


def _fsdp2_agent(rank: int, world: int, reshard: bool, block_steps: int, kind: str = "gru") -> dict:
    """A shipped recurrent agent (``kind``: gru, lstm, lru, or gtrxl with a window of 2 < the block)
    wrapped by the user with FSDP2 ``fully_shard`` (encoder, core, head and value each a unit, then the
    root), replayed through ``algorithms.stored.replay_sequence`` with
    ``block_steps``-step blocks (one-row calls, or one call per block with continuing sums) and a reset
    inside the second block, against plain autograd over the same calls averaged over the ranks."""
    import gymnasium as gym
    from _reference import plain_blocks, plain_sequence
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rl_replay.agent import Policy
    from rl_replay.agents.gru import GRUAgent
    from rl_replay.agents.gtrxl import WindowTransformerAgent
    from rl_replay.agents.lru import LRUAgent
    from rl_replay.agents.lstm import LSTMAgent
    from rl_replay.algorithms.stored import replay_sequence

    T, B = 8, 3
    torch.manual_seed(5)
    spaces = (gym.spaces.Box(-1, 1, (5,)), gym.spaces.Discrete(3))
    if kind == "gtrxl":
        ref = WindowTransformerAgent(*spaces, d_model=12, num_heads=2, window=2, encoder_sizes=(10,))
    else:
        cls = {"gru": GRUAgent, "lstm": LSTMAgent, "lru": LRUAgent}[kind]
        ref = cls(*spaces, hidden_size=12, encoder_sizes=(10,))
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    for unit in (model.encoder, model.core, model.head, model.value):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    def data(r: int) -> TensorDict:
        return _stored_steps(r, T, B, resets=((4, 1),))

    acc = GradientAccumulator()
    loss_of(replay_sequence(Policy(model, model), data(rank), ref.initial_state(B), acc, None, block_steps)).backward()
    for r in range(world):
        if block_steps > 1:
            out = plain_blocks(ref, data(r), ref.initial_state(B), block_steps)
        else:
            out = plain_sequence(ref, data(r), ref.initial_state(B))[0]
        (loss_of(out) / world).backward()
    return {
        "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
        "expected": {n: p.grad.clone() for n, p in ref.named_parameters()},
        "blocks": acc.blocks_replayed,
    }


def _fsdp2_helper(rank: int, world: int) -> dict:
    """The reference helper's entry point, ``checkpoint_fsdp_forward``, on an MLP policy the user
    wrapped with ``fully_shard`` (each Linear a unit, then the root): 10 blocks of one rollout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = MLPPolicy()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    for sub in model.modules():
        if isinstance(sub, nn.Linear):
            fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    obs = [rank_data(r + 40, 10, 4, 6) for r in range(world)]
    acc = GradientAccumulator()
    loss = sum(step_loss(*checkpoint_fsdp_forward(model, acc, observation=obs[rank][t])) for t in range(10))
    loss.backward()
    for r in range(world):
        (sum(step_loss(*ref(observation=obs[r][t])) for t in range(10)) / world).backward()
    return {
        "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
        "expected": {n: p.grad.clone() for n, p in ref.named_parameters()},
        "blocks": acc.blocks_replayed,
    }


class CountFSDP2:
    """Counts FSDP2's parameter all-gathers and gradient reductions (one call each per unit group)
    while it is entered."""

    def __enter__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        self.gathers, self.reductions = 0, 0
        self._group, self._real = group, (group.foreach_all_gather, group.foreach_reduce)
        counter = self

        def gather(*args, **kwargs):
            counter.gathers += 1
            return counter._real[0](*args, **kwargs)

        def reduce(*args, **kwargs):
            counter.reductions += 1
            return counter._real[1](*args, **kwargs)

        group.foreach_all_gather, group.foreach_reduce = gather, reduce
        return self

    def __exit__(self, *exc):
        self._group.foreach_all_gather, self._group.foreach_reduce = self._real


#: kind -> (agent class path, kwargs, the modules that become units)
FSDP_VERSION_AGENTS = {
    "mlp": ("rl_replay.agents.mlp:MLPAgent", {"hidden_sizes": (12, 12)}, ["Linear"]),
    "gru": ("rl_replay.agents.gru:GRUAgent", {"hidden_size": 12, "encoder_sizes": (10,)}, ["Linear", "GRUCore"]),
    "lstm": ("rl_replay.agents.lstm:LSTMAgent", {"hidden_size": 12, "encoder_sizes": (10,)}, ["Linear", "LSTMCore"]),
    "lru": ("rl_replay.agents.lru:LRUAgent", {"hidden_size": 12, "encoder_sizes": (10,)}, ["Linear", "LRUCore"]),
    "gtrxl": (
        "rl_replay.agents.gtrxl:WindowTransformerAgent",
        {"d_model": 12, "num_layers": 2, "num_heads": 2, "window": 2, "encoder_sizes": (10,)},
        ["WindowLayer"],
    ),
}


def _fsdp_versions(
    rank: int, world: int, kind: str, strategy: str, block_steps: int = 3, min_num_params: int | None = None
) -> dict:
    """The trainer's wrapping (:func:`rl_replay.distributed.wrap_fsdp` and ``wrap_fsdp2``, the same
    units and strategy) of a shipped agent, replayed through ``algorithms.stored.replay_sequence`` in
    ``block_steps``-step blocks with resets inside two blocks: FSDP2's gradients against FSDP1's and
    against plain autograd's averaged over the ranks, with FSDP2's all-gathers and reductions."""
    import importlib

    import gymnasium as gym
    from _reference import plain_blocks
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from rl_replay.agent import Policy
    from rl_replay.algorithms.stored import replay_sequence
    from rl_replay.distributed import wrap_fsdp, wrap_fsdp2

    target, kwargs, units = FSDP_VERSION_AGENTS[kind]
    if min_num_params:  # the size rule instead of class names
        units = []
    module, name = target.split(":")
    T, B = 9, 3
    torch.manual_seed(5)
    spaces = (gym.spaces.Box(-1, 1, (5,)), gym.spaces.Discrete(3))
    ref = getattr(importlib.import_module(module), name)(*spaces, **kwargs)

    def data(r: int) -> TensorDict:
        return _stored_steps(r, T, B, resets=((4, 1), (7, 2)))  # inside the second and the third block

    grads, counts = {}, None
    for version, wrap in ((1, wrap_fsdp), (2, wrap_fsdp2)):
        model = wrap(
            copy.deepcopy(ref),
            torch.device("cpu"),
            wrap_modules=units,
            min_num_params=min_num_params,
            sharding_strategy=strategy,
        )
        acc = GradientAccumulator()
        with CountFSDP2() as counted:
            out = replay_sequence(Policy.of(model), data(rank), ref.initial_state(B), acc, None, block_steps)
            loss_of(out).backward()
        if version == 1:
            with FSDP.summon_full_params(model, with_grads=True):
                grads[1] = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
            unit_names = {
                1: sorted(
                    n.replace("_fsdp_wrapped_module.", "").rstrip(".")
                    for n, m in model.named_modules()
                    if isinstance(m, FSDP) and m is not model
                )
            }
        else:
            grads[2] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            counts = {"gathers": counted.gathers, "reductions": counted.reductions, "blocks": acc.blocks_replayed}
            from torch.distributed.fsdp import FSDPModule

            units2 = [m for m in model.modules() if isinstance(m, FSDPModule)]
            counts["units"] = len(units2)
            unit_names[2] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model)
            counts["unit_names"] = unit_names

            def own(unit, units=units2) -> set[int]:  # its parameters that no unit inside it holds
                inner = {id(p) for sub in unit.modules() if sub is not unit and sub in units for p in sub.parameters()}
                return {id(p) for p in unit.parameters()} - inner

            # the units with parameters of their own (a root whose parameters are all in units has none)
            counts["holders"] = sum(bool(own(u)) for u in units2)
    for r in range(world):
        (loss_of(plain_blocks(ref, data(r), ref.initial_state(B), block_steps)) / world).backward()
    return {
        "grads": grads[2],
        "fsdp1": grads[1],
        "expected": {n: p.grad.clone() for n, p in ref.named_parameters()},
        **counts,
    }


def _fsdp2_collection(rank: int, world: int) -> dict:
    """Collection under the trainer's FSDP2 (``wrap_fsdp2``, FULL_SHARD, each attention layer a unit) with
    the parameters gathered once per rollout (``gather_once``) against gathered at every step, from the
    same seeds: PPO's stored rollout, and A2C's replayed one with its gradients; the all-gathers of each."""
    import gymnasium as gym

    from rl_replay.agent import build_agent
    from rl_replay.algorithms.a2c import A2C
    from rl_replay.algorithms.losses import total_loss
    from rl_replay.config import Config
    from rl_replay.distributed import wrap_fsdp2
    from rl_replay.engine import replay
    from rl_replay.rollout.collector import Collector

    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    torch.manual_seed(0)
    kwargs = {"d_model": 16, "num_layers": 2, "num_heads": 2, "window": 4, "encoder_sizes": [16]}
    agent = build_agent("gtrxl", kwargs, envs.single_observation_space, envs.single_action_space)
    model = wrap_fsdp2(agent, torch.device("cpu"), wrap_modules=["WindowLayer"])
    out: dict = {"steps": 24}
    for gather_once in (False, True):
        collector = Collector(envs, model, num_steps=24, seed=7 + 1000 * rank, gather_once=gather_once)
        torch.manual_seed(3 + rank)
        with CountFSDP2() as counted:
            rollout = collector.collect()
        out[f"stored_{gather_once}"] = (rollout.data, counted.gathers)
        collector = Collector(envs, model, num_steps=24, seed=11 + 1000 * rank, gather_once=gather_once)
        torch.manual_seed(5 + rank)
        acc = GradientAccumulator()
        model.zero_grad(set_to_none=True)
        with CountFSDP2() as counted:
            replayed = collector.collect(lambda inputs, c=collector, a=acc: replay(c.policy.module, a, inputs))
        gathers = counted.gathers
        total_loss(A2C.loss(replayed.data, Config())).backward()
        out[f"replayed_{gather_once}"] = (
            {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            gathers,
            int(replayed.data["is_first"][1:].sum()),
        )
    envs.close()
    from torch.distributed.fsdp import FSDPModule

    out["units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
    return out


def fsdp2_parity(rank: int, world: int) -> dict:
    return run_scenarios(
        {
            **{
                f"{kind}_{strategy}": functools.partial(_fsdp_versions, kind=kind, strategy=strategy)
                for kind in FSDP_VERSION_AGENTS
                for strategy in ("FULL_SHARD", "SHARD_GRAD_OP")
            },
            "gru_NO_SHARD": functools.partial(_fsdp_versions, kind="gru", strategy="NO_SHARD"),
            "collection": _fsdp2_collection,
            "gru_size_rule": functools.partial(_fsdp_versions, kind="gru", strategy="FULL_SHARD", min_num_params=50),
            "gru_reshard_steps1": lambda r, w: _fsdp2_agent(r, w, True, 1),
            "gru_reshard_steps3": lambda r, w: _fsdp2_agent(r, w, True, 3),
            "gru_keep_steps3": lambda r, w: _fsdp2_agent(r, w, False, 3),
            "lstm_reshard_steps3": lambda r, w: _fsdp2_agent(r, w, True, 3, "lstm"),
            "lru_keep_steps3": lambda r, w: _fsdp2_agent(r, w, False, 3, "lru"),
            "gtrxl_reshard_steps3": lambda r, w: _fsdp2_agent(r, w, True, 3, "gtrxl"),
            "helper_mlp": _fsdp2_helper,
        },
        rank,
        world,
    )


def fsdp_all(rank: int, world: int) -> dict:
    """Every world-size-2 scenario, so the test session pays for one spawn only."""
    return {
        "parity": fsdp_parity(rank, world),
        "strategies": fsdp_strategies(rank, world),
        "errors": fsdp_errors(rank, world),
        "fsdp2": fsdp2_parity(rank, world),
    }
