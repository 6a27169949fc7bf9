"""Multi-step replay blocks: k consecutive steps of a recurrent model as one block.

Where a sequence's inputs are known in advance (a stored rollout replayed by an update),
one replay block can cover k steps: the model is still called once per step, the block
saves the k steps' inputs and the state at its start (not the k - 1 states in between),
and its backward recomputes the k steps together. Everything a block costs beyond the
model itself (the autograd node, saving, RNG capture, flattening) is then paid once per
k steps. Memory stays flat in T: the saved inputs, plus k steps of activations at the peak.

The backward walks the k recomputed steps newest first with one nested backward per
step, each from that step's outputs and the gradient of the state it returned. That
keeps the order in which parameter gradients are summed exactly the order of plain
autograd over the whole sequence (and of one-step blocks), so the gradients are
bit-identical; a single nested backward for the k steps would sum each parameter's k
contributions first and differ in the last bits.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rl_replay.engine.accumulator import GradientAccumulator
from rl_replay.engine.errors import _PREFIX, DEBUG_TIP, ReplayError
from rl_replay.engine.layouts import Layout, Recompute, TDSpec, flatten_inputs, flatten_td, intern_spec
from rl_replay.engine.replay import ContextFn, ReplayCtx, apply_block, backward_from

__all__ = ["replay_sequence_call", "replay_steps"]


def _unstacked(spec: TDSpec) -> TDSpec:
    """``spec`` with the leading (step) dimension removed from every batch size."""
    entries = tuple((key, None if child is None else _unstacked(child)) for key, child in spec.entries)
    return intern_spec(entries, spec.batch_size[1:], spec.device)


def _stacked(spec: TDSpec, k: int) -> TDSpec:
    """``spec`` with a leading dimension of size ``k`` added to every batch size."""
    entries = tuple((key, None if child is None else _stacked(child, k)) for key, child in spec.entries)
    return intern_spec(entries, torch.Size([k, *spec.batch_size]), spec.device)


def _count(spec: TDSpec) -> int:
    return sum(1 if child is None else _count(child) for _, child in spec.entries)


def _split_step(out: Any, model: Callable) -> tuple[list, list, TDSpec, TDSpec]:
    """One step's outputs as (output leaves, state leaves, outputs spec, state spec)."""
    if type(out) is not TensorDict or "state" not in out.keys():
        raise TypeError(
            _PREFIX
            + f"replay_steps: {type(model).__name__} returned {type(out).__name__}"
            + ("" if type(out) is not TensorDict else f" with keys {sorted(out.keys())}")
            + "; each step must return a TensorDict with a 'state' entry (the next step's state) "
            "besides its other outputs."
        )
    outputs: list = []
    states: list = []
    entries = []
    state_spec = None
    for key, value in out._tensordict.items():
        if key == "state":
            state_spec = flatten_td(value, states)
            if state_spec is None:
                break
            continue
        if type(value) is torch.Tensor:
            outputs.append(value)
            entries.append((key, None))
        else:
            child = flatten_td(value, outputs)
            if child is None:
                state_spec = None
                break
            entries.append((key, child))  # type: ignore[arg-type]
    if state_spec is None:
        raise TypeError(
            _PREFIX + f"replay_steps: {type(model).__name__} returned a TensorDict with entries that are not "
            "tensors or plain TensorDicts (a TensorDict subclass, named dimensions or non-tensor data); "
            "multi-step blocks take plain TensorDicts only. Use one-step blocks (rl_replay.replay)."
        )
    return (
        outputs,
        states,
        intern_spec(tuple(entries), out.batch_size, out.device),
        state_spec,
    )


