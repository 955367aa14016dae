#!/usr/bin/env bash
# The accelerator benchmark suite of hyper-parallel, in one go (its length on one H200 is an estimate
# until it is run there whole; capped at under 14 minutes by per-stage timeouts):
#
#   0. gpu_streams: tests/test_gpu_streams.py, the stream ordering on real CUDA streams (delayed
#      copies, PyTorch's stream sanitizer, the four backend primitives mutated); skipped, with its
#      reason, where torch sees no CUDA device
#   1. compare_peers: copy-engine probe + every variant (ours and the peers) on a GPT sized for a
#      ~140 GB device (dim 2048, 16 heads, 16 layers, seq 2048, batch 2, bf16): peak memory, step
#      time, bytes moved, loss equality, achieved bandwidth, overlap fraction, targets; one Chrome
#      trace per variant
#   2. scaling curves: --sweep layers (4 -> 32) and --sweep seq (512 -> 4096)
#   3. python -m hyper_parallel.bench --trace (when that flag exists): one trace per mode
#   4. planner: benchmarks/planner.py, the memory planner at 8 budgets per model beside every fixed
#      recipe and PyTorch's sac_ilp (with the copy window in play: swap can be free here)
#
# Usage:  bash benchmarks/gpu_suite.sh            (results in $OUT when set, else ./results/gpu)
# Env:    PYTHON=python3      interpreter with a CUDA/NPU/XPU build of torch (default: python3)
#         SUITE_QUICK=1       small sizes, to check the script itself on an accelerator in ~1 min
#                             (SUITE_QUICK=tiny: the smoke test's sizes, seconds; no stage time
#                             limits, so a busy machine makes it slow, never fail)
#         SUITE_ALLOW_CPU=1   run on CPU when no accelerator is present (to test the script only)
# Exit:   0 all stages passed; 3 no accelerator (before anything runs); 1 a stage failed or timed
#         out (the others still ran; see summary.txt).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/results/gpu}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- fail fast without an accelerator
# One interpreter start: line 1 is the device type, the rest goes to env.txt.
if ! PROBE="$("$PYTHON" - <<'EOF'
import os, platform, sys
try:
    import torch
except Exception as exc:
    print(f"cannot import torch with this interpreter: {exc}", file=sys.stderr)
    sys.exit(3)
acc = getattr(torch, "accelerator", None)
have = acc is not None and acc.is_available()
if not have and os.environ.get("SUITE_ALLOW_CPU") != "1":
    print(f"no accelerator visible to torch {torch.__version__} "
          f"(CUDA build: {torch.version.cuda}); this suite needs a GPU/NPU", file=sys.stderr)
    sys.exit(3)
print(acc.current_accelerator().type if have else "cpu")
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
if have:
    dm = torch.get_device_module(acc.current_accelerator().type)
    p = dm.get_device_properties(0)
    print("device:", dm.get_device_name(0), "|", round(p.total_memory / 2**30, 1), "GiB")
else:
    print("device: cpu (SUITE_ALLOW_CPU=1: a test of the script, not a measurement)")
for mod in ("torchtune", "torchao", "matplotlib"):
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(mod, "not usable:", type(exc).__name__)
EOF
)"; then
    echo "gpu_suite: FAILED FAST: no accelerator present (interpreter: $PYTHON). Run it on a machine" \
         "with a GPU, or set PYTHON to an interpreter whose torch sees one." >&2
    exit 3
fi
DEVICE="$(head -n 1 <<< "$PROBE")"

mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
START=$(date +%s)
FAILED=0

DTYPE=bfloat16
[[ "$DEVICE" == "cpu" ]] && DTYPE=float32  # SUITE_ALLOW_CPU test runs: bf16 matmuls are slow on CPU
if [[ "${SUITE_QUICK:-0}" == "tiny" ]]; then  # the smoke test's size: seconds, even on CPU
    BIG=(--dim 32 --heads 2 --layers 3 --seq 16 --batch 2 --dtype "$DTYPE" --rounds 1 --warmup 0 --probe-mib 8)
    SWEEP_L=(--dim 32 --heads 2 --seq 16 --batch 2 --dtype "$DTYPE" --rounds 1 --warmup 0 --values 2,3 --variants none,torch_ckpt,ours_ckpt_swap)
    SWEEP_S=(--dim 32 --heads 2 --layers 2 --batch 2 --dtype "$DTYPE" --rounds 1 --warmup 0 --values 8,16 --variants none,torch_ckpt,ours_ckpt_swap)
    BENCH=(--layers 2 --dim 32 --heads 2 --seq 16 --batch 2 --steps 2 --threads 1)  # (losses compared bitwise across processes)
    PLAN=(--models gpt --budgets 2 --rounds 1 --gpt-layers 2 --gpt-dim 32 --seq 16 --batch 2 --no-sac-ilp --no-deep)
    T_GPU=0; T_CMP=0; T_SWEEP=0; T_BENCH=0; T_PLAN=0  # 0: no time limit (a test checks what ran, not how fast)
