"""Replay blocks: run a policy forward without a graph, recompute it in backward.

:func:`replay` (TensorDict inputs) and :func:`checkpoint_fsdp_forward` (keyword inputs)
run one block; :class:`StateWatch` is the check that a block left its module's
parameters and buffers alone, public so that other code can run the same check.
See NOTE [ Replay blocks ] below for the rules every block follows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch.autograd.graph import _engine_run_backward

from rl_replay.engine.accumulator import GradientAccumulator
from rl_replay.engine.errors import _PREFIX, DEBUG_TIP, ReplayError
from rl_replay.engine.layouts import Recompute, flatten_inputs, flatten_outputs, unflatten_outputs
from rl_replay.engine.plan import ModelPlan, StateWatch, plan_for
from rl_replay.engine.saving import (
    check_inputs_unchanged,
    place_outputs,
    restore_inputs,
    save_inputs,
    unslice,
)

__all__ = [
    "replay",
    "apply_block",
    "ReplayCtx",
    "Site",
    "backward_from",
    "recompute_and_backward",
    "ContextFn",
    "StateWatch",
]

# NOTE [ Replay blocks ]
#
# A rollout of T timesteps calls the policy T times. Plain autograd keeps every
# activation of every call until ``loss.backward()``, so memory grows with T times the
# policy's activation size. A replay block keeps only what it was called with.
#
# Rule 1. A block is one call of the model. Its tensor inputs (the kwargs, or the
#         leaves of the input TensorDict) are the only tensors it saves, on the host,
#         in the rollout's slabs (rl_replay/engine/storage.py says how). Its outputs
#         are attached to autograd through one ``ReplayFunction`` node.
# Rule 2. Per-block bookkeeping grows with T too, so a block keeps little besides its
#         saved tensors: its own state in the node's slots (``ReplayCtx``), what its
#         neighbours share (model, plan, argument layout, accumulator) in one ``Site``.
# Rule 3. Nothing crosses a block boundary except through inputs and outputs. The
#         recompute detaches the saved inputs into fresh leaves, so the nested backward
#         stops at the block's edge; the input gradients go back to the outer backward,
#         which carries them into the previous block (how recurrent state gets gradient
#         through the whole episode). A tensor that reaches the model any other way (a
#         closure, a global) is not replayed correctly: pass it as an input.
# Rule 4. The recompute sees the same world as the forward: CPU (and CUDA) RNG state
#         and autocast state are captured at the forward and restored inside
#         ``fork_rng``, so the caller's RNG stream is not disturbed. A forward that drew
#         no random numbers keeps no snapshot and recomputes without ``fork_rng``.
#         ``context_fn`` lets the user snapshot any other mutable state.
# Rule 5. Saved inputs kept as they are (not copied) must not change before the
#         recompute: their versions are recorded and checked.
# Rule 6. The model must not change its parameters or buffers: the forward and the
#         recompute would each apply the change. Versions are compared around the
#         forward, between forward and recompute, and around the recompute; a change
#         raises ReplayError naming the tensor.
# Rule 7. Recomputed activations live only during that block's nested backward: peak
#         memory is one block's activations plus the saved inputs of all blocks.
# Rule 8. Parameter gradients go through the GradientAccumulator shared by all blocks
#         of the rollout (accumulator.py: how FSDP's overwriting of ``.grad`` is
#         handled). The nested backward is a real ``torch.autograd.backward``, so FSDP1's
#         pre/post-backward hooks run for every block, as in FSDP's own reentrant
#         activation checkpointing. A module wrapped with FSDP2's ``fully_shard`` is served by
#         its public hooks alone: the block's forward and its recompute gather each unit, each
#         nested backward reduce-scatters into the sharded ``.grad``, which sums the blocks.
# Rule 9. A block whose outputs receive no gradient is not recomputed at all.
# Rule 10. Only a full ``backward()`` may run through a block: ``torch.autograd.grad``
#         and ``backward(inputs=...)`` must leave parameter ``.grad`` alone, but the
#         nested backward accumulates into it, so they raise ReplayError (as reentrant
#         ``torch.utils.checkpoint`` does).
# Rule 11. Under FSDP1 ``SHARD_GRAD_OP`` and ``NO_SHARD`` (every unit), a backward reduces
#         the gradient once: the blocks' nested backwards run under the roots' ``no_sync()``,
#         summing unreduced gradients (and, under ``SHARD_GRAD_OP``, keeping the units
#         gathered), and the last block to be visited reduces the sum (plan.reduces_once
#         says why not under ``FULL_SHARD``). An FSDP2 root that
#         ``rl_replay.distributed.wrap_fsdp2`` wrapped with its units kept gathered does the
#         same through ``set_requires_gradient_sync`` and ``set_reshard_after_backward``
#         (fsdp.FSDP2Deferral). The blocks are counted, so every recorded block must be
#         reached by the backward; one that is not raises ReplayError.

ContextFn = Callable[[], "tuple[Any, Any]"]

# One anchor leaf per device: it gives every block an input that requires grad,
# so outputs are attached to autograd even when no block input requires grad.
# Its gradient is always None, so sharing it is safe.
_ANCHORS: dict[torch.device, torch.Tensor] = {}

_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
_CPU = torch.device("cpu")

# Per-block state kept until backward is shared where it is the same for every block.
_NO_CONTEXT = nullcontext()  # reusable and reentrant
_AUTOCAST_STATES: dict[tuple, tuple] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    anchor = _ANCHORS.get(device)
    if anchor is None:
        anchor = _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return anchor


class Site:
    """What consecutive blocks of one rollout share: the model and its plan, the
    accumulator, the argument layout, ``context_fn`` and the device.

    One object for all of them, not one per block: every object a block keeps lives
    until the backward, so per-block bookkeeping is memory that grows with T. The
    plan keeps the last site, weakly (the blocks' nodes hold it; a strong reference
    would make a cycle through the accumulator, freed only by the cycle collector),
    and a block reuses it when nothing differs.
    """

    __slots__ = (
        "model",
        "plan",
        "accumulator",
        "layout",
        "context_fn",
        "device",
        "out_spec",
        "last",
        "interned",
        "__weakref__",
    )

    def __init__(self, model, plan, accumulator, layout, context_fn, device) -> None:
        self.model = model
        self.plan = plan
        self.accumulator = accumulator
        self.layout = layout
        self.context_fn = context_fn
        self.device = device
        self.out_spec = None  # the last block's, read by apply_block right after the forward
        self.last: tuple = ()  # the last block's input versions, shared when equal
        self.interned: dict = {}

    def call(self, tensors: Sequence[torch.Tensor]):
        return self.layout.call(self.model, tensors)

    def matches(self, model, accumulator, layout, context_fn, device) -> bool:
        return (
            self.model is model
            and self.accumulator is accumulator
            and self.context_fn is context_fn
            and self.device == device
            and self.layout == layout
        )

    def intern_last(self, versions: tuple) -> tuple:
        """``versions``, or the equal tuple the previous block keeps."""
        if versions == self.last:
            return self.last
        self.last = versions
        return versions

    def intern(self, value: tuple) -> tuple:
        """One shared object per distinct (hashable) ``value`` among this site's blocks."""
        shared = self.interned.get(value)
        if shared is None:
            if len(self.interned) >= 256:  # shapes that change every block: do not grow
                self.interned.clear()
            shared = self.interned[value] = value
        return shared