class _StepsLayout(Layout):
    """How a multi-step block calls its model (the :class:`~rl_replay.engine.layouts.Layout`
    protocol, with its own backward): the input structure ``{steps, state}``, the number of
    steps and the per-step structure (interned, shared by blocks)."""

    recompute = Recompute.STEPS

    __slots__ = (
        "spec",
        "k",
        "step_spec",
        "state_spec",
        "num_step_leaves",
        "__weakref__",
    )

    def __init__(self, spec: TDSpec, k: int) -> None:
        parts = dict(spec.entries)
        self.spec = spec
        self.k = k
        self.step_spec = _unstacked(parts["steps"])
        self.state_spec = parts["state"]
        self.num_step_leaves = _count(parts["steps"])

    def _states(self, tensors: Sequence[torch.Tensor]):
        m = self.num_step_leaves
        return tensors[:m], tensors[m:]

    def _step_kwargs(self, step_leaves: Sequence[torch.Tensor], i: int, state: TensorDict) -> dict:
        kwargs = self.step_spec.rebuild([t[i] for t in step_leaves])
        kwargs["state"] = state
        return kwargs

    def call(self, model: Callable, tensors: Sequence[torch.Tensor]) -> TensorDict:
        """The block's forward: k steps, the outputs stacked, the last state."""
        step_leaves, state_leaves = self._states(tensors)
        state = self.state_spec.build(iter(state_leaves))
        columns: list[list[torch.Tensor]] | None = None
        outputs_spec = None
        for i in range(self.k):
            out = model(**self._step_kwargs(step_leaves, i, state))
            outputs, _, outputs_spec, _ = _split_step(out, model)
            state = out["state"]
            if columns is None:
                columns = [[h] for h in outputs]
            else:
                for column, h in zip(columns, outputs):
                    column.append(h)
        stacked = _stacked(outputs_spec, self.k).build(iter([torch.stack(c) for c in columns]))  # type: ignore[arg-type, union-attr]
        return TensorDict._new_unsafe({"outputs": stacked, "state": state}, batch_size=torch.Size([]))

    def recompute_and_backward(
        self,
        block: ReplayCtx,
        saved: Sequence[torch.Tensor],
        requires_grad: Sequence[bool],
        grads,
    ) -> tuple:
        """Recompute the k steps with grad, then one nested backward per step, newest
        first (see the module docstring for why not one for all)."""
        inputs = [t.detach().requires_grad_(rg) for t, rg in zip(saved, requires_grad)]
        step_leaves, state_in = self._states(inputs)
        site = block.site
        if site.plan.fsdp_units:
            return self._stepwise(block, inputs, step_leaves, state_in, requires_grad, grads)
        steps = []  # per step: (step outputs, state outputs, the state leaves it read)
        with torch.enable_grad(), block.recompute_state(), block.recompute_context:
            state = self.state_spec.build(iter(state_in))
            for i in range(self.k):
                out = site.model(**self._step_kwargs(step_leaves, i, state))
                outputs, state_out, _, state_spec = _split_step(out, site.model)
                steps.append((outputs, state_out, state_in))
                if i + 1 < self.k:
                    state_in = [t.detach().requires_grad_(t.requires_grad) for t in state_out]
                    state = state_spec.build(iter(state_in))
        site.plan.check_versions(block.versions, "the recompute", block.index)
        num_step_outputs = len(steps[0][0])
        if num_step_outputs + len(steps[-1][1]) != block.num_outputs:
            raise ReplayError(
                _PREFIX + f"block {block.index} returned {num_step_outputs + len(steps[-1][1])} tensors per step when "
                f"recomputed but {block.num_outputs} in the forward; the model must be deterministic given "
                "its inputs, RNG and autocast state." + DEBUG_TIP
            )
        output_grads, state_grads = list(grads[:num_step_outputs]), list(grads[num_step_outputs:])
        for i in range(self.k - 1, -1, -1):
            outputs, state_out, state_in = steps.pop()
            backward_from(
                block,
                outputs + state_out,
                [None if g is None else g[i] for g in output_grads] + state_grads,
                last=i == 0,
            )
            state_grads = [t.grad if t.requires_grad else None for t in state_in]
        return tuple(t.grad if rg else None for t, rg in zip(inputs, requires_grad))

    def _stepwise(self, block: ReplayCtx, inputs, step_leaves, state_in, requires_grad, grads) -> tuple:
        """The FSDP1 path: each step recomputed with grad just before its own backward.

        FSDP1 frees a unit's unsharded parameters when a backward through it ends, so a
        recomputed step's graph must not outlive the next step's backward, and several
        forwards before one backward are not what FSDP1's hooks expect. A no-grad pass
        first gives the states between the steps (and each step's RNG state, if the block
        drew random numbers); the cost is one more forward per step under FSDP.
        """
        site = block.site
        model, k = site.model, self.k
        uses_rng = block.uses_rng
        starts, rngs = [list(state_in)], []
        with block.recompute_context:
            with torch.no_grad(), block.recompute_state():
                state = self.state_spec.build(iter(state_in))
                for i in range(k):
                    if uses_rng:
                        rngs.append(block.rng_now())
                    if i + 1 == k:
                        break
                    out = model(**self._step_kwargs(step_leaves, i, state))
                    _, state_out, _, state_spec = _split_step(out, model)
                    starts.append(state_out)
                    state = out["state"]
            num_step_outputs = block.num_outputs - len(starts[0])
            output_grads, state_grads = list(grads[:num_step_outputs]), list(grads[num_step_outputs:])
            for i in range(k - 1, -1, -1):
                leaves = (
                    inputs[self.num_step_leaves :]
                    if i == 0
                    else [t.detach().requires_grad_(t.dtype.is_floating_point or t.dtype.is_complex) for t in starts[i]]
                )
                with torch.enable_grad(), block.recompute_state():
                    if uses_rng:
                        block.set_rng(rngs[i])
                    out = model(**self._step_kwargs(step_leaves, i, self.state_spec.build(iter(leaves))))
                outputs, state_out, _, _ = _split_step(out, model)
                del out
                backward_from(
                    block,
                    outputs + state_out,
                    [None if g is None else g[i] for g in output_grads] + state_grads,
                    last=i == 0,
                )
                state_grads = [t.grad if t.requires_grad else None for t in leaves]
        site.plan.check_versions(block.versions, "the recompute", block.index)
        return tuple(t.grad if rg else None for t, rg in zip(inputs, requires_grad))


