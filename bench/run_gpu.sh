#!/usr/bin/env bash
# One GPU call: correctness checks, per-kernel bench, end-to-end speed against transformers +
# PEFT in the same process (issue 10's table: each shape at its memory budget), the 8B step's
# memory peak, loss curves against transformers + PEFT.
# Each part runs in its own process with a time limit, so one failure does not stop the rest;
# the tables come last. Usage: bash bench/run_gpu.sh [parts...]   (default: checks speed loss)
#   parts: checks kernels speed speed-llama speed-qwen3 memory loss loss-fp32
#          speed-gemma speed-phi4 (issue 22's Gemma-3-4B text and Phi-4 shapes)
#          moe (MoE checks, routing, end to end vs transformers + PEFT), moe-budget,
#          qlora (8B with the bitsandbytes baseline: carry its wheel), dist (torchrun, 1 GPU)
#          preference (issue 20's DPO step at the 8B shape, reference each step and precomputed,
#          vs TRL DPOTrainer + PEFT: carry trl/datasets wheels), logprobs (kernels.token_logprobs
#          vs full logits), speed-8b (the 8B SFT step alone)
#          grpo (issue 21's GRPO step, generation + training, Llama-3.2-1B vs TRL's generate +
#          loss; Qwen3-0.6B and Llama-3.1-8B leantune alone: carry the trl wheel for TRL)
#          (grpo-1b / grpo-more: its first part / the other two)
#          fp8 (issue 23: FP8 GEMMs vs bf16 at the 8B projections; the 8B step bf16 vs --precision
#          fp8; 100 steps' loss fp8 vs bf16 beside the bf16 noise floor; batch-1 decoding)
#          (fp8-step: the GEMMs and steps; fp8-more: the loss and decoding)
#          fp8-ratio (the 8B step bf16@17 against fp8@12, the input gradients' codes written by
#          their kernels on and off; and those kernels against the passes they replace)
#          fp8-fq (the FP8 activation quantisation fused into the norms / GLU: those kernels
#          with and without it, and the 8B fp8 steps with LEANTUNE_FP8_FUSED_QUANT on and off)
#          softcap (Gemma 2's soft-capped attention: Triton kernels vs the PyTorch query blocks)
#          stream (streamed base weights: bit-identical on/off, the copies' cost; the 8B and
#          Phi-4 steps at their budgets with --stream-weights and without) (stream-phi4: Phi-4;
#          stream-dpo: issue 20's DPO step with LEANTUNE_STREAM_WEIGHTS=1 and 0; stream-a: the
#          1B check, the host link both ways at once, Phi-4; stream-prof: profiles streamed)
#          stream-c (streaming with the duplex link model: 1B check, 8B, DPO, Phi-4)
#          split (shared-prompt attention: one flash call over gathered keys against cuDNN on
#          the attention split into plain calls, bench/gpu_shared_attention.py)
#          phi4-sweep (issue 22: Phi-4 at 31 GiB streamed, the planner's choice and capped at 12
#          and 8 layers (EngineOptions.stream_max_layers), and unstreamed; against transformers +
#          PEFT where the card is an H200)
#          prefetch2 (EngineOptions.prefetch_depth 2 against 1: Phi-4 at 31 GiB streamed and
#          not, against transformers + PEFT where the card is an H200; the DPO step)
#          phi4 (issue 22: Phi-4 at 31 GiB with --stream-weights and without, the defaults,
#          against transformers + PEFT where the card is an H200)
#          phi4-fill (Phi-4 streamed with fill-ahead on and off, and transformers + PEFT, in one
#          process)
#          fill-ahead (Phi-4 at 31 GiB streamed with EngineOptions.stream_fill_ahead on and off)
#          phi4-prof (issue 22: the Phi-4 step profiled, streamed, at 31 GiB)
#          micro (GEMM variants; the DPO and 8B SFT steps with EngineOptions.gemm_residual and
#          LEANTUNE_LOGP_GRAD_IN_FORWARD each way)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-bench-out}; export OUT; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
parts=${*:-"checks speed loss"}
speed() {  # shape, time limit, policies...
  local shape=$1 limit=$2; shift 2
  timeout "$limit" python bench/speed.py --shape "$shape" --policies "$@" ${SPEED_POLICIES:-} 2>&1 \
    | tee -a "$OUT/log.txt" | grep -E "^(\{|$shape)" | tail -n 8
}
for p in $parts; do
  case $p in
    checks)  timeout 150 python bench/gpu_checks.py 2>&1 | tee -a "$OUT/log.txt" | tail -n 40 ;;
    kernels) timeout 150 python bench/kernel_speed.py 2>&1 | tee -a "$OUT/log.txt" | tail -n 10 ;;
    speed|speed-qwen3)
             speed qwen3-0.6b 150 auto@1.9 recompute keep
             speed qwen3-14b 240 auto@31 ;;&
    speed|speed-llama)
             speed llama-3.2-1b 120 auto@4
             speed llama-3.1-8b 150 auto@17 ;;
    speed-8b) speed llama-3.1-8b 150 auto@17 ;;
    speed-gemma) speed gemma-3-4b 200 auto@10 recompute ;;  # issue 22: <= 10 GiB, >= 2.2x
    speed-phi4)  speed phi-4 240 auto@31 ;;                 # issue 22: <= 31 GiB, >= 2.2x
    preference) timeout 330 python bench/gpu_preference.py --precompute-reference 2>&1 \
               | tee -a "$OUT/log.txt" | grep -v "^{" | grep -v -i warn | tail -n 12 ;;
    logprobs) timeout 150 python bench/gpu_token_logprobs.py 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 14 ;;
    grpo|grpo-1b)
             timeout ${GRPO_1B_LIMIT:-240} python bench/gpu_grpo.py 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | grep -v -i warn | tail -n 6 ;;&
    grpo-budget)  # issue 21: the real Trainer's GRPO run under --max-memory-gib (peak vs budget)
             timeout 150 python bench/gpu_grpo_budget.py --shape llama-3.2-1b --budget 4.4 2>&1 \
               | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 2
             timeout 150 python bench/gpu_grpo_budget.py --shape qwen3-0.6b --budget 4.4 2>&1 \
               | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 2 ;;
    grpo|grpo-more)
             timeout 150 python bench/gpu_grpo.py --shape qwen3-0.6b --no-baseline 2>&1 \
               | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 3
             timeout 200 python bench/gpu_grpo.py --shape llama-3.1-8b --prompts 4 \
               --policy ${GRPO_8B_POLICY:-auto@24} --no-baseline 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 3 ;;
    memory)  timeout 150 python bench/memory_peak.py --shape ${MEMORY_SHAPE:-llama-3.1-8b} \
               --policies ${MEMORY_POLICIES:-auto@17} 2>&1 | tee -a "$OUT/log.txt" | tail -n 20 ;;
    loss)    timeout 420 python bench/loss_curve.py --shape ${LOSS_SHAPES:-llama-3.2-1b qwen3-0.6b llama-3.1-8b} \
               --noise-floor ${LOSS_ARGS:-} 2>&1 | tee -a "$OUT/log.txt" | grep -E "^\{" | cut -c1-300 ;;
    loss-fp32) timeout 240 python bench/loss_curve.py --shape ${LOSS_FP32_SHAPES:-llama-3.2-1b} \
               --dtype float32 --steps 30 --lr 1e-3 2>&1 | tee -a "$OUT/log.txt" | grep -E "^\{" | cut -c1-300 ;;
    moe)     timeout 100 python bench/gpu_checks.py --moe 2>&1 | tee -a "$OUT/log.txt" | tail -n 16
             timeout 420 python bench/moe_speed.py --parts routing e2e --experts-row \
               --shapes qwen3-30b-a3b gpt-oss-20b mixtral-8x7b-8l --policy auto auto+nofused \
               --stop-after 360 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 40 ;;
    moe-budget) timeout 200 python bench/moe_speed.py --parts e2e --no-baseline \
               --shapes qwen3-30b-a3b --policy auto@72 auto@66 auto@60 2>&1 \
               | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 6 ;;
    qlora)   timeout 400 python bench/qlora_speed.py --shape llama-3.1-8b 2>&1 \
               | tee -a "$OUT/log.txt" | grep -E "^\{" | cut -c1-300
             timeout 170 python bench/qlora_speed.py --shape llama-3.1-70b --steps 3 --warmup 1 \
               2>&1 | tee -a "$OUT/log.txt" | grep -E "^\{" | cut -c1-300 ;;
    fp8|fp8-step)
             timeout ${FP8_LIMIT:-420} python bench/gpu_fp8.py ${FP8_ARGS:-} 2>&1 \
               | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 26 ;;&
    fp8|fp8-more)
             timeout 300 python bench/gpu_fp8.py --parts loss 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 3
             timeout 240 python bench/gpu_fp8.py --parts decode 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 3 ;;
    fp8-fq)  timeout ${FP8_LIMIT:-540} python bench/gpu_fp8.py --parts quant step --bf16 \
               --fp8 auto@12 auto@17 --fused-quant on off 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 12 ;;
    fp8-ratio)  # issue 23's 1.3x at <= 12 GiB: the fused-quantisation kernels alone, then
                # bf16@17 and fp8@12 with the gradients' codes on, off, on (~5 min on an H100)
             timeout ${FP8_LIMIT:-480} python bench/gpu_fp8.py --parts quant step --bf16 auto@17 \
               --fp8 auto@12 --grad-quant on off on 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 16 ;;
    stream)  # streamed base weights: on/off bit for bit and the copies' cost (1B), then the
             # 8B step at 17 GiB and Phi-4 at 31 (with transformers + PEFT) with and without
             timeout 200 python bench/gpu_stream.py 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" \
               | tail -n 9
             speed llama-3.1-8b 200 auto@17 auto@17+stream --no-baseline ;;&
    stream|stream-phi4)
             speed phi-4 300 auto@31+stream auto@31 ;;&
    stream-a)  # streaming on/off bit for bit (1B), the host link each way and both at once,
               # Phi-4 at 31 GiB with and without streaming against transformers + PEFT
             timeout 150 python bench/gpu_stream.py 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" \
               | tail -n 9
             timeout 60 python -c "import sys, torch; sys.path.insert(0, 'bench'); import \
profile_step as p; p.copy_bandwidth(torch.device('cuda'))" 2>&1 | tee -a "$OUT/log.txt" | tail -n 2
             speed phi-4 320 auto@31+stream auto@31 ;;
    stream-prof)  # where a streamed step waits: the 8B at 17 GiB and Phi-4 at 31, streamed
             for sp in llama-3.1-8b:auto@17+stream phi-4:auto@31+stream; do
               timeout 200 python bench/profile_step.py --no-ceilings --shape "${sp%%:*}" \
                 --policies "${sp#*:}" 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 45
             done ;;
    stream-b)  # (the host link both ways first)
             timeout 60 python -c "import sys, torch; sys.path.insert(0, 'bench'); import profile_step as p; p.copy_bandwidth(torch.device('cuda'))" 2>&1 | tail -n 1
             # where the DPO step's time goes (phases, profiles of the reference and policy
               # passes), then streamed and not; the 8B SFT step streamed, profiled
             timeout 200 python bench/gpu_preference.py --no-baseline --shared on --phases \
               --profile 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | grep -v -i warn | tail -n 80
             LEANTUNE_STREAM_WEIGHTS=1 timeout 150 python bench/gpu_preference.py --no-baseline \
               --shared on 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | grep -v -i warn | tail -n 4
             timeout 170 python bench/profile_step.py --no-ceilings --shape llama-3.1-8b \
               --policies auto@17+stream 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 45 ;;
    stream-dpo)  # issue 20's DPO step (reference each step) with streamed weights and without
             for s in 1 0; do LEANTUNE_STREAM_WEIGHTS=$s timeout 250 python bench/gpu_preference.py \
               --no-baseline --shared on 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" \
               | grep -v -i warn | tail -n 5; done ;;
    split)   timeout 120 python bench/gpu_shared_attention.py 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 9 ;;
    phi4-sweep)
             pol="auto@31+stream auto@31+stream+streammax:12 auto@31+stream+streammax:8 auto@31"
             if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
               speed phi-4 560 $pol
             else
               speed phi-4 500 $pol --no-baseline
             fi ;;
    prefetch2)
             base="--no-baseline"
             nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && base=""
             LEANTUNE_PREFETCH_DEPTH=2 speed phi-4 330 auto@31+stream auto@31 $base
             LEANTUNE_PREFETCH_DEPTH=1 speed phi-4 200 auto@31+stream auto@31 --no-baseline
             for d in 2 1; do echo "DPO with LEANTUNE_PREFETCH_DEPTH=$d"
               LEANTUNE_PREFETCH_DEPTH=$d timeout 150 python bench/gpu_preference.py \
                 --no-baseline --shared on 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" \
                 | grep -v -i warn | tail -n 1; done ;;
    phi4)    base="--no-baseline"
             nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && base=""
             speed phi-4 400 auto@31+stream auto@31 $base ;;
    phi4-fill)  # issue 22 in one call: Phi-4 at 31 GiB streamed with fill-ahead on and off
                # and transformers + PEFT
             speed phi-4 500 auto@31+stream+fillahead auto@31+stream ;;
    fill-ahead) speed phi-4 300 auto@31+stream+fillahead auto@31+stream --no-baseline ;;
    phi4-prof) timeout 400 python bench/profile_step.py --no-ceilings --shape phi-4 \
               --policies auto@31+stream 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 90 ;;
    micro)  # exact savings: the GEMM variants (residual in the GEMM or after it; q/k/v's K
            # padding), with and without host-link traffic; the DPO step with the defaults, with
            # the old ones (the residual in cuBLAS's GEMM, log-prob gradients formed in backward)
            # and with each alone; the 8B SFT step with the residual after the GEMM and in it
             timeout 120 python bench/gpu_gemm_shapes.py --link 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 24
             for env in LEANTUNE_NONE=1 "LEANTUNE_GEMM_RESIDUAL=1 LEANTUNE_LOGP_GRAD_IN_FORWARD=0" \
                        LEANTUNE_LOGP_GRAD_IN_FORWARD=0 LEANTUNE_GEMM_RESIDUAL=1 LEANTUNE_NONE=1; do
               echo "DPO with $env"
               env $env timeout 150 python bench/gpu_preference.py --no-baseline --shared on 2>&1 \
                 | tee -a "$OUT/log.txt" | grep -v "^{" | grep -v -i warn | tail -n 1
             done
             speed llama-3.1-8b 200 auto@17 auto@17+gemmres auto@17 --no-baseline ;;
    stream-c)  # streaming after the duplex link model: the 1B check (the first step's gradients
               # from the same weights against the unstreamed run's own spread), the 8B SFT and
               # DPO steps and Phi-4 with --stream-weights and without (Phi-4 against
               # transformers + PEFT where the card is an H200, issue 22's card)
             timeout 150 python bench/gpu_stream.py 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" \
               | tail -n 9
             speed llama-3.1-8b 200 auto@17+stream auto@17 --no-baseline
             for s in 1 0; do echo "DPO with LEANTUNE_STREAM_WEIGHTS=$s"
               LEANTUNE_STREAM_WEIGHTS=$s timeout 150 python bench/gpu_preference.py --no-baseline \
                 --shared on 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | grep -v -i warn \
                 | tail -n 1; done
             if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
               speed phi-4 320 auto@31+stream auto@31
             else
               speed phi-4 200 auto@31+stream auto@31 --no-baseline
             fi ;;
    softcap) timeout 400 python bench/gpu_softcap.py ${SOFTCAP_ARGS:-} 2>&1 | tee -a "$OUT/log.txt" \
               | grep -v "^{" | tail -n 40 ;;
    dist)    timeout 170 torchrun --nproc_per_node 1 bench/dist_speed.py --shape llama-3.1-8b \
               --policy auto@17 2>&1 | tee -a "$OUT/log.txt" | grep -v "^{" | tail -n 6 ;;
  esac
done
python bench/report.py "$OUT"
