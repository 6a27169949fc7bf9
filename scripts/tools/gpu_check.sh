#!/usr/bin/env bash
# One-command validation on a single-GPU machine whose Python has torch (and maybe
# nothing else this project needs) and no network.
#
#   scripts/tools/gpu_check.sh --prepare-wheels DIR     # here, with a package index: fill DIR
#   scripts/tools/gpu_check.sh --wheels DIR [--out OUT] # there: install from DIR, run everything
#   scripts/tools/gpu_check.sh --dry-run [--wheels DIR] [--out OUT]   # any CPU machine (CI)
#
# Steps (each one's output goes to OUT/gpu_check.log; a summary to OUT/gpu_results.md,
# ready to paste into docs/benchmarks.md):
#   1. install the wheels in DIR that this Python lacks into a temporary site directory
#      (pip --no-index --no-deps --target; PYTHONPATH), then check the imports;
#   2. tests/engine/test_replay_cuda.py and tests/run/test_distributed_cuda.py (FSDP1 CPUOffload at
#      world size 1, gradients against plain autograd);
#   3. short FSDP1 + CPUOffload and FSDP2 + CPUOffloadPolicy training runs: scripts/train.py under
#      torchrun (distributed.fsdp_version 1 and 2);
#   4. scripts/bench/ppo.py --pixels --device cuda --epochs 1: the decisive pixel benchmark
#      (NatureCNN + GRU PPO update at T = 512, 2048, 8192, rl_replay against plain autograd);
#   4b. scripts/bench/torchrl.py --device cuda --T 4098: the recurrent PPO update with the
#      GRU / LSTM cores through cuDNN (rl_replay), their step loop (steps), plain autograd, and
#      TorchRL's fused path (its wheels from DIR/peers, in a site directory of their own);
#   5. scripts/bench/overhead.py --device cuda --all --block-steps 1 16: per-block overhead;
#   6. one update of configs/memory_4096.yaml on CUDA and on the CPU: env steps/s, optimisation time;
#   7. scripts/bench/memory.py --device cuda, GRU and deep MLP at T = 256 and 1024.
# --dry-run does all of it without CUDA: the tests are only collected, training runs on
# CPU (gloo, no offload) with a tiny budget, the benchmarks on CPU with tiny sizes.
# The step limits add up to about 9 minutes, so that one device call holds the whole run;
# the steps come in order of what they prove, so a run cut short keeps the most.
# OUT defaults to $OUT if set, else ./gpu_check_out. PYTHON defaults to python3.
# Exit status: 0 when every step passed, 1 otherwise (every step runs regardless).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
DRY=0
WHEELS=""
OUTDIR="${OUT:-$PWD/gpu_check_out}"

usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --prepare-wheels)
            [ $# -ge 2 ] || { echo "error: --prepare-wheels needs a directory" >&2; exit 2; }
            exec "$PY" "$ROOT/scripts/tools/gpu_wheels.py" prepare "$2" ;;
        --wheels) [ $# -ge 2 ] || { echo "error: --wheels needs a directory" >&2; exit 2; }
                  WHEELS="$2"; shift 2 ;;
        --out) [ $# -ge 2 ] || { echo "error: --out needs a directory" >&2; exit 2; }
               OUTDIR="$2"; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
    echo "error: wheel directory '$WHEELS' does not exist; create it with --prepare-wheels" >&2
    exit 2
fi
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
LOG="$OUTDIR/gpu_check.log"
RESULTS="$OUTDIR/gpu_results.md"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
: > "$LOG"
export WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"

FAILED=()
SUMMARY=()
step() {  # step NAME TIMEOUT_S CMD...: run, log, remember the outcome
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS
    echo "=== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" > >(tee -a "$LOG") 2>&1
    local rc=$?
    local line="$name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit} s"))") in $((SECONDS - t0)) s"
    echo "=== $line" | tee -a "$LOG"
    SUMMARY+=("$line")
    [ $rc -eq 0 ] || FAILED+=("$name")
    return $rc
}

# 1. dependencies --------------------------------------------------------------------
if [ -n "$WHEELS" ]; then
    step "install wheels" 300 "$PY" scripts/tools/gpu_wheels.py install "$WHEELS" "$WORK/site"
    export PYTHONPATH="$WORK/site:$PYTHONPATH"
else
    echo "=== install wheels: skipped (no --wheels DIR given)" | tee -a "$LOG"
    SUMMARY+=("install wheels: skipped (no --wheels DIR)")
fi
NEED_CUDA=$([ $DRY -eq 1 ] && echo 0 || echo 1)
step "imports" 120 "$PY" - "$NEED_CUDA" <<'EOF'
import importlib, sys
for name in ("torch", "tensordict", "gymnasium", "wandb", "yaml", "tqdm", "psutil", "numpy",
             "pytest", "hypothesis", "rl_replay"):
    module = importlib.import_module(name)
    print(f"{name} {getattr(module, '__version__', '?')} from {getattr(module, '__file__', '?')}")