class RestoredState:
    """Enters exactly what differs from now: forked RNG (only if the forward drew random
    numbers) and autocast (only if it was on at the forward or is on now)."""

    __slots__ = ("block", "stack")

    def __init__(self, block: ReplayCtx) -> None:
        self.block = block
        self.stack = None

    def __enter__(self):
        block = self.block
        rng = block.uses_rng
        autocast = [a for a in block.autocast if a[1] or torch.is_autocast_enabled(a[0])]
        if not rng and not autocast:
            return self
        stack = self.stack = ExitStack()
        if rng:
            devices = [block.cuda_device.index or 0] if block.cuda_rng is not None else []
            stack.enter_context(torch.random.fork_rng(devices=devices))
            if block.cpu_rng is not None:
                torch.set_rng_state(block.cpu_rng)
            if block.cuda_rng is not None:
                torch.cuda.set_rng_state(block.cuda_rng, block.cuda_device)
        for device_type, enabled, dtype in autocast:
            stack.enter_context(torch.autocast(device_type, enabled=enabled, dtype=dtype))
        return self

    def __exit__(self, *exc):
        return None if self.stack is None else self.stack.__exit__(*exc)


def _same(t):
    return t


class ReplayFunction(torch.autograd.Function):
    """The autograd node of one block. See NOTE [ Replay blocks ].

    Its ``ctx`` is a :class:`ReplayCtx`: the block's own state lives in the node's
    slots, everything its blocks share in one :class:`Site`.
    """

    @staticmethod
    def forward(ctx, site: Site, anchor: torch.Tensor | None, *tensors: torch.Tensor):
        ctx.site = site
        ctx.index = site.accumulator.num_blocks
        ctx.set_materialize_grads(False)
        # Rule 1: copied into the rollout's slabs before the model runs (so an in-place
        # change by the forward cannot reach the copy), or kept as they are. Saved
        # through identity saved-tensor hooks (see apply_block), which skip autograd's
        # in-place check: a kept tensor's version is remembered and checked before the
        # recompute instead.
        saved, ctx.input_devices, versions, ctx.input_slices = save_inputs(tensors, site.accumulator.slabs, site.intern)
        ctx.input_versions = site.intern_last(versions)
        ctx.save_for_backward(*saved)
        ctx.capture_state()
        if site.context_fn is None:
            forward_context = ctx.recompute_context = _NO_CONTEXT
        else:
            forward_context, ctx.recompute_context = site.context_fn()
        plan = site.plan
        before = plan.versions()
        with forward_context:
            outputs = site.call(tensors)
        ctx.versions = plan.check_versions(before, "the forward", ctx.index)
        ctx.forget_unused_rng()
        flat, site.out_spec = flatten_outputs(outputs, site.model)
        ctx.num_outputs = len(flat)
        if site.device.type == "cpu":
            flat = place_outputs(flat, tensors, site.accumulator.slabs)
        return flat

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        if torch.is_grad_enabled():
            raise ReplayError(
                _PREFIX + "higher-order gradients (backward with create_graph=True) through a "
                "replay block are not supported: the block's parameter gradients are "
                "accumulated, not differentiable. Use plain autograd for this computation."
            )
        if not torch.autograd._is_checkpoint_valid():
            raise ReplayError(
                _PREFIX + "torch.autograd.grad() and backward(inputs=...) through a replay block "
                "are not supported: the block's nested backward accumulates into every "
                "parameter's .grad, which those calls must leave untouched. Call "
                "loss.backward() without inputs, or use plain autograd for this computation."
            )
        site = ctx.site
        plan = site.plan
        plan.check_fsdp_sync()
        accumulator = site.accumulator
        accumulator._enter_backward()
        first = plan.enter_block_backward()
        requires_grad = ctx.needs_input_grad[2:]  # the block's tensors (after site, anchor)
        if all(g is None for g in grads) and not plan.reduce_now:
            # Rule 9: no output of this block reaches the loss (and nothing is unpacked).
            return (None, None) + (None,) * len(requires_grad)
        saved = ctx.saved_tensors
        check_inputs_unchanged(saved, ctx.input_versions, ctx.input_slices, ctx.index)
        saved = restore_inputs(unslice(saved, ctx.input_slices), ctx.input_devices)
        plan.check_versions(ctx.versions, "something between the forward and the backward", ctx.index)
        start = accumulator._begin_block(plan.params, plan.absorb and (first or not plan.reduce_once))
        try:
            how = site.layout.recompute  # each layout names its recompute (layouts.Recompute)
            if how is Recompute.STEPS:
                input_grads = site.layout.recompute_and_backward(ctx, saved, requires_grad, grads)
            else:
                continuing = how is Recompute.ONE_CALL_CONTINUING_SUMS
                input_grads = recompute_and_backward(ctx, saved, requires_grad, grads, continue_sums=continuing)
        except BaseException:
            # The engine drops queued callbacks when a backward fails: put the gradients
            # already moved out of .grad (FSDP path) back now, so none is lost.
            accumulator._finalise(failed=True)
            raise
        accumulator._end_block(start)
        return (None, None) + input_grads