_LAYOUTS: weakref.WeakValueDictionary[tuple, _StepsLayout] = weakref.WeakValueDictionary()


def _check_steps(steps: Any, who: str) -> None:
    """ValueError unless ``steps`` is a TensorDict whose first batch dimension counts the steps."""
    if not isinstance(steps, TensorDictBase) or steps.batch_dims < 1 or steps.batch_size[0] < 1:
        raise ValueError(
            _PREFIX + f"{who} takes the steps' inputs as a TensorDict whose first batch dimension "
            f"counts the steps, got {type(steps).__name__}"
            + (f" of batch size {list(steps.batch_size)}" if isinstance(steps, TensorDictBase) else "")
            + ". Pass e.g. TensorDict(observation=obs[t:t + k], is_first=first[t:t + k], batch_size=[k, n])."
        )


def _layout_for(spec: TDSpec, k: int) -> _StepsLayout:
    layout = _LAYOUTS.get((spec, k))
    if layout is None:
        layout = _LAYOUTS[(spec, k)] = _StepsLayout(spec, k)
    return layout


def replay_steps(
    model: Callable[..., Any],
    accumulator: GradientAccumulator,
    steps: TensorDictBase,
    state: TensorDictBase,
    *,
    context_fn: ContextFn | None = None,
) -> tuple[TensorDict, TensorDict]:
    r"""Run k consecutive steps of a recurrent model as one replay block.

    Step ``i`` calls ``model(**steps[i], state=state)`` and the ``state`` entry of its
    output TensorDict is the next step's state, exactly as a loop of k
    :func:`~rl_replay.engine.replay` calls would; the block saves ``steps`` (all k rows)
    and the starting ``state`` only, and its backward recomputes the k steps at once.
    Gradients are bit-identical to plain autograd (and to k one-step blocks).

    Args:
        model: an ``nn.Module`` (or a bound method of one); under FSDP1 the wrapped root.
        accumulator: the rollout's :class:`~rl_replay.engine.GradientAccumulator`.
        steps: a plain TensorDict of batch size ``(k, *batch)``: row ``i`` holds step
            ``i``'s keyword inputs besides the state (e.g. ``observation``, ``is_first``).
            Rows of a stored rollout (``obs[t:t + k]``) are saved as views, not copied.
        state: the state before step 0 (a plain TensorDict; may require grad).

    Keyword args:
        context_fn: as for :func:`~rl_replay.engine.replay`.

    A model with one call over the k steps (an :class:`~rl_replay.Agent`) is replayed by
    :func:`replay_sequence_call` instead; this is the path of a model that takes one step at a
    time (a :class:`~rl_replay.StepwiseAgent`).

    Returns:
        ``(outputs, state)``: every output but ``state``, stacked over the k steps (batch
        ``(k, *batch)``), and the last step's state, both attached to autograd.
    """
    _check_steps(steps, "replay_steps")
    k = steps.batch_size[0]
    if not torch.is_grad_enabled():
        columns: dict = {}
        for i in range(k):
            out = model(**steps[i], state=state)
            state = out["state"]
            for key, value in out.exclude("state").items(include_nested=True, leaves_only=True):
                columns.setdefault(key, []).append(value)
        outputs = TensorDict(
            {key: torch.stack(v) for key, v in columns.items()},
            batch_size=[k, *steps.batch_size[1:]],
        )
        return outputs, state
    leaves: list[torch.Tensor] = []
    spec = flatten_td(
        TensorDict._new_unsafe({"steps": steps, "state": state}, batch_size=torch.Size([])),
        leaves,
    )
    if spec is None:
        raise TypeError(
            _PREFIX + "replay_steps takes plain TensorDicts (no subclasses, named dimensions or non-tensor "
            "entries) for steps and state; use one-step blocks (rl_replay.replay) for other inputs."
        )
    if not leaves:
        raise ValueError(_PREFIX + "replay_steps needs at least one tensor input; steps and state hold none.")
    paths = None

    def what(i: int) -> str:
        nonlocal paths
        if paths is None:
            paths = [
                ("steps",) + (k_ if isinstance(k_, tuple) else (k_,))
                for k_, _ in steps.items(include_nested=True, leaves_only=True)
            ]
            paths += [
                ("state",) + (k_ if isinstance(k_, tuple) else (k_,))
                for k_, _ in state.items(include_nested=True, leaves_only=True)
            ]
        return f"input {paths[i]!r}"

    out = apply_block(model, accumulator, leaves, _layout_for(spec, k), context_fn, what)
    return out["outputs"], out["state"]


