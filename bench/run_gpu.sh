#!/usr/bin/env bash
# One GPU call: correctness checks, per-kernel bench, end-to-end speed (issue 3's table: each
# shape at the memory budget, plus the fixed policies), the 8B step's memory peak,
# loss-curve comparison.
# Each part runs in its own process with a time limit, so one failure does not stop the rest;
# the tables come last. Usage: bash bench/run_gpu.sh [parts...]   (default: all)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-bench-out}; export OUT; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
parts=${*:-"checks kernels speed memory loss"}
for p in $parts; do
  case $p in
    checks)  timeout 120 python bench/gpu_checks.py 2>&1 | tee -a "$OUT/log.txt" | tail -n 30 ;;
    kernels) timeout 150 python bench/kernels.py 2>&1 | tee -a "$OUT/log.txt" | tail -n 10 ;;
    speed)   timeout 150 python bench/speed.py --shape llama-3.2-1b --policies recompute offload auto@4 none ${SPEED_POLICIES:-} 2>&1 | tee -a "$OUT/log.txt" | tail -n 6
             timeout 270 python bench/speed.py --shape llama-3.1-8b --policies recompute offload auto@17 none ${SPEED_POLICIES:-} 2>&1 | tee -a "$OUT/log.txt" | tail -n 6 ;;
    memory)  timeout 120 python bench/memory_peak.py --shape llama-3.1-8b --policies auto@17 2>&1 | tee -a "$OUT/log.txt" | tail -n 20 ;;
    loss)    timeout 300 python bench/loss_curve.py ${LOSS_ARGS:-} 2>&1 | tee -a "$OUT/log.txt" | tail -n 6 ;;
  esac
done
python bench/report.py "$OUT"
