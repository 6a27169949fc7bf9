"""Helpers shared by the benchmark scripts in ``scripts/`` (not part of the library).

* :class:`LiveTensorCensus` -- exact bytes of tensors kept alive by a rollout forward.
* :class:`MemoryMeter` -- peak RSS growth (Linux ``VmHWM`` reset through
  ``/proc/self/clear_refs``; ``ru_maxrss`` fallback) or CUDA ``max_memory_allocated``.
* :func:`run_isolated` -- run one benchmark configuration in a fresh process: either a
  ``forkserver`` child (torch & co. imported once by the server, every configuration a
  new forked process) or ``python script --worker SPEC`` printing one JSON line.
* grad comparison, machine description.

Formatting and writing results into the docs: ``report.py``.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

GLIBC_NOTE = (
    "note: glibc keeps freed heap pages (malloc arenas / trim thresholds), so peak RSS "
    "growth overstates the memory a method really needs; the live-bytes figure (exact "
    "bytes of tensors alive at the end of the rollout forward) is the one to compare."
)

WORKER_PREFIX = "BENCH_RESULT "


# ----------------------------------------------------------------------------- statistics
def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- threads
def quiet_trainer(config: str, run_dir: str, *overrides: str):
    """The trainer of ``config`` built as ``scripts/train.py`` builds it, writing no logs, wandb or
    checkpoints of its own (a bench measures one part of it)."""
    from rl_replay.config import load_config
    from rl_replay.run.setup import build

    quiet = [f"run_dir={run_dir}", "log.wandb_mode=disabled", "log.progress=false", "checkpoint.every=0"]
    return build(load_config(config, [*quiet, *overrides]))


def set_threads(n: int) -> None:
    torch.set_num_threads(max(1, int(n)))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


# ----------------------------------------------------------------------------- machine
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _run(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
    except Exception:  # pragma: no cover - the tool is missing
        return ""


def load_line() -> str:
    a, b, c = os.getloadavg()
    return f"load average now {a:.1f}/{b:.1f}/{c:.1f} (1/5/15 min, {os.cpu_count()} CPUs)"


def describe_machine() -> str:
    """The machine (CPU, memory, GPU, versions, load) and the commit benchmarked, with whether the
    library's files differ from it: two lines for a bench's output."""
    import psutil

    cpu = re.search(r"Model name:\s*(.+)", _run("lscpu"))
    gpu = f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no CUDA"
    a, b, c = os.getloadavg()
    head = _run("git", "rev-parse", "--short", "HEAD").strip() or "?"
    dirty = [line[3:] for line in _run("git", "status", "--porcelain", "--", "rl_replay").splitlines() if line.strip()]
    return (
        f"machine: {cpu.group(1).strip() if cpu else platform.processor()} ({os.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM), {gpu}, torch {torch.__version__}, "
        f"python {platform.python_version()}, load average {a:.1f}/{b:.1f}/{c:.1f}\n"
        f"source: rl_replay at {head}" + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else " (clean)")
    )


# ----------------------------------------------------------------------------- memory
def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", fh.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:  # pragma: no cover - not Linux
        return None


def current_rss() -> int:
    kib = _proc_status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil  # pragma: no cover

    return psutil.Process().memory_info().rss  # pragma: no cover


class MemoryMeter:
    """Peak memory growth of one measured region.

    CPU: ``VmHWM`` (the kernel's peak-RSS counter) is reset with ``/proc/self/clear_refs``
    at :meth:`start`, so the peak is this region's own; where that is not possible the
    process-lifetime ``ru_maxrss`` is used (still a valid upper bound in a fresh process).
    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = "?"

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_cuda = torch.cuda.memory_allocated(self.device)
        self.base_rss = current_rss()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            self.method = "VmHWM"
        except OSError:
            self.method = "ru_maxrss"

    def peak_rss_growth(self) -> int:
        if self.method == "VmHWM":
            peak = (_proc_status_kib("VmHWM") or 0) * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, peak - self.base_rss)

    def peak_cuda_growth(self) -> int | None:
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base_cuda


