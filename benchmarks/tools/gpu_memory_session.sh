#!/usr/bin/env bash
# One device session for the memory, planner and OFT issues, in order of what matters most;
# every step bounded by `timeout`, RESULTS.md and results.jsonl copied out after each.
#
#   PARALLAX_COMMIT=<sha> bash benchmarks/tools/gpu_memory_session.sh OUT_DIR [SECONDS]
#
# 0. the GPU tests of ZeRO-2/3 and the offload's streams;
# 1. benchmarks.plan.accuracy: OpenVLA-7B and LoRA's first choices (the 3 % margin) compiled,
#    with the text as it comes and padded to 64 (do fixed widths close the gap to the
#    hand-tuned rows?), then padded under CUDA graphs;
#    and profiles of LoRA under 16 GiB (micro-batch 1: host-bound?) and OpenVLA-7B's choice;
# 2. benchmarks.zero.memory_fit: the new first choice under 32 GiB;
# 3. benchmarks.plan.accuracy: the other rows (LoRA at 64, LLaVA, SigLIP) at the 3 % margin.
# 4. every row uncapped with the allocator's reserved peak, a LoRA profile, SigLIP under graphs;
# 5. benchmarks.zero.memory_fit: the capped rows again with the allocator's retries (after the
#    offload's queue was bounded, run this first: SKIP every other step).
# After the transient's and the reserve's change (stop 35): MORE_ROWS=siglip plan_more and
# memory_fit_again first, then plan_reserved and FIT_ROWS=llava-24 memory_fit.
# Each list can be changed through PLAN_ROWS, FIT_ROWS and MORE_ROWS; SKIP="name ..." skips
# steps already run (a second call of the same session).
set -u
out=${1:?usage: gpu_memory_session.sh OUT_DIR [SECONDS]}
budget=${2:-580}
mkdir -p "$out"
logs=$(mktemp -d)  # every log and profile, packed into $out/logs.tgz after each step: the device
# returns at most 8 files, and RESULTS.md and results.jsonl must be two of them
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
: "${PARALLAX_COMMIT:?set PARALLAX_COMMIT to the commit that runs: a device copy of the tree may hold another git state}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # a capped card fragments less
STEP_WIDTH=220
source benchmarks/tools/session_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
step 60 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/optim/test_zero_stages_cuda.py
rows=${PLAN_ROWS:-openvla,lora-16}
step 150 plan_plain python3 -m benchmarks.plan.accuracy --rows "$rows" --compile --steps 3 --warmup 2
step 150 plan_padded python3 -m benchmarks.plan.accuracy --rows "$rows" --compile --pad-to-multiple-of 64 --steps 3 --warmup 2
step 120 profile_lora16 python3 -m benchmarks.tools.profile_rows --out "$logs/profile_lora16.txt" plan fit:lora-16 --compile
step 100 profile_openvla python3 -m benchmarks.tools.profile_rows --out "$logs/profile_openvla.txt" plan openvla --compile
step 150 plan_graphs python3 -m benchmarks.plan.accuracy --rows "$rows" --compile --cuda-graphs --pad-to-multiple-of 64 --steps 3 --warmup 2
step 200 memory_fit python3 -m benchmarks.zero.memory_fit --rows "${FIT_ROWS:-openvla-32}" --compile --steps 1 --row-timeout 190
step 300 plan_more python3 -m benchmarks.plan.accuracy --rows "${MORE_ROWS:-lora-64,llava,siglip}" --compile --steps 3 --warmup 2
# 4. the allocator's reserve: every row uncapped, with the reserved peak and retries recorded;
#    a profile of LoRA at batch 16 as the planner runs it (against the hand-tuned row), and the
#    rows the hand-tuned figures ran under CUDA graphs
step 260 plan_reserved python3 -m benchmarks.plan.accuracy --rows "${RESERVED_ROWS:-openvla,lora-16,lora-64,llava,siglip}" --compile --steps 3 --warmup 2
step 110 profile_lora16_uncapped python3 -m benchmarks.tools.profile_rows --out "$logs/profile_lora16_uncapped.txt" plan lora-16 --compile
step 90 siglip_graphs python3 -m benchmarks.plan.accuracy --rows siglip --compile --cuda-graphs --steps 3 --warmup 2
# 5. the capped rows again, with the allocator's retries and reserved peak recorded (does the
#    24 GiB row's time miss come from retries?), after a profile of LoRA under 16 GiB
step 420 memory_fit_again python3 -m benchmarks.zero.memory_fit --rows "${AGAIN_ROWS:-openvla-24,openvla-32}" --compile --steps 1 --row-timeout 200
