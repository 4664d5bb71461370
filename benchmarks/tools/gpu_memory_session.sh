#!/usr/bin/env bash
# One device session for the memory, planner and OFT issues, in order of what matters most;
# every step bounded by `timeout`, RESULTS.md and results.jsonl copied out after each.
#
#   PARALLAX_COMMIT=<sha> bash benchmarks/tools/gpu_memory_session.sh OUT_DIR [SECONDS]
#
# 1. benchmarks.zero.memory_fit: 7B under 32/24/16 GiB caps, the FSDP2 + CPU offload peer;
# 2. benchmarks.plan.plan_accuracy: the planner's uncapped first choices, predicted vs measured;
# 3. benchmarks.openvla.oft_step: OpenVLA-OFT's training step and action-chunk inference.
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
step 330 memory_fit python3 -m benchmarks.zero.memory_fit --rows "${FIT_ROWS:-openvla-32,openvla-24,llava-24,lora-16,fsdp2-offload-32}" --row-timeout 120
step 150 plan_accuracy python3 -m benchmarks.plan.plan_accuracy --rows "${PLAN_ROWS:-lora-16,siglip,openvla,llava}" --steps 2 --warmup 1
[ -n "${OFT:-}" ] && step 300 oft_step python3 -m benchmarks.openvla.oft_step --steps 4 --warmup 2 --write