import torch
print("cuda available:", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
if sys.argv[1] == "1" and not torch.cuda.is_available():
    sys.exit("error: no CUDA device; use --dry-run on a CPU machine")
EOF

# 2. CUDA tests --------------------------------------------------------------------------
TESTS=(tests/engine/test_replay_cuda.py tests/run/test_distributed_cuda.py)
if [ $DRY -eq 1 ]; then
    step "cuda tests (collected only)" 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}"
else
    step "cuda tests" 150 "$PY" -m pytest -q -p no:cacheprovider -rs "${TESTS[@]}"
fi
TEST_LINE="$(grep -E '^[0-9]+ (passed|failed|skipped|error)|[0-9]+ tests? collected| passed| failed' "$LOG" | tail -1)"

# 3. FSDP1 (+ CPUOffload on CUDA) training through scripts/train.py under torchrun --------
TRAIN=(-m torch.distributed.run --standalone --nproc_per_node=1 scripts/train.py
       --config configs/fsdp_mlp_cpu.yaml "run_dir=$WORK/train_run" log.wandb_mode=offline
       log.progress=false checkpoint.every=0)
if [ $DRY -eq 1 ]; then
    step "train (CPU, gloo)" 180 "$PY" "${TRAIN[@]}" device=cpu distributed.backend=gloo total_env_steps=256
    TRAIN_LINE="$(grep -E '^finished [0-9]+ updates' "$LOG" | tail -1)"
    BEFORE="$(grep -cE '^finished [0-9]+ updates' "$LOG")"
    step "train (CPU, gloo, FSDP2)" 180 "$PY" "${TRAIN[@]}" device=cpu distributed.backend=gloo total_env_steps=256 \
        distributed.fsdp_version=2 "run_dir=$WORK/train_run_fsdp2"
else
    step "train (CUDA, FSDP1 + CPUOffload)" 100 "$PY" "${TRAIN[@]}" device=cuda \
        distributed.backend=nccl distributed.cpu_offload=true total_env_steps=2048
    TRAIN_LINE="$(grep -E '^finished [0-9]+ updates' "$LOG" | tail -1)"
    BEFORE="$(grep -cE '^finished [0-9]+ updates' "$LOG")"
    step "train (CUDA, FSDP2 + CPUOffloadPolicy)" 100 "$PY" "${TRAIN[@]}" device=cuda \
        distributed.backend=nccl distributed.cpu_offload=true total_env_steps=2048 \
        distributed.fsdp_version=2 "run_dir=$WORK/train_run_fsdp2"
fi
TRAIN2_LINE=""  # only a line the FSDP2 run wrote
if [ "$(grep -cE '^finished [0-9]+ updates' "$LOG")" -gt "$BEFORE" ]; then
    TRAIN2_LINE="$(grep -E '^finished [0-9]+ updates' "$LOG" | tail -1)"
fi

# the results file: its head now, each benchmark appends its section -------------------------
{
    echo "# gpu_check results ($(date -u +%Y-%m-%dT%H:%MZ)$([ $DRY -eq 1 ] && echo ", DRY RUN on CPU"))"
    echo
    echo "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" status --porcelain -- rl_replay 2>/dev/null | grep -q . && echo ' + uncommitted engine changes')"
    echo
    echo "- CUDA tests: ${TEST_LINE:-no summary line}"
    echo "- training run: ${TRAIN_LINE:-no summary line}"
    echo "- FSDP2 training run: ${TRAIN2_LINE:-no summary line}"
    echo
} > "$RESULTS"
# 4. the pixel benchmark (one epoch: an update's peak memory is one minibatch's) -----------
export PIXELS_MD="$OUTDIR/bench_pixels.txt"
PIXELS=(bash -c 'set -o pipefail; "$0" -m scripts.bench ppo --pixels "$@" | tee "$PIXELS_MD"' "$PY")
if [ $DRY -eq 1 ]; then
    step "bench_ppo --pixels (CPU, smoke)" 180 "${PIXELS[@]}" --smoke
else
    step "bench_ppo --pixels (CUDA)" 150 "${PIXELS[@]}" --device cuda --T 512 2048 8192 --epochs 1 --timeout 60
fi
if [ -s "$PIXELS_MD" ]; then
    { echo; echo "Pixel PPO update (scripts/bench/ppo.py --pixels, $([ $DRY -eq 1 ] && echo "CPU, smoke" || echo "CUDA, --epochs 1")):"
      echo; echo '```'; cat "$PIXELS_MD"; echo '```'; } >> "$RESULTS"