def _storage_key(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()
    except Exception:  # sparse / meta / undefined tensors
        return None, 0


def _python_visible_tensors() -> Iterable[torch.Tensor]:
    tensor_type = torch.Tensor
    for obj in gc.get_objects():
        # issubclass(type(...)) rather than isinstance: isinstance reads __class__, which
        # wakes up deprecated lazy objects (FutureWarning) and dead weak proxies.
        if issubclass(type(obj), tensor_type):
            yield obj


class LiveTensorCensus:
    """Exact bytes of tensor storage a rollout forward keeps alive until backward.

    Method (documented in docs/benchmarks.md):

    1. :meth:`snapshot_before` records every storage alive before the rollout (the
       parameters, buffers and anything else reachable from Python).
    2. During the forward, :meth:`hooks` (a ``saved_tensors_hooks`` pair) records every
       tensor autograd saves for backward, keeping only a weak reference. Hooks nest: a
       region that installs its own hooks (``checkpoint``'s recompute holders, replay's
       and method 3's ``save_on_cpu``) replaces ours for the tensors saved inside it;
       those hooks return Python objects, which step 3 finds. :meth:`offload_hooks` is
       ``save_on_cpu`` with the recording added, for method 3.
    3. :meth:`live_bytes` at the end of the forward: the union of the still-alive saved
       tensors and every tensor reachable from Python (``gc.get_objects()``: the block
       inputs a replay block or a checkpoint frame holds, per-block RNG state snapshots,
       the outputs kept for the loss), deduplicated by storage, minus the storages that
       existed before. Each storage counts once, with its full ``nbytes``.
    """

    def __init__(self) -> None:
        self._before: set = set()
        self._saved: dict[int, tuple[weakref.ref, Any, int]] = {}
        self.saved_calls = 0

    def snapshot_before(self, extra: Iterable[torch.Tensor] = ()) -> None:
        gc.collect()
        keys = set()
        for t in list(_python_visible_tensors()) + list(extra):
            k, _ = _storage_key(t)
            if k is not None:
                keys.add(k)
        self._before = keys

    def _record(self, t: Any) -> None:
        if isinstance(t, tuple):  # save_on_cpu packs (device, host tensor)
            for x in t:
                self._record(x)
            return
        if not isinstance(t, torch.Tensor):
            return
        self.saved_calls += 1
        k, nbytes = _storage_key(t)
        if k is None or k in self._before:
            return
        try:
            self._saved[id(t)] = (weakref.ref(t), k, nbytes)
        except TypeError:  # pragma: no cover - tensor subclass without weakref support
            pass

    def hooks(self):
        def pack(t):
            self._record(t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def offload_hooks(self, pin_memory: bool):
        inner = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)
        pack_inner, unpack_inner = inner.pack_hook, inner.unpack_hook

        def pack(t):
            packed = pack_inner(t)
            self._record(packed)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack_inner)

    def live_bytes(self, extra: Iterable[torch.Tensor] = (), slab_used: dict[int, int] | None = None) -> dict[str, int]:
        """``{device_type: bytes}`` of storages alive now that were not alive before.

        ``extra``: tensors only C++ holds (e.g. ``p.grad``) to include as well.
        ``slab_used``: ``{data_ptr: bytes}`` of rl_replay's slab chunks
        (``GradientAccumulator.slabs.used_bytes()``): a chunk counts with the bytes
        handed out, not its reserved size (its untouched tail is not memory in use).
        """
        gc.collect()
        seen: dict = {}
        for t in extra:
            k, nbytes = _storage_key(t)
            if k is not None and k not in self._before:
                seen[k] = nbytes
        for ref, k, nbytes in self._saved.values():
            if ref() is not None:
                seen[k] = nbytes
        for t in _python_visible_tensors():
            k, nbytes = _storage_key(t)
            if k is not None and k not in self._before:
                seen[k] = nbytes
        for key in seen:
            if slab_used and key[2] in slab_used:
                seen[key] = slab_used[key[2]]
        out: dict[str, int] = {}
        for (device_type, _, _), nbytes in seen.items():
            out[device_type] = out.get(device_type, 0) + nbytes
        return out


# ----------------------------------------------------------------------------- gradients
def grad_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().cpu().clone()) for n, p in model.named_parameters()}


def grad_diff(got: dict, ref: dict) -> tuple[float, float]:
    """(worst |got - ref|, worst |got - ref| / max|ref| per tensor) over all parameters.

    The relative figure is normwise per tensor (max-norm of the difference over the
    max-norm of the reference), which does not blow up on entries that are ~0.
    """
    if got.keys() != ref.keys():
        raise AssertionError(f"different parameter sets: {sorted(got)} vs {sorted(ref)}")
    worst_abs = worst_rel = 0.0
    for name, r in ref.items():
        g = got[name]
        if (g is None) != (r is None):
            return float("inf"), float("inf")
        if r is None:
            continue
        d = (g.double() - r.double()).abs().max().item() if r.numel() else 0.0
        scale = r.double().abs().max().item() if r.numel() else 0.0
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / scale if scale > 0 else (0.0 if d == 0 else float("inf")))
    return worst_abs, worst_rel


