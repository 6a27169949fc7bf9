"""NOTE [ Private APIs ]: what rl_replay uses of torch, tensordict and gymnasium that they do not promise.

Each use is one :class:`PrivateUse`: the name as it appears in the code (an attribute ``._name``, or a
module path), the file, its owner and version tested (torch 2.13.0, tensordict 0.15.3, gymnasium
1.4.0), why it is used, and whether only the FSDP1 path needs it (what FSDP2 work can leave behind).
``tests/project/test_private_apis.py`` finds every private use in ``rl_replay/``, ``agents/`` and
``envs/`` by reading their syntax trees (attributes and imports named ``_x`` that the project does not
define itself, and ``getattr``-style access by such a name) and checks it against this list, both ways:
a new use must be listed here, and a listed use must still be in its file. Markers rl_replay puts on
objects it does not own are named ``_rl_replay_*`` and are not private uses. (A private name of a
dependency that rl_replay also defines for itself, on ``self``, would hide from the scan; so the
project does not reuse such names.)
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PrivateUse", "PRIVATE_APIS", "fsdp1_only"]


class PrivateUse(NamedTuple):
    """One private name of a dependency, used in one file."""

    name: str  # ``._attr`` or a module path (``torch.utils._pytree``), as the code writes it
    path: str  # the file, relative to the repository
    owner: str  # whose it is
    why: str
    fsdp1: bool = False  # only the FSDP1 path uses it


_REPLAY = "rl_replay/engine/replay.py"
_FSDP = "rl_replay/engine/fsdp.py"
_GATHERED = "rl_replay/gathered.py"

PRIVATE_APIS: tuple[PrivateUse, ...] = (
    PrivateUse(
        "torch.autograd.graph._engine_run_backward",
        _REPLAY,
        "torch",
        "the replay block's nested backward, run as torch.utils.checkpoint runs it",
    ),
    PrivateUse(
        "._is_checkpoint_valid",
        _REPLAY,
        "torch.autograd",
        "refuses autograd.grad / backward(inputs=...) through a block, as torch.utils.checkpoint does",
    ),
    PrivateUse(
        "._backward_cls",
        _REPLAY,
        "torch.autograd.Function",
        "the ctx class autograd makes per apply: ReplayCtx keeps a block's state in slots, not a __dict__",
    ),
    PrivateUse(
        "._execution_engine",
        "rl_replay/engine/accumulator.py",
        "torch.autograd.Variable",
        "queue_callback: the accumulator finalises once the user's whole backward is done",
    ),
    PrivateUse(
        "._base",
        "rl_replay/engine/accumulator.py",
        "torch.Tensor",
        "whether a gradient is a view into FSDP's flat gradient (copied, as FSDP reuses that storage)",
    ),
    PrivateUse(
        "._base",
        "rl_replay/engine/saving.py",
        "torch.Tensor",
        "whether a block input is a view, so its saved copy keeps only the viewed part",
    ),
    PrivateUse(
        "._version",
        "rl_replay/engine/saving.py",
        "torch.Tensor",
        "the version counter that tells a saved input was changed in place before the backward",
    ),
    PrivateUse(
        "._version",
        "rl_replay/engine/plan.py",
        "torch.Tensor",
        "the version counters that tell a block changed its module's parameters or buffers",
    ),
    PrivateUse(
        "torch.utils._pytree",
        "rl_replay/engine/layouts.py",
        "torch",
        "flattening keyword inputs and outputs as torch.utils.checkpoint does",
    ),
    PrivateUse(
        "torch.utils._pytree",
        "rl_replay/engine/fsdp_forward.py",
        "torch",
        "finding tensors inside the reference helper's keyword metadata",
    ),
    PrivateUse(
        "torch.nn.modules.batchnorm._BatchNorm",
        "rl_replay/engine/plan.py",
        "torch",
        "the base class that names every BatchNorm's running statistics in an error",
    ),
    PrivateUse(
        "._sync_gradients",
        "rl_replay/engine/plan.py",
        "FSDP1 FullyShardedDataParallel",
        "refuses a backward under the user's no_sync() (blocks must reduce, or the engine's own no_sync decides)",
        fsdp1=True,
    ),
    PrivateUse(
        "torch.distributed.fsdp._runtime_utils",
        _FSDP,
        "torch (FSDP1)",
        "the module of FSDP1's pre-backward hook, given to tensors inside TensorDict outputs",
        fsdp1=True,
    ),
    PrivateUse(
        "._pre_backward_hook",
        _FSDP,
        "torch (FSDP1 _runtime_utils)",
        "FSDP1's pre-backward unshard for outputs inside a TensorDict, which its own output hooks do not see",
        fsdp1=True,
    ),
    PrivateUse("._handle", _FSDP, "FSDP1 FullyShardedDataParallel", "the unit's flat-parameter handle", fsdp1=True),
    PrivateUse(
        "._handle",
        _GATHERED,
        "FSDP1 FullyShardedDataParallel",
        "the unit's flat parameter, whose size decides whether collection may gather it",
        fsdp1=True,
    ),
    PrivateUse(
        "._needs_pre_backward_unshard",
        _FSDP,
        "FSDP1 FlatParamHandle",
        "marks the handle for unsharding in the pre-backward hook given to TensorDict outputs",
        fsdp1=True,
    ),
    PrivateUse(
        "._use_orig_params",
        _FSDP,
        "FSDP1 FullyShardedDataParallel",
        "refuses use_orig_params=False in one line",
        fsdp1=True,
    ),
    PrivateUse(
        "._fsdp_wrapped_module",
        _GATHERED,
        "FSDP1 FullyShardedDataParallel",
        "the module a unit wraps, which collection on gathered parameters calls directly",
        fsdp1=True,
    ),
    PrivateUse(
        "._numels",
        _GATHERED,
        "FSDP1 FlatParameter",
        "the whole size of a unit's parameters, which decides whether collection may gather them",
        fsdp1=True,
    ),
    PrivateUse(
        "._tensordict",
        "rl_replay/engine/steps.py",
        "tensordict.TensorDict",
        "the dict of a TensorDict's entries, read without the per-key checks of items() on the hot path",
    ),
    PrivateUse("._tensordict", "rl_replay/engine/layouts.py", "tensordict.TensorDict", "as in steps.py"),
    PrivateUse(
        "._new_unsafe",
        "rl_replay/engine/steps.py",
        "tensordict.TensorDict",
        "builds a block's outputs without re-checking entries the engine just made",
    ),
    PrivateUse("._new_unsafe", "rl_replay/engine/layouts.py", "tensordict.TensorDict", "as in steps.py"),
    PrivateUse(
        "._has_names",
        "rl_replay/engine/layouts.py",
        "tensordict.TensorDict",
        "a TensorDict with named dimensions takes the checked path",
    ),
    PrivateUse(
        "._autoreset_envs",
        "rl_replay/rollout/collector.py",
        "gymnasium.vector.SyncVectorEnv",
        "the autoreset flags, saved with the sub-envs so a resume continues exactly",
    ),
    PrivateUse(
        "._saved_kwargs",
        "rl_replay/rollout/env_state.py",
        "gymnasium.utils.RecordConstructorArgs",
        "a wrapper's constructor arguments, to rebuild it around its unpickled env",
    ),
    PrivateUse(
        "._VF",
        "agents/cores.py",
        "torch",
        "torch._VF.gru / .lstm: nn.GRU's and nn.LSTM's fused multi-step kernels, run on a GRUCell's / "
        "LSTMCell's own parameters so the cores' weights and checkpoints stay as they are",
    ),
)


def fsdp1_only() -> list[PrivateUse]:
    """The uses only the FSDP1 path needs."""
    return [use for use in PRIVATE_APIS if use.fsdp1]
