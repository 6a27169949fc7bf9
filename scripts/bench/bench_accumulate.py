"""Gradient accumulation across replay blocks: the original helper vs rl_replay.

The helper that ``rl_replay`` replaces (``checkpoint_fsdp_forward`` with a plain dict
``accumulated``) clears every parameter's ``.grad`` before each block's nested backward,
adds the previous running sum back and stores a ``clone()`` of every parameter's full
gradient after every block. rl_replay lets autograd's ``AccumulateGrad`` sum in place
(plain modules). This benchmark runs a >= 10M-parameter policy for T = 256 blocks with
each method in a fresh process and reports backward time (median of 3) and peak memory,
plus plain autograd as the gradient reference.

Usage::

    python scripts/bench/bench_accumulate.py            # 12.7M-parameter MLP, T = 256
    python scripts/bench/bench_accumulate.py --write-docs   # the same, and update docs/benchmarks.md
    python scripts/bench/bench_accumulate.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from _bench_common import (
    GLIBC_NOTE,
    LiveTensorCensus,
    MemoryMeter,
    describe_machine,
    grad_diff,
    grad_snapshot,
    load_line,
    median,
    run_isolated,
    set_threads,
    worker_cli,
)
from _bench_policies import MLPPolicy
from _bench_report import add_worker_arguments, fmt_bytes, fmt_s, refuse_smoke_docs, write_section

import rl_replay

PRELOAD = ["torch", "tensordict", "rl_replay", "_bench_common", "_bench_policies"]
POLICY = dict(kind="mlp", obs=64, width=2048, layers=4, actions=8, batch=8)
SMOKE_POLICY = dict(kind="mlp", obs=8, width=32, layers=3, actions=4, batch=4)
METHODS = ("plain", "helper", "rl_replay")


# ----------------------------------------------------------------------------------------
# Baseline: the original helper, verbatim except for its name (reference copy of the seed
# ``checkpoint_fsdp_forward``; its backward clones every parameter's gradient per block).
# ----------------------------------------------------------------------------------------
def helper_checkpoint_fsdp_forward(model, accumulated, *, context_fn=None, **kwargs):
    """Replay independent model forwards and accumulate parameter gradients (seed helper)."""
    keys = tuple(kwargs)
    values = tuple(kwargs.values())
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    if not tensors:
        raise ValueError("FSDP replay requires at least one tensor input.")
    device = next((value.device for value in tensors if value.is_cuda), tensors[0].device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"FSDP replay supports CPU and CUDA inputs, got {device}.")
    if any(value.is_cuda and value.device != device for value in tensors):
        raise ValueError("FSDP replay requires all CUDA inputs on one device.")
    cuda_devices = [device.index] if device.type == "cuda" else []

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, anchor, *args):
            ctx.tensor_indices = [index for index, value in enumerate(args) if isinstance(value, torch.Tensor)]
            ctx.other_args = {index: value for index, value in enumerate(args) if not isinstance(value, torch.Tensor)}
            tensors = [args[index] for index in ctx.tensor_indices]
            ctx.input_requires_grad = [value.requires_grad for value in tensors]
            ctx.save_for_backward(*tensors)
            forward_context, ctx.replay_context = (
                context_fn() if context_fn is not None else (nullcontext(), nullcontext())
            )
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_rng = torch.cuda.get_rng_state(device) if cuda_devices else None
            ctx.autocast = torch.is_autocast_enabled(device.type)
            ctx.autocast_dtype = torch.get_autocast_dtype(device.type)
            ctx.set_materialize_grads(False)
            with forward_context:
                outputs = model(**dict(zip(keys, args)))
            if not isinstance(outputs, torch.Tensor) and not (
                isinstance(outputs, tuple) and all(isinstance(output, torch.Tensor) for output in outputs)
            ):
                raise TypeError("FSDP replay requires a tensor or a tuple of tensors as output.")
            return outputs

        @staticmethod
        def backward(ctx, *output_grads):
            parameters = list(model.parameters())
            # Clear gradient slots; the separate accumulator preserves earlier block gradients.
            previous_grads = [accumulated.get(parameter) for parameter in parameters]
            model.zero_grad(set_to_none=True)
            tensors = [
                value.detach().requires_grad_(requires_grad)
                for value, requires_grad in zip(ctx.saved_tensors, ctx.input_requires_grad)
            ]
            args = dict(ctx.other_args)
            args.update(zip(ctx.tensor_indices, tensors))
            with (
                torch.random.fork_rng(devices=cuda_devices),
                torch.enable_grad(),
                torch.autocast(device.type, enabled=ctx.autocast, dtype=ctx.autocast_dtype),
            ):
                torch.set_rng_state(ctx.cpu_rng)
                if cuda_devices:
                    torch.cuda.set_rng_state(ctx.cuda_rng, device)
                with ctx.replay_context:
                    outputs = model(**{key: args[index] for index, key in enumerate(keys)})
            outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
            active = [
                (output, grad)
                for output, grad in zip(outputs, output_grads)
                if grad is not None and output.requires_grad
            ]
            if active:
                torch.autograd.backward([output for output, _ in active], [grad for _, grad in active])
            # FSDP completes reduce-scatter and offload before accumulating local shards.
            for parameter, previous in zip(parameters, previous_grads):
                if previous is not None:
                    if parameter.grad is None:
                        parameter.grad = previous
                    else:
                        parameter.grad.add_(previous)
                if parameter.grad is not None:
                    accumulated[parameter] = parameter.grad.detach().clone()
            result = [None] * len(keys)
            for index, tensor in zip(ctx.tensor_indices, tensors):
                result[index] = tensor.grad
            return (None, *result)

    with torch.autograd.graph.save_on_cpu():
        return Replay.apply(torch.empty(0, device=device, requires_grad=True), *values)


# ----------------------------------------------------------------------------------------
def rollout_loss(policy, cfg, method, T, *, data_seed=1234):
    g = torch.Generator().manual_seed(data_seed)
    B = cfg["batch"]
    acc = rl_replay.GradientAccumulator() if method == "rl_replay" else {}
    terms = []
    for _ in range(T):
        obs = torch.randn(B, cfg["obs"], generator=g)
        action = torch.randint(cfg["actions"], (B, 1), generator=g)
        adv = torch.randn(B, generator=g)
        ret = torch.randn(B, generator=g)
        if method == "plain":
            logits, value = policy(obs)
        elif method == "helper":
            logits, value = helper_checkpoint_fsdp_forward(policy, acc, obs=obs)
        else:
            logits, value = rl_replay.checkpoint_fsdp_forward(policy, acc, obs=obs)
        logp = F.log_softmax(logits, dim=-1).gather(1, action).squeeze(1)
        terms.append(-(logp * adv).mean() + 0.5 * (value - ret).square().mean())
    return torch.stack(terms).sum() / T, acc


def worker(spec: dict) -> dict:
    gc.collect()
    gc.freeze()
    set_threads(spec["threads"])
    cfg, T, method = spec["cfg"], spec["T"], spec["method"]
    torch.manual_seed(0)
    policy = MLPPolicy(**cfg)
    params = list(policy.parameters())
    result = dict(
        method=method,
        T=T,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
    )
    loss, _ = rollout_loss(policy, cfg, method, min(T, 4))  # warm-up
    loss.backward()
    policy.zero_grad(set_to_none=True)
    del loss
    fwds, bwds, rss_fwd, rss_total, live, live_after = [], [], [], [], [], []
    for rep in range(spec["reps"]):
        meter = MemoryMeter(torch.device("cpu"))
        census = LiveTensorCensus() if rep == 0 else None
        if census is not None:
            census.snapshot_before(params)
        meter.start()
        t0 = time.perf_counter()
        loss, acc = rollout_loss(policy, cfg, method, T)
        t1 = time.perf_counter()
        if census is not None:
            live.append(sum(census.live_bytes().values()))
        rss_fwd.append(meter.peak_rss_growth())
        meter.start()  # backward's own peak, from the end of the forward
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        rss_total.append(meter.peak_rss_growth())
        if census is not None:  # gradients plus whatever the method keeps after backward
            grads = [p.grad for p in params if p.grad is not None]
            live_after.append(sum(census.live_bytes(grads).values()))
            del grads
            del census
        fwds.append(t1 - t0)
        bwds.append(t3 - t2)
        if rep == 0:
            grads = grad_snapshot(policy)
            if spec.get("grad_out"):
                torch.save(grads, spec["grad_out"])
            if spec.get("grad_ref"):
                result["grad_abs"], result["grad_rel"] = grad_diff(grads, torch.load(spec["grad_ref"]))
            del grads
        del loss, acc
        policy.zero_grad(set_to_none=True)
        gc.collect()
    result.update(
        fwd_s=median(fwds),
        bwd_s=median(bwds),
        fwd_all=fwds,
        bwd_all=bwds,
        live_fwd_bytes=live[0],
        live_after_bwd_bytes=live_after[0],
        rss_fwd_growth=rss_fwd[0],
        rss_bwd_growth=rss_total[0],
        rss_bwd_growth_all=rss_total,
    )
    return result


def report(results: dict[str, dict]) -> tuple[list[str], str, str]:
    """(markdown table lines, summary line, gradient-check line) of the workers' results."""
    h, rr = results["helper"], results["rl_replay"]
    lines = [
        "| method | rollout fwd | backward (median) | backward runs | tensors alive after backward "
        "| peak RSS growth in backward | grad max abs / rel diff vs plain |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for m in METHODS:
        r = results[m]
        g = f"{r['grad_abs']:.1e} / {r['grad_rel']:.1e}" if "grad_abs" in r else "(reference)"
        lines.append(
            f"| {m} | {fmt_s(r['fwd_s'])} | {fmt_s(r['bwd_s'])} | "
            f"{', '.join(fmt_s(b) for b in r['bwd_all'])} | {fmt_bytes(r['live_after_bwd_bytes'])} | "
            f"{fmt_bytes(r['rss_bwd_growth'])} | {g} |"
        )
    summary = (
        f"summary accumulate: backward time rl_replay/helper = {rr['bwd_s'] / h['bwd_s']:.2f}x "
        f"({fmt_s(rr['bwd_s'])} vs {fmt_s(h['bwd_s'])}); peak RSS growth in backward "
        f"rl_replay/helper = {rr['rss_bwd_growth'] / max(1, h['rss_bwd_growth']):.2f}x "
        f"({fmt_bytes(rr['rss_bwd_growth'])} vs {fmt_bytes(h['rss_bwd_growth'])}; "
        f"one fp32 gradient = {fmt_bytes(rr['param_bytes'])}); tensors alive after backward "
        f"rl_replay {fmt_bytes(rr['live_after_bwd_bytes'])} vs helper {fmt_bytes(h['live_after_bwd_bytes'])}"
    )
    worst_abs = max(r["grad_abs"] for r in (h, rr))
    worst_rel = max(r["grad_rel"] for r in (h, rr))
    grad_line = (
        f"gradient check: worst abs diff {worst_abs:.3e}, worst rel diff {worst_rel:.3e} "
        "(helper and rl_replay vs plain autograd)"
    )
    return lines, summary, grad_line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    add_worker_arguments(ap, "bench_accumulate")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_cli(worker, args.worker)
    refuse_smoke_docs(ap, args)
    cfg = SMOKE_POLICY if args.smoke else POLICY
    T = 8 if args.smoke else args.T
    reps = 1 if args.smoke else args.reps
    print(describe_machine(), f"| {args.threads} thread(s), launcher {args.launcher}", flush=True)
    with torch.device("meta"):
        n = sum(p.numel() for p in MLPPolicy(**cfg).parameters())
    print(
        f"policy: MLP {cfg} = {n / 1e6:.2f} M parameters ({fmt_bytes(4 * n)} of fp32 gradient); "
        f"T = {T} blocks; {reps} rep(s) per method, each method in a fresh process",
        flush=True,
    )
    results = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_accumulate_") as tmp:
        ref = os.path.join(tmp, "plain.pt")
        for method in METHODS:
            spec = dict(cfg=cfg, T=T, method=method, reps=reps, threads=args.threads)
            if method == "plain":
                spec["grad_out"] = ref
            else:
                spec["grad_ref"] = ref
            r = run_isolated(
                worker, spec, script=os.path.abspath(__file__), launcher=args.launcher, timeout=1800, preload=PRELOAD
            )
            if "error" in r:
                print(f"{method}: ERROR {r['error']}\n{r.get('traceback', '')}")
                return 1
            results[method] = r
            g = f"  grad vs plain: abs {r['grad_abs']:.1e} rel {r['grad_rel']:.1e}" if "grad_abs" in r else ""
            print(
                f"{method:<10} fwd {fmt_s(r['fwd_s']):>9}  backward {fmt_s(r['bwd_s']):>9} "
                f"(all {', '.join(fmt_s(b) for b in r['bwd_all'])})  live after fwd "
                f"{fmt_bytes(r['live_fwd_bytes']):>10}  live after bwd {fmt_bytes(r['live_after_bwd_bytes']):>10}  peak RSS growth: fwd {fmt_bytes(r['rss_fwd_growth'])}, "
                f"bwd {fmt_bytes(r['rss_bwd_growth'])}{g}",
                flush=True,
            )
    lines, summary, grad_line = report(results)
    print()
    print("\n".join(lines))
    print()
    print(summary)
    print(grad_line)
    if args.write_docs:
        head = f"MLP {cfg} = {n / 1e6:.2f} M parameters, T = {T} blocks, {reps} runs per method\n\n"
        write_section(
            args.write_docs, "bench_accumulate", head + "\n".join(lines) + f"\n\n    {summary}\n    {grad_line}\n"
        )
    print(GLIBC_NOTE)
    print(f"wall time {time.perf_counter() - t_start:.0f} s; {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
