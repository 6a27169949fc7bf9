"""``memory.py --rss``: peak RSS growth per rollout step of rl_replay against the bytes it saves per step.

The policy: observation (64) -> 3 x (Linear 1024 + ReLU) -> GRUCell 256 -> actor (8) and
critic heads, batch 32; one ``checkpoint_fsdp_forward`` block per timestep, one
``backward``. The loss (``--loss``), as the trainer's losses do, is computed once on the
stacked ``(T, B)`` outputs: ``sum_t 0.5 * mean(value_t ** 2) + mean(logits_t)``, with the
means written as ``sum() / n`` (same values; the gradient reaching the logits stays a
broadcast instead of a materialised ``(T, B, 8)`` tensor). ``a2c``: the A2C terms
(log-softmax, gather, advantage), also stacked; ``per-step`` and ``a2c-per-step``: the
same sums built from one small graph per step (what the probe did before; those graphs
keep 4-10 KiB per step, which is the loss's, not the engine's). The observations are
views of one preallocated ``(T, B, 64)`` tensor (allocated before the measurement
starts), so the only new bytes a block saves are its recurrent state: 32 x 256 x 4 B =
32 KiB per step.

Each (allocator setting, T) runs in a fresh ``python`` process: after a warm-up rollout
(lazy initialisation, gradient buffers) the peak-RSS counter ``VmHWM`` is reset through
``/proc/self/clear_refs`` and the T-step rollout + backward runs; its peak RSS growth is
``VmHWM`` minus ``VmRSS`` at the start. The growth per step is the slope between the
smallest and the largest T, compared with the copied (non-view) input bytes per step.

Allocator settings: ``MALLOC_MMAP_THRESHOLD_=65536`` (fixed mmap threshold) or glibc's
defaults, each with and without ``rl_replay.engine.keep_freed_memory()`` (the
trainer's default).

Usage::

    python -m scripts.bench memory --rss                       # T = 64 and 1024, all four settings
    python -m scripts.bench memory --rss --T 16 128 --json r.json
    python -m scripts.bench memory --rss --repeats 3 --loss a2c
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys

from scripts.bench.common import ROOT, median

PREFIX = "RSS_RESULT "
SETTINGS = {
    # name: (environment additions, keep_freed_memory)
    "mmap64k": ({"MALLOC_MMAP_THRESHOLD_": "65536"}, False),
    "mmap64k+keep": ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True),
    "default": ({}, False),
    "default+keep": ({}, True),
}
OBS, WIDTH, LAYERS, HIDDEN, ACTIONS, BATCH = 64, 1024, 3, 256, 8, 32
LOSSES = ("stacked", "a2c", "per-step", "a2c-per-step")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field}:\s+(\d+)\s+kB", fh.read(), re.M).group(1)) * 1024


def _trim_heap() -> None:
    """Return the heap's free pages to the OS (glibc ``malloc_trim(0)``), if glibc.

    The warm-up leaves between 0 and ~trim-threshold bytes of freed heap resident, and
    the measured rollout reuses them before it grows RSS; how many is chance (8.5 MiB
    apart between identical runs here), which made the baseline, not the engine, the
    largest term in the slope. Trimmed, every run starts from the same resident heap.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def worker(T: int, keep: bool, loss: str = "stacked") -> dict:
    """One measurement in this (fresh) process."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import rl_replay
    from rl_replay.engine import keep_freed_memory

    torch.set_num_threads(1)
    kept = keep_freed_memory() if keep else False

    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            layers, d = [], OBS
            for _ in range(LAYERS):
                layers += [nn.Linear(d, WIDTH), nn.ReLU()]
                d = WIDTH
            self.encoder = nn.Sequential(*layers)
            self.cell = nn.GRUCell(WIDTH, HIDDEN)
            self.actor = nn.Linear(HIDDEN, ACTIONS)
            self.critic = nn.Linear(HIDDEN, 1)

        def forward(self, obs, h):
            h = self.cell(self.encoder(obs), h)
            return self.actor(h), self.critic(h).squeeze(-1), h

    torch.manual_seed(0)
    policy = Policy()
    g = torch.Generator().manual_seed(1)
    obs = torch.randn(T, BATCH, OBS, generator=g)
    actions = torch.randint(ACTIONS, (T, BATCH, 1), generator=g)
    advantages = torch.randn(T, BATCH, generator=g)

    def rollout(steps: int):
        acc = rl_replay.GradientAccumulator()
        h = torch.zeros(BATCH, HIDDEN)
        logits_t, values_t, terms = [], [], []
        for t in range(steps):
            logits, value, h = rl_replay.checkpoint_fsdp_forward(policy, acc, obs=obs[t], h=h)
            if loss == "per-step":
                terms.append(0.5 * value.square().mean() + logits.mean())
            elif loss == "a2c-per-step":
                logp = F.log_softmax(logits, -1).gather(1, actions[t]).squeeze(1)
                terms.append(-(logp * advantages[t]).mean() + 0.5 * value.square().mean())
            else:
                logits_t.append(logits)
                values_t.append(value)
        if terms:
            return torch.stack(terms).sum(), acc
        # The same sums over steps, on the stacked (T, B) outputs: O(1) graph nodes.
        L, V = torch.stack(logits_t), torch.stack(values_t)
        if loss == "a2c":
            logp = F.log_softmax(L, -1).gather(2, actions[:steps]).squeeze(2)
            per_step = -(logp * advantages[:steps]).mean(1) + 0.5 * V.square().mean(1)
        else:
            # mean() as sum() / n: the same values, but the gradient reaching the
            # logits stays a broadcast (mean's backward materialises it, 1 KiB a step).
            per_step = 0.5 * V.square().sum(1) / BATCH + L.sum((1, 2)) / (BATCH * ACTIONS)
        return per_step.sum(), acc

    total, _ = rollout(min(T, 8))  # warm-up: lazy initialisation and the .grad buffers
    total.backward()
    del total
    gc.collect()
    _trim_heap()
    base = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    total, acc = rollout(T)
    after_forward = _status_bytes("VmRSS") - base
    total.backward()
    peak = _status_bytes("VmHWM") - base
    after_backward = _status_bytes("VmRSS") - base
    copied = getattr(acc, "slab_bytes", None)
    return dict(
        T=T,
        loss=loss,
        keep_freed_memory=keep,
        keep_applied=kept,
        peak_growth=peak,
        after_forward=after_forward,
        after_backward=after_backward,
        saved_bytes=acc.saved_bytes,
        slab_bytes=copied,
        state_bytes_per_step=BATCH * HIDDEN * 4,
    )


def measure(setting: str, T: int, loss: str = "stacked", timeout: float = 600) -> dict:
    env_add, keep = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_add, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "scripts.bench.memory", "--rss", "--worker", str(T), str(int(keep)), loss]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(PREFIX):
            return dict(json.loads(line[len(PREFIX) :]), setting=setting)
    raise RuntimeError(f"worker {setting} T={T} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def slope(results: list[dict], setting: str, rep: int = 0) -> dict:
    rs = sorted((r for r in results if r["setting"] == setting and r.get("rep", 0) == rep), key=lambda r: r["T"])
    lo, hi = rs[0], rs[-1]
    dT = hi["T"] - lo["T"]
    per_step = (hi["peak_growth"] - lo["peak_growth"]) / dT
    fwd_per_step = (hi["after_forward"] - lo["after_forward"]) / dT
    inputs = hi["state_bytes_per_step"]
    return dict(
        setting=setting,
        rep=rep,
        T=(lo["T"], hi["T"]),
        peak_per_step=per_step,
        forward_per_step=fwd_per_step,
        inputs_per_step=inputs,
        ratio=per_step / inputs,
        forward_ratio=fwd_per_step / inputs,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="memory.py --rss", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--T", type=int, nargs=2, default=[64, 1024], metavar=("T_LO", "T_HI"))
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="fresh-process measurements per (setting, T); slopes pair the runs of "
        "one repeat and are summarised by their median",
    )
    ap.add_argument("--json", help="write the raw results and slopes here")
    ap.add_argument(
        "--loss",
        choices=LOSSES,
        default="stacked",
        help="stacked (default): the probe loss on the stacked (T, B) outputs; "
        "a2c: A2C terms on the stacked outputs; per-step, a2c-per-step: the "
        "same sums built from one small graph per step",
    )
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        T, keep, loss = int(args.worker[0]), bool(int(args.worker[1])), args.worker[2]
        print(PREFIX + json.dumps(worker(T, keep, loss)), flush=True)
        return 0
    results = [
        dict(measure(s, T, args.loss), rep=rep) for rep in range(args.repeats) for s in args.settings for T in args.T
    ]
    slopes = [slope(results, s, rep) for s in args.settings for rep in range(args.repeats)]
    print("| allocator | keep_freed_memory | T | repeat | peak RSS growth | RSS after forward | saved input bytes |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in sorted(results, key=lambda r: (args.settings.index(r["setting"]), r["T"], r["rep"])):
        print(
            f"| {r['setting'].split('+')[0]} | {'yes' if r['keep_freed_memory'] else 'no'} | {r['T']} | "
            f"{r['rep']} | {r['peak_growth'] / 2**20:.2f} MiB | {r['after_forward'] / 2**20:.2f} MiB | "
            f"{r['saved_bytes'] / 2**20:.2f} MiB |"
        )
    print()
    summary = []
    for setting in args.settings:
        mine = [s for s in slopes if s["setting"] == setting]
        peak = median([s["peak_per_step"] for s in mine])
        fwd = median([s["forward_per_step"] for s in mine])
        inputs = mine[0]["inputs_per_step"]
        each = ", ".join(f"{s['ratio']:.3f}x" for s in mine)
        summary.append(
            dict(
                setting=setting,
                peak_per_step=peak,
                forward_per_step=fwd,
                ratio=peak / inputs,
                forward_ratio=fwd / inputs,
                ratios=[s["ratio"] for s in mine],
            )
        )
        print(
            f"{setting:>13}: peak RSS grows {peak / 1024:.1f} KiB/step = {peak / inputs:.3f}x the new "
            f"saved inputs ({inputs / 1024:.0f} KiB/step), T {args.T[0]}->{args.T[1]}"
            f"{f' (median of {len(mine)}: {each})' if len(mine) > 1 else ''}; "
            f"after the forward {fwd / 1024:.1f} KiB/step ({fwd / inputs:.3f}x)"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"loss": args.loss, "results": results, "slopes": slopes, "summary": summary}, fh, indent=1)
    return 0