class _SequenceLayout(Layout):
    """A block whose one model call runs k steps (:func:`replay_sequence_call`): the
    keyword layout of its inputs, and a recompute whose nested backward continues each
    parameter's running gradient sum instead of adding the block's own sum to it.

    A parameter used at every step (a recurrent weight) gets k contributions from one block.
    Plain autograd over the whole sequence adds them one at a time to the sum of the later
    blocks'; a nested backward would first sum the block's k and then add that, which
    rounds differently. So the recompute continues the running sums
    (:func:`~rl_replay.engine.replay.recompute_and_backward` with ``continue_sums``), and the
    sums end bit-identical to plain autograd's.
    """

    __slots__ = ("spec", "__weakref__")

    recompute = Recompute.ONE_CALL_CONTINUING_SUMS

    def __init__(self, spec: Layout) -> None:
        self.spec = spec

    def call(self, model: Callable, tensors: Sequence[torch.Tensor]) -> Any:
        return self.spec.call(model, tensors)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SequenceLayout) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> dict:
        return self.spec.rebuild(tensors)


_SEQUENCE_LAYOUTS: weakref.WeakValueDictionary[Any, _SequenceLayout] = weakref.WeakValueDictionary()


def replay_sequence_call(
    model: Callable[..., Any],
    accumulator: GradientAccumulator,
    steps: TensorDictBase,
    state: TensorDictBase,
    *,
    context_fn: ContextFn | None = None,
) -> tuple[TensorDict, TensorDict]:
    r"""Run one call of a model over k consecutive steps as one replay block.

    ``model(**steps, state=state)`` takes the ``(k, *batch)`` rows at once and returns
    ``TensorDict(outputs=<batch (k, *batch)>, state=<the state after the last row>,
    batch_size=[])``: the call of an :class:`~rl_replay.Agent`. The block saves the k steps'
    inputs and the starting state, and its backward recomputes that one call, continuing each
    parameter's running gradient sum, so its gradients are bit-identical to plain autograd
    running the same call; under FSDP each unit gathers its parameters once per block.

    Args:
        model: an ``nn.Module`` (or a bound method of one); under FSDP the wrapped root.
        accumulator: the rollout's :class:`~rl_replay.engine.GradientAccumulator`.
        steps: a plain TensorDict of batch size ``(k, *batch)`` with the keyword inputs but the
            state (e.g. ``observation``, ``is_first``); rows of a stored rollout are saved as views.
        state: the state before row 0 (a plain TensorDict; may require grad).

    Keyword args:
        context_fn: as for :func:`~rl_replay.engine.replay`.

    Returns:
        ``(outputs, state)``, both attached to autograd.
    """
    _check_steps(steps, "replay_sequence_call")
    inputs = TensorDict({**dict(steps.items()), "state": state}, batch_size=[])
    if not torch.is_grad_enabled():
        out = model(**inputs)
    else:
        leaves, spec = flatten_inputs(inputs)
        try:  # shared by the blocks of one structure (a pytree layout is not hashable)
            layout = _SEQUENCE_LAYOUTS.get(spec)
            if layout is None:
                layout = _SEQUENCE_LAYOUTS[spec] = _SequenceLayout(spec)
        except TypeError:
            layout = _SequenceLayout(spec)

        def what(i: int) -> str:
            paths = [k for k, _ in inputs.items(include_nested=True, leaves_only=True)]
            return f"input {paths[i]!r}"

        out = apply_block(model, accumulator, leaves, layout, context_fn, what)
    keys = set(out.keys()) if isinstance(out, TensorDictBase) else set()
    if "outputs" not in keys or "state" not in keys:
        got = f"a TensorDict with keys {sorted(out.keys())}" if isinstance(out, TensorDictBase) else type(out).__name__
        raise TypeError(
            _PREFIX + f"replay_sequence_call: {type(model).__name__} returned {got}; a call over k "
            "steps must return TensorDict(outputs=<(k, ...) outputs>, state=<the last state>, batch_size=[]) "
            "(Agent.output)."
        )
    outputs = out["outputs"]
    if outputs.batch_size[:1] != steps.batch_size[:1]:
        raise ValueError(
            _PREFIX + f"replay_sequence_call: {type(model).__name__} returned outputs of batch size "
            f"{list(outputs.batch_size)} for {steps.batch_size[0]} steps; row t of the outputs is step t."
        )
    return outputs, out["state"]
