"""Writing one checkpoint under FSDP1 on 2 gloo ranks: every rank its shard, or rank 0 the whole state.

The trainer of a config (default ``configs/fsdp_gtrxl_memory_1024.yaml``: 14.4M parameters) is built as
``scripts/train.py`` builds it, then writes one checkpoint with ``checkpoint.sharded=true`` (each rank its
rows of the weights and the Adam moments, at once; the moments are made by one Adam step on zero
gradients) or ``false`` (rank 0 gathers them, FSDP's
``FULL_STATE_DICT``, and writes ``checkpoint.pt`` alone), each setting in fresh processes. Printed per
rank: seconds of the write, growth of the process's peak RSS during it, and the bytes of the files it
wrote; then one line per setting.

Usage::

    python -m scripts.bench checkpoint_sharded
    python -m scripts.bench checkpoint_sharded --smoke       # the MLP config
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from scripts.bench.common import ROOT


def worker(spec: dict) -> None:
    """One rank: build the trainer, give the optimizer its moments (one Adam step on zero gradients),
    write one checkpoint, report seconds, peak RSS growth and bytes."""
    import torch
    import torch.distributed as dist

    from rl_replay.run.trainer_state import save_trainer
    from scripts.bench.common import MemoryMeter, quiet_trainer

    rank = int(os.environ.get("RANK", "0"))
    trainer = quiet_trainer(spec["config"], spec["run_dir"], f"checkpoint.sharded={spec['sharded']}")
    try:
        for p in trainer.model.parameters():
            p.grad = torch.zeros_like(p)
        trainer.optimizer.step()  # the state a checkpoint of a trained run holds
        trainer.optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        meter = MemoryMeter(torch.device("cpu"))
        meter.start()
        t0 = time.perf_counter()
        save_trainer(trainer.algorithm, trainer.progress, trainer.place)
        seconds = time.perf_counter() - t0
        growth = meter.peak_rss_growth()
    finally:
        trainer.close()
    mine = f"checkpoint.shard-{rank}-of-2.pt" if spec["sharded"] == "true" else None
    written = sum(
        os.path.getsize(os.path.join(spec["run_dir"], name))
        for name in os.listdir(spec["run_dir"])
        if name == mine or (rank == 0 and name in ("checkpoint.pt", "env_state.pkl"))
    )
    with open(f"{spec['out']}.rank{rank}.json", "w") as fh:
        json.dump({"seconds": seconds, "peak_growth": growth, "bytes": written}, fh)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalisation, where gloo's C++ teardown aborts now and then


def launch(config: str, sharded: str, out: str) -> list[dict]:
    run_dir = tempfile.mkdtemp(prefix="bench_ckpt_")
    spec = {"config": config, "sharded": sharded, "run_dir": os.path.join(run_dir, "run"), "out": out}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", __spec__.name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "BENCH_SPEC": json.dumps(spec)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"checkpoint.sharded={sharded} failed:\n{proc.stderr[-4000:]}")
    rows = []
    for rank in range(2):
        with open(f"{out}.rank{rank}.json") as fh:
            rows.append(json.load(fh))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "fsdp_gtrxl_memory_1024.yaml"))
    parser.add_argument("--smoke", action="store_true", help="the MLP config")
    args = parser.parse_args()
    config = os.path.join(ROOT, "configs", "fsdp_mlp_cpu.yaml") if args.smoke else args.config
    print(f"config: {os.path.relpath(config, ROOT)}, 2 gloo ranks, one checkpoint write per setting")
    print("| checkpoint.sharded | rank | seconds | peak RSS growth | bytes written by the rank |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for sharded in ("true", "false"):
            rows = launch(config, sharded, os.path.join(tmp, sharded))
            for rank, row in enumerate(rows):
                print(
                    f"| {sharded} | {rank} | {row['seconds']:.2f} s | {row['peak_growth'] / 2**20:.1f} MiB | "
                    f"{row['bytes']:,} |"
                )
            print(
                f"summary sharded={sharded}: slowest rank {max(r['seconds'] for r in rows):.2f} s, "
                f"largest peak RSS growth {max(r['peak_growth'] for r in rows) / 2**20:.1f} MiB"
            )


if __name__ == "__main__":
    if "BENCH_SPEC" in os.environ:
        worker(json.loads(os.environ["BENCH_SPEC"]))
    else:
        main()