class ReplayCtx(ReplayFunction._backward_cls):  # type: ignore[misc, name-defined, unused-ignore]
    """The ``ctx`` (and graph node) of one block: its state until backward, in slots.

    Slots instead of attributes: a ``ctx`` attribute creates a per-node ``__dict__``
    (~340 B), and there used to be a separate per-block object besides. Whatever the
    blocks of a rollout share lives in ``site``; ``needs_input_grad`` (which autograd
    keeps anyway) says which inputs get gradients.
    """

    __slots__ = (
        "site",
        "index",
        "cpu_rng",
        "cuda_device",
        "cuda_rng",
        "autocast",
        "recompute_context",
        "num_outputs",
        "versions",
        "input_versions",
        "input_devices",
        "input_slices",
    )

    def capture_state(self) -> None:
        self.cpu_rng = torch.get_rng_state()
        device = self.site.device
        cuda_device = device if device.type == "cuda" else None
        if cuda_device is None and torch.cuda.is_initialized():
            # CPU inputs, but the model may still compute on the GPU (FSDP with CPU
            # offload moves its inputs to the compute device): replay the current
            # GPU's RNG and autocast state too, or dropout masks would differ.
            cuda_device = torch.device("cuda", torch.cuda.current_device())
        self.cuda_device = cuda_device
        self.cuda_rng = None if cuda_device is None else torch.cuda.get_rng_state(cuda_device)
        types = ("cpu",) if cuda_device is None else ("cpu", "cuda")
        autocast = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)
        # Interned: every block of a rollout usually has the same state (kept until backward).
        self.autocast = _AUTOCAST_STATES.setdefault(autocast, autocast)

    def forget_unused_rng(self) -> None:
        """Drop the RNG snapshots the forward did not consume (most policies draw none).

        A snapshot is 5 KB per block on the CPU, a third of a small policy's inputs,
        and restoring it is the costliest part of a recompute. A forward that drew no
        random numbers recomputes without them, so nothing needs restoring.
        """
        if torch.equal(torch.get_rng_state(), self.cpu_rng):
            self.cpu_rng = None  # type: ignore[assignment]
        if self.cuda_rng is not None and torch.equal(torch.cuda.get_rng_state(self.cuda_device), self.cuda_rng):  # type: ignore[arg-type]
            self.cuda_rng = None

    def recompute_state(self):
        """Context that restores the forward's RNG and autocast state."""
        return RestoredState(self)

    @property
    def uses_rng(self) -> bool:
        """Whether the forward drew random numbers (its RNG snapshots were kept)."""
        return self.cpu_rng is not None or self.cuda_rng is not None

    def rng_now(self) -> tuple:
        """The RNG state of the streams this block replays, now (inside :meth:`recompute_state`)."""
        return (
            torch.get_rng_state(),
            None if self.cuda_rng is None else torch.cuda.get_rng_state(self.cuda_device),  # type: ignore[arg-type]
        )

    def set_rng(self, state: tuple) -> None:
        """Set the streams this block replays to ``state`` (from :meth:`rng_now`)."""
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.cuda_device)  # type: ignore[arg-type]