fi
# 4b. the recurrent cores: cuDNN against the step loop and TorchRL's fused path -------------------
export CORES_MD="$OUTDIR/bench_torchrl.txt"
PEERS_PATH="$PYTHONPATH"
if [ -n "$WHEELS" ] && [ -d "$WHEELS/peers" ]; then
    step "install TorchRL wheels" 120 "$PY" scripts/tools/gpu_wheels.py install --all "$WHEELS/peers" "$WORK/peers"
    PEERS_PATH="$WORK/peers:$PYTHONPATH"
fi
CORES=(env "PYTHONPATH=$PEERS_PATH" bash -c 'set -o pipefail; "$0" -m scripts.bench torchrl "$@" | tee "$CORES_MD"' "$PY")
if [ $DRY -eq 1 ]; then
    step "bench_torchrl (CPU, smoke)" 120 "${CORES[@]}" --smoke --kinds lstm
else
    step "bench_torchrl (CUDA)" 120 "${CORES[@]}" --device cuda --T 4098 --block-steps 64 --repeats 1
fi
if [ -s "$CORES_MD" ]; then
    { echo; echo "Recurrent PPO update against TorchRL (scripts/bench/torchrl.py, $([ $DRY -eq 1 ] && echo "CPU, smoke" || echo "CUDA, T = 4098")):"
      echo; echo '```'; cat "$CORES_MD"; echo '```'; } >> "$RESULTS"
fi
# 5. per-block overhead of replay against plain autograd ------------------------------------
export OVERHEAD_MD="$OUTDIR/bench_overhead.md"
# bash -c so that timeout runs it; the table also goes to OVERHEAD_MD for the results file.
OVERHEAD=(bash -c 'set -o pipefail; "$0" -m scripts.bench overhead "$@" | tee "$OVERHEAD_MD"' "$PY")
if [ $DRY -eq 1 ]; then
    step "bench_overhead (CPU, tiny)" 120 "${OVERHEAD[@]}" --device cpu --T 8 --repeats 1 --block-steps 1 4
else
    step "bench_overhead (CUDA)" 90 "${OVERHEAD[@]}" --device cuda --all --block-steps 1 16 --repeats 3
fi
if [ -s "$OVERHEAD_MD" ]; then
    { echo; echo "Per-block overhead (scripts/bench/overhead.py, $([ $DRY -eq 1 ] && echo "CPU, tiny" || echo CUDA)):"
      echo; cat "$OVERHEAD_MD"; } >> "$RESULTS"
fi
# 5b. a shipped long-memory config's update on CUDA against the CPU (sequence blocks) -------
# One update of memory_4096 (32 episodes of 4098 steps, PPO with 16-step sequence blocks) on each
# device; its metrics give env steps/s and the optimisation time.
SPS_MD="$OUTDIR/memory_update.md"
if [ $DRY -eq 1 ]; then
    SPS_CONFIG=(--config configs/memory_256.yaml total_env_steps=2064); SPS_DEVICES=(cpu)
else
    SPS_CONFIG=(--config configs/memory_4096.yaml total_env_steps=131136); SPS_DEVICES=(cuda cpu)
fi
echo "| config | device | env steps/s | collect s | optimize s |" > "$SPS_MD"
echo "|---|---|---|---|---|" >> "$SPS_MD"
for dev in "${SPS_DEVICES[@]}"; do
    step "one update of ${SPS_CONFIG[1]} ($dev)" 240 "$PY" scripts/train.py "${SPS_CONFIG[@]}" device=$dev \
        "run_dir=$WORK/update_$dev" log.wandb_mode=disabled log.progress=false checkpoint.every=0
    "$PY" - "$WORK/update_$dev/metrics.jsonl" "${SPS_CONFIG[1]}" "$dev" >> "$SPS_MD" <<'PYEOF' || true
import json, sys
row = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(f"| {sys.argv[2]} | {sys.argv[3]} | {row['time/steps_per_sec']:.0f} | {row['time/collect_sec']:.1f} | {row['time/optimize_sec']:.1f} |")
PYEOF
done
{ echo; echo "One PPO update of a shipped config (scripts/train.py; sequence blocks):"; echo; cat "$SPS_MD"; } >> "$RESULTS"
# 6. memory benchmark (older table: GRU and deep MLP) -------------------------------------
BENCH=(-m scripts.bench memory --json "$OUTDIR/bench_memory.json" --write-docs "$RESULTS" --plot-dir "$OUTDIR")
if [ $DRY -eq 1 ]; then
    step "bench_memory (CPU, tiny)" 180 "$PY" "${BENCH[@]}" --device cpu --policy tiny_gru \
        --T 8 --methods plain rl_replay --reps 0
else
    step "bench_memory (CUDA)" 90 "$PY" "${BENCH[@]}" --device cuda --policy gru mlp --T 256 1024 \
        --reps 1 --max-config-seconds 30 --budget-seconds 75
fi
{
    echo
    echo "Steps:"
    for line in "${SUMMARY[@]}"; do echo "- $line"; done
} >> "$RESULTS"
echo "results: $RESULTS; log: $LOG"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
echo "all steps passed"