elif [[ "${SUITE_QUICK:-0}" == "1" ]]; then
    BIG=(--dim 256 --heads 4 --layers 4 --seq 256 --batch 2 --dtype "$DTYPE" --rounds 3 --probe-mib 64)
    SWEEP_L=(--dim 256 --heads 4 --seq 256 --batch 1 --dtype "$DTYPE" --values 2,4,8)
    SWEEP_S=(--dim 256 --heads 4 --layers 4 --batch 1 --dtype "$DTYPE" --values 128,256,512)
    BENCH=()
    PLAN=(--models gpt --budgets 3 --rounds 3 --seq 512 --gpt-dim 256)
    T_GPU=240; T_CMP=120; T_SWEEP=90; T_BENCH=60; T_PLAN=90
else
    BIG=(--dim 2048 --heads 16 --layers 16 --seq 2048 --batch 2 --dtype "$DTYPE" --rounds 9)
    SWEEP_L=(--dim 2048 --heads 16 --seq 2048 --batch 1 --dtype "$DTYPE" --values 4,8,16,32)
    SWEEP_S=(--dim 2048 --heads 16 --layers 8 --batch 1 --dtype "$DTYPE" --values 512,1024,2048,4096)
    BENCH=()
    PLAN=(--models gpt,postln,llama --batch 4 --seq 1024 --gpt-dim 1024 --postln-dim 1024 --hf-dim 1024)
    T_GPU=240; T_CMP=170; T_SWEEP=90; T_BENCH=35; T_PLAN=150  # 775 s of stage limits + start-up: < 14 min
fi

stage() {  # stage NAME TIMEOUT_S CMD...   (TIMEOUT_S 0: no limit)
    local name="$1" limit="$2"; shift 2
    local t0=$(date +%s)
    echo "=== [$name] $*" | tee -a "$SUMMARY"
    if [[ "$limit" == 0 ]]; then
        "$@" > "$OUT_DIR/$name.log" 2>&1
    else
        timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    fi
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    grep -v '^USDT:' "$OUT_DIR/$name.log" | tail -n 60
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "--- [$name] TIMED OUT after ${dt}s (limit ${limit}s)" | tee -a "$SUMMARY"; FAILED=1
    elif [[ $rc -ne 0 ]]; then
        echo "--- [$name] FAILED with exit $rc after ${dt}s; log: $OUT_DIR/$name.log" | tee -a "$SUMMARY"; FAILED=1
    else
        echo "--- [$name] ok in ${dt}s" | tee -a "$SUMMARY"
    fi
}

# ---------------------------------------------------------------- environment
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    tail -n +2 <<< "$PROBE"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
} > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

# ---------------------------------------------------------------- stages
# First the stream-ordering tests: a schedule that races on this device makes every number below moot.
stage gpu_streams "$T_GPU" "$PYTHON" -m pytest tests/test_gpu_streams.py -q -rs -p no:cacheprovider

stage compare "$T_CMP" "$PYTHON" benchmarks/compare_peers.py --device "$DEVICE" "${BIG[@]}" \
    --json "$OUT_DIR/compare.json" --png "$OUT_DIR/compare.png" --trace "$OUT_DIR/traces" --trace-gz

stage sweep_layers "$T_SWEEP" "$PYTHON" benchmarks/compare_peers.py --device "$DEVICE" --sweep layers \
    "${SWEEP_L[@]}" --json "$OUT_DIR/sweep_layers.json" --png "$OUT_DIR/sweep_layers.png"

stage sweep_seq "$T_SWEEP" "$PYTHON" benchmarks/compare_peers.py --device "$DEVICE" --sweep seq \
    "${SWEEP_S[@]}" --json "$OUT_DIR/sweep_seq.json" --png "$OUT_DIR/sweep_seq.png"

if grep -q -- '"--trace"' "$ROOT/hyper_parallel/bench/__main__.py"; then
    stage bench_trace "$T_BENCH" "$PYTHON" -m hyper_parallel.bench --device "$DEVICE" --dtype "$DTYPE" \
        --modes none,recompute,save,swap ${BENCH[@]+"${BENCH[@]}"} --no-progress --trace "$OUT_DIR/bench_traces" \
        --json "$OUT_DIR/bench.json"
else
    echo "=== [bench_trace] skipped: python -m hyper_parallel.bench has no --trace flag in this checkout" \
        | tee -a "$SUMMARY"
fi

# (planner.py refuses --plot without matplotlib, before it runs anything: ask for the chart only where it can be drawn)
PLAN_PLOT=()
"$PYTHON" -c "import matplotlib" > /dev/null 2>&1 && PLAN_PLOT=(--plot "$OUT_DIR/planner.png")
stage planner "$T_PLAN" "$PYTHON" benchmarks/planner.py --device "$DEVICE" "${PLAN[@]}" \
    --json "$OUT_DIR/planner.json" ${PLAN_PLOT[@]+"${PLAN_PLOT[@]}"}

echo "total $(( $(date +%s) - START ))s; results in $OUT_DIR" | tee -a "$SUMMARY"
exit $FAILED