# Autograd creates a Function's ctx from ``_backward_cls`` on every apply.
ReplayFunction._backward_cls = ReplayCtx


def recompute_and_backward(
    block: ReplayCtx,
    saved: Sequence[torch.Tensor],
    requires_grad: Sequence[bool],
    grads,
    *,
    continue_sums: bool = False,
) -> tuple:
    """Recompute one block with grad enabled and back-propagate ``grads`` through it;
    returns the gradients of its inputs (None where an input does not require grad).

    ``continue_sums``: each parameter's gradient so far (``.grad``) is fed into the nested
    backward as its first contribution instead of having the block's own sum added to it, so a
    parameter used several times in the block sums in plain autograd's order (a block that runs
    k steps in one call; engine/steps.py). Not under FSDP, whose gradients the accumulator keeps.
    """
    inputs = [t.detach().requires_grad_(rg) for t, rg in zip(saved, requires_grad)]
    site = block.site
    with torch.enable_grad(), block.recompute_state(), block.recompute_context:
        outputs = site.call(inputs)
    site.plan.check_versions(block.versions, "the recompute", block.index)
    flat, _ = flatten_outputs(outputs, site.model)
    if len(flat) != block.num_outputs:
        raise ReplayError(
            _PREFIX + f"block {block.index} returned {len(flat)} tensors when recomputed but "
            f"{block.num_outputs} in the forward; the model must be deterministic given its "
            "inputs, RNG and autocast state." + DEBUG_TIP
        )
    roots: Sequence[torch.Tensor] = flat
    root_grads: Sequence = grads
    if continue_sums and not site.plan.absorb:
        extra, extra_grads = [], []  # only here: the one-step path copies nothing
        with torch.enable_grad():
            for p in site.plan.params:
                if p.grad is not None and p.requires_grad:
                    # A view made after the recompute: the engine runs its node first, so the
                    # running sum reaches the parameter's accumulation before any of the block's.
                    extra.append(p.view_as(p))
                    extra_grads.append(p.grad)
                    p.grad = None
        roots, root_grads = [*flat, *extra], [*grads, *extra_grads]
    backward_from(block, roots, root_grads)
    return tuple(t.grad if rg else None for t, rg in zip(inputs, requires_grad))


