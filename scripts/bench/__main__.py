"""The benchmark runner: ``python -m scripts.bench WORKLOAD [options]`` (from the repository root).

Each workload is a module of this package with a ``main(argv)``; :data:`WORKLOADS` is the list,
``python -m scripts.bench`` prints it and ``python -m scripts.bench WORKLOAD --help`` a workload's
options. Shared pieces: :mod:`scripts.bench.common` (processes, memory meters, machine facts),
:mod:`scripts.bench.report` (formatting, the marked sections of docs/benchmarks.md).
"""

from __future__ import annotations

import importlib
import inspect
import sys

#: workload -> what it measures (the module ``scripts.bench.<workload>`` runs it)
WORKLOADS = {
    "memory": "peak memory and time of a rollout's backward against T: plain autograd, checkpointing, rl_replay",
    "ppo": "one recurrent PPO update, rl_replay against the plain-autograd recipe (--pixels: on pixels)",
    "overhead": "the engine's own cost per replay block, beyond the recompute",
    "cores": "the recurrent cores' call over k steps against their step loop",
    "torchrl": "a recurrent PPO update against TorchRL's fused recurrent modules",
    "sharded": "FSDP1 or FSDP2 over 2 ranks: memory and time per sharding strategy",
    "collect_sharded": "collection under FSDP: the parameters gathered once per rollout against per step",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in WORKLOADS:
        width = max(map(len, WORKLOADS))
        lines = [f"  {name:<{width}}  {what}" for name, what in WORKLOADS.items()]
        print("usage: python -m scripts.bench WORKLOAD [options]\n\nworkloads:\n" + "\n".join(lines))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(f"scripts.bench.{name}")
    sys.argv = [f"python -m scripts.bench {name}", *rest]  # what argparse names in --help and errors
    run = module.main
    return int(run(rest) if inspect.signature(run).parameters else run() or 0)


if __name__ == "__main__":
    sys.exit(main())
