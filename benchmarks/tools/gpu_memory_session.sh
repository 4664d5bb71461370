#!/usr/bin/env bash
# One device session for the memory, planner and OFT issues, in order of what matters most;
# every step bounded by `timeout`, RESULTS.md and results.jsonl copied out after each.
#
#   PARALLAX_COMMIT=<sha> bash benchmarks/tools/gpu_memory_session.sh OUT_DIR [SECONDS]
#
# 0. the GPU tests of ZeRO-2/3 and the offload's streams;
# 1. benchmarks.zero.memory_fit: OpenVLA-7B LoRA under 16 GiB beside its uncapped row;
# 2. benchmarks.openvla.oft_step: the compiled OFT step with a compiler memory budget, beside
#    the compiled peer;
# 3. benchmarks.plan.plan_accuracy: the uncapped first choices compiled, with CUDA graphs;
# 4. benchmarks.zero.host_bound: the host's phases and the pinned copies, both ways at once;
# 5. benchmarks.zero.memory_fit: LLaVA-NeXT-7B under 24 GiB beside its uncapped row.
# Each list can be changed through FIT_ROWS, OFT_ROWS, PLAN_ROWS and LLAVA_ROWS.
set -u
out=${1:?usage: gpu_memory_session.sh OUT_DIR [SECONDS]}
budget=${2:-580}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
: "${PARALLAX_COMMIT:?set PARALLAX_COMMIT to the commit that runs: a device copy of the tree may hold another git state}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # a capped card fragments less
start=$SECONDS
step() {  # step SECONDS NAME COMMAND...: at most SECONDS, and never past the budget
  local limit=$1 name=$2; shift 2
  local left=$((budget - (SECONDS - start)))
  ((left < limit)) && limit=$left
  ((limit < 20)) && { echo "=== $name: skipped (no time left)"; return; }
  echo "=== $name ($limit s): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start)) s in all"
  tail -n 30 "$out/$name.log" | cut -c1-220
  cp benchmarks/RESULTS.md benchmarks/results.jsonl "$out/"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
step 60 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/optim/test_zero_stages_cuda.py
step 200 memory_fit python3 -m benchmarks.zero.memory_fit --rows "${FIT_ROWS:-lora-16,lora}" --compile --steps 2 --row-timeout 95
step 170 oft_step python3 -m benchmarks.openvla.oft_step --compile --memory --rows "${OFT_ROWS:-parallax+compile+budget,hf+compile}"
step 200 plan_accuracy python3 -m benchmarks.plan.plan_accuracy --rows "${PLAN_ROWS:-openvla,lora-16}" --compile --cuda-graphs --steps 3 --warmup 2
step 90 host_bound python3 -m benchmarks.zero.host_bound
step 300 memory_fit_llava python3 -m benchmarks.zero.memory_fit --rows "${LLAVA_ROWS:-llava-24,llava}" --compile --steps 1 --row-timeout 145