def backward_from(block: ReplayCtx, flat: Sequence[torch.Tensor], grads: Sequence, *, last: bool = True) -> None:
    """Back-propagate ``grads`` from the recomputed outputs ``flat`` (one nested backward;
    ``last``: the block's last one, where Rule 11's reduction runs)."""
    roots, root_grads = [], []
    for out, grad in zip(flat, grads):
        if grad is not None and out.requires_grad:
            if out.shape != grad.shape:
                raise ReplayError(
                    _PREFIX + f"block {block.index} returned a tensor of shape {tuple(out.shape)} when "
                    f"recomputed where the forward's had shape {tuple(grad.shape)}; the model must be "
                    "deterministic given its inputs, RNG and autocast state." + DEBUG_TIP
                )
            roots.append(out)
            root_grads.append(grad)
    plan = block.site.plan
    reduces = plan.reduce_now and last
    if reduces:
        # Rule 11: this backward reduces every block's gradient, and FSDP reduces only the units
        # it reaches, so it starts from every output (zeros where an output got no gradient).
        plan.reduce_now = False
        skipped = plan.units_left_unreduced()
        if skipped:
            raise ReplayError(
                _PREFIX + f"block {block.index}, the last of its rollout, does not run the FSDP "
                f"unit(s) {', '.join(repr(n) for n in skipped)} that earlier blocks ran. Under "
                "SHARD_GRAD_OP and NO_SHARD the gradient is reduced once, in the last block's "
                "backward, which reduces only the units it runs: call every unit in every "
                "block, or use FULL_SHARD."
            )
        plan.end_deferral()
        for out, grad in zip(flat, grads):
            if grad is None and out.requires_grad:
                roots.append(out)
                root_grads.append(torch.zeros_like(out))
    if roots:
        # The engine directly, outside enable_grad (the nested backward must not build a
        # graph itself): ``torch.autograd.backward`` would only re-check what autograd
        # already guarantees for ``grads`` (one per output, of its dtype and device) and
        # the shapes compared above.
        _engine_run_backward(
            tuple(roots),
            tuple(root_grads),
            False,
            False,
            (),
            allow_unreachable=True,
            accumulate_grad=True,
        )


# ----------------------------------------------------------------------- shared driver
def _input_device(tensors: Sequence[torch.Tensor], what: Callable[[int], str]) -> torch.device:
    device = None
    for i, t in enumerate(tensors):
        if t.device.type not in _SUPPORTED_DEVICE_TYPES:
            raise ValueError(
                _PREFIX + f"{what(i)} is on device '{t.device}'; replay supports CPU and CUDA "
                "tensors. Move it with .to('cpu') or .to('cuda')."
            )
        if t.is_cuda:
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(
                    _PREFIX + f"{what(i)} is on {t.device} but other inputs are on {device}; "
                    "all CUDA inputs of a block must be on one device."
                )
    return device if device is not None else _CPU


def _site_for(plan: ModelPlan, model, accumulator, layout, context_fn, device) -> Site:
    site = plan.site() if plan.site is not None else None
    if site is None or not site.matches(model, accumulator, layout, context_fn, device):
        site = Site(model, plan, accumulator, layout, context_fn, device)
        plan.site = weakref.ref(site)
    return site


