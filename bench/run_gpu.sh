#!/usr/bin/env bash
# One GPU call: correctness checks, per-kernel bench, end-to-end speed, loss-curve comparison.
# Each part runs in its own process with a time limit, so one failure does not stop the rest;
# the tables come last. Usage: bash bench/run_gpu.sh [parts...]   (default: all)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-bench-out}; export OUT; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
parts=${*:-"checks kernels speed loss"}
for p in $parts; do
  case $p in
    checks)  timeout 120 python bench/gpu_checks.py 2>&1 | tee -a "$OUT/log.txt" | tail -n 30 ;;
    kernels) timeout 150 python bench/kernels.py 2>&1 | tee -a "$OUT/log.txt" | tail -n 10 ;;
    speed)   timeout 420 python bench/speed.py --policies recompute none ${SPEED_POLICIES:-} 2>&1 | tee -a "$OUT/log.txt" | tail -n 10 ;;
    loss)    timeout 300 python bench/loss_curve.py ${LOSS_ARGS:-} 2>&1 | tee -a "$OUT/log.txt" | tail -n 6 ;;
  esac
done
python bench/report.py "$OUT"