# ----------------------------------------------------------------------------- processes
def _child_main(fn: Callable[[dict], dict], spec: dict, conn) -> None:  # pragma: no cover
    try:
        result = fn(spec)
    except BaseException as exc:  # report, never hang the parent
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    conn.send(result)
    conn.close()


_FORKSERVER_READY = False


def _forkserver_context(preload: list[str]):
    global _FORKSERVER_READY
    ctx = mp.get_context("forkserver")
    if not _FORKSERVER_READY:
        ctx.set_forkserver_preload(preload)
        _FORKSERVER_READY = True
    return ctx


def run_isolated(
    fn: Callable[[dict], dict],
    spec: dict,
    *,
    script: str,
    launcher: str,
    timeout: float,
    preload: list[str] | None = None,
) -> dict:
    """Run ``fn(spec)`` in a fresh process and return its result dict.

    ``launcher="forkserver"``: a child forked from a server process that imported the
    heavy modules once (fresh address space per configuration, no re-import cost).
    ``launcher="subprocess"``: ``python -m script --worker JSON`` (``script``: the module's name,
    run from the repository root) which prints one line
    ``BENCH_RESULT {json}``. A crash, a kill (e.g. out of memory) or a timeout comes
    back as ``{"error": ...}``.
    """
    start = time.perf_counter()
    if launcher == "subprocess":
        cmd = [sys.executable, "-m", script, "--worker", json.dumps(spec)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        for line in proc.stdout.splitlines():
            if line.startswith(WORKER_PREFIX):
                result = json.loads(line[len(WORKER_PREFIX) :])
                result["process_s"] = time.perf_counter() - start
                return result
        return {"error": f"worker exited {proc.returncode} without a result", "traceback": proc.stderr[-4000:]}
    ctx = _forkserver_context(preload or ["torch"])
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(fn, spec, child))
    proc.start()
    child.close()
    result = None
    if parent.poll(timeout):
        try:
            result = parent.recv()
        except EOFError:
            result = None
    if result is None:
        if proc.is_alive():
            proc.kill()
            result = {"error": f"timed out after {timeout:.0f} s"}
        else:
            proc.join()
            result = {
                "error": f"worker died with exit code {proc.exitcode}"
                + (" (killed: out of memory?)" if proc.exitcode == -9 else "")
            }
    proc.join(timeout=30)
    if proc.is_alive():  # pragma: no cover
        proc.kill()
    result["process_s"] = time.perf_counter() - start
    return result


def launch_ranks(module: str, spec: dict, nproc: int, timeout: float, env: dict | None = None) -> list[dict] | str:
    """Run ``python -m module --worker SPEC`` on ``nproc`` ranks (``torch.distributed.run``; one plain
    process when ``nproc`` is 1), each rank ending with :func:`rank_result`; returns the ranks' result
    dicts in rank order, or a string saying why there are not ``nproc`` of them."""
    args = ["-m", module, "--worker", json.dumps(spec)]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})}
    try:
        proc = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    rows = []
    for rank in range(nproc):
        path = f"{spec['out']}.rank{rank}.json"
        if os.path.exists(path):
            with open(path) as fh:
                rows.append(json.load(fh))
    if proc.returncode != 0 or len(rows) != nproc:
        return f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return rows


def rank_result(spec: dict, result: dict) -> None:
    """A rank's last act under :func:`launch_ranks`: write ``result`` to its own file (the ranks share
    stdout), leave the process group together, and exit without interpreter finalisation, where gloo's
    C++ teardown aborts now and then (as rl_replay's own CLI does)."""
    import torch.distributed as dist

    with open(f"{spec['out']}.rank{int(os.environ.get('RANK', '0'))}.json", "w") as fh:
        json.dump(result, fh)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_cli(fn: Callable[[dict], dict], argv_spec: str) -> int:
    """``--worker SPEC`` mode: run one configuration, print ``BENCH_RESULT {json}``."""
    spec = json.loads(argv_spec)
    try:
        result = fn(spec)
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    print(WORKER_PREFIX + json.dumps(result), flush=True)
    return 0 if "error" not in result else 1