def apply_block(model, accumulator, tensors, layout, context_fn, what):
    if not callable(model):
        raise TypeError(_PREFIX + f"model must be callable, got {type(model).__name__}.")
    if not isinstance(accumulator, GradientAccumulator):
        raise TypeError(
            _PREFIX + f"accumulator must be a GradientAccumulator (or a dict for "
            f"checkpoint_fsdp_forward), got {type(accumulator).__name__}."
        )
    device = _input_device(tensors, what)
    accumulator._check_open()
    plan = plan_for(accumulator, model)
    if plan.fsdp_units:
        plan.check_fsdp_sync()
    site = _site_for(plan, model, accumulator, layout, context_fn, device)
    # The anchor only when no input attaches the outputs to autograd: an input costs
    # the node an edge and its metadata until the backward.
    anchor = None if any(t.requires_grad for t in tensors) else _anchor(device)
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        flat = ReplayFunction.apply(site, anchor, *tensors)
    accumulator._record_block(sum(t.numel() * t.element_size() for t in tensors))
    plan.recorded += 1
    return unflatten_outputs(flat, site.out_spec)


# --------------------------------------------------------------------- public entries
def replay(
    model: Callable[..., Any],
    accumulator: GradientAccumulator,
    inputs: TensorDictBase,
    *,
    context_fn: ContextFn | None = None,
):
    r"""Run ``model(**inputs)`` as one replay block of a rollout.

    The forward runs without building a graph; only the leaves of ``inputs`` are kept
    (on the host) for the backward, where the block is recomputed with grad enabled
    under the same RNG and autocast state. Parameter gradients go to ``accumulator``;
    gradients for input tensors that require grad are returned to autograd, so a
    recurrent state passed from block to block carries gradient through the rollout.

    Args:
        model: an ``nn.Module`` (or a bound method of one) called as ``model(**inputs)``.
            Under FSDP1 pass the FSDP-wrapped root module.
        accumulator: the :class:`GradientAccumulator` shared by every block of this
            rollout.
        inputs: the block's keyword inputs. Top-level keys become keyword arguments;
            nested TensorDicts reach the model as TensorDicts.

    Keyword args:
        context_fn: optional callable returning ``(forward_context, recompute_context)``,
            entered around the forward and the recompute respectively (as in
            ``torch.utils.checkpoint``).

    Returns:
        The model's outputs, attached to autograd: a TensorDict when the model returns
        a TensorDict or a mapping of tensors, otherwise the tensor or tuple it returned.

    Example::

        acc = rl_replay.GradientAccumulator()
        state = policy.initial_state(batch)
        for t in range(T):
            out = rl_replay.replay(policy, acc, TensorDict(observation=obs[t], state=state))
            state = out["state"]
            losses.append(out["value"].square().mean())
        torch.stack(losses).sum().backward()   # one backward, all blocks replayed
        optimizer.step()

    .. warning::
        If ``torch.is_grad_enabled()`` is False (e.g. evaluation under ``no_grad``)
        the model is simply called: nothing is recorded.

    .. warning::
        The model must not modify its parameters or buffers and must be
        deterministic given its inputs, RNG and autocast state; otherwise the
        recomputed forward differs from the one that produced the outputs.
        Parameter and buffer changes raise :class:`ReplayError`.
    """
    if not isinstance(inputs, TensorDictBase):
        raise TypeError(
            _PREFIX + f"replay() takes its inputs as a TensorDict, got {type(inputs).__name__}. "
            "Use TensorDict(observation=obs, ...) or checkpoint_fsdp_forward(model, acc, **kwargs)."
        )
    if not torch.is_grad_enabled():
        outputs = model(**inputs)
        if isinstance(outputs, Mapping) and not isinstance(outputs, TensorDictBase):
            outputs = TensorDict(dict(outputs), batch_size=[])  # as with grad enabled
        return outputs
    leaves, layout = flatten_inputs(inputs)
    if not leaves:
        raise ValueError(
            _PREFIX + f"replay() needs at least one tensor input; the TensorDict has keys "
            f"{list(inputs.keys(include_nested=True))} but no tensors."
        )
    paths = None

    def what(i: int) -> str:
        nonlocal paths
        if paths is None:
            paths = [k for k, _ in inputs.items(include_nested=True, leaves_only=True)]
        return f"input {paths[i]!r}"

    return apply_block(model, accumulator, leaves, layout, context_fn, what)
