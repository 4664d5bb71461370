#!/usr/bin/env bash
# One device call for issue 42: the offloaded step's lanes (what each stream and host thread does
# when; benchmarks/tools/lanes.py) under 24 and 32 GiB, then the capped and uncapped rows of
# memory_fit in one invocation; every step bounded by `timeout`, logs packed into OUT/logs.tgz.
#
#   PARALLAX_COMMIT=<sha> bash benchmarks/tools/offload_session.sh OUT_DIR [SECONDS]
#
# The next calls: benchmarks/NOTES.md, "Next GPU session, first".
# STEPS (default "profile24 profile32") picks what runs: host (the host's cores and sockets,
# then benchmarks/zero/host_bound.py at HOST_THREADS, default "15 16"), cuda_tests (the offload's
# CUDA tests; cuda_stages: the stages' and offload layouts' alone; cuda_split: the split masters' alone), probe and probe_pinned (benchmarks/zero/one_pass_adamw.py: the clipped host step
# with torch's kernel and in one pass, replayed in a worker thread beside a busy main thread), profile24,
# profile32, fit (FIT_ROWS,
# default openvla,openvla-24,openvla-32; FIT_STEPS timed steps (default 3) after FIT_WARMUP
# (default 2: a deferred host step runs under the next step, so 2 keeps the first one's state
# allocation out), and
# before24: profile24 from the tree in .before (an earlier commit's parallax/ and benchmarks/,
# `git archive REV parallax benchmarks | tar -x -C .before`, carried), for a before/after pair.
set -u
out=${1:?usage: offload_session.sh OUT_DIR [SECONDS]}
budget=${2:-580}
mkdir -p "$out"
logs=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
: "${PARALLAX_COMMIT:?set PARALLAX_COMMIT to the commit that runs: a device copy of the tree may hold another git state}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # as memory_fit's rows run
STEP_WIDTH=200 STEP_TAIL=${STEP_TAIL:-40}
source benchmarks/tools/session_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for s in ${STEPS:-profile24 profile32}; do
  case $s in
    host)
      step 40 cpu bash -c 'lscpu; command -v numactl >/dev/null && numactl -H; free -g'
      step 200 host_bound python3 -m benchmarks.zero.host_bound --threads ${HOST_THREADS:-15 16} ;;
    probe)  # the clipped host step both ways as the offload's worker runs it, beside a busy main thread
      step 150 probe env PROBE_BLOCKS=8 TORCH_LOGS=recompiles python3 -m benchmarks.zero.one_pass_adamw ;;
    probe_pinned)  # ... the sums page-locked
      step 150 probe_pinned env PROBE_BLOCKS=8 PROBE_PINNED=1 python3 -m benchmarks.zero.one_pass_adamw ;;
    cuda_tests)
      step 240 cuda_tests python3 -m pytest -q -x tests/optim/test_zero_stages_cuda.py tests/optim/test_zero_cuda.py \
        tests/optim/test_host_adamw_cuda.py tests/optim/test_pinned.py tests/optim/test_split_masters.py ;;
    cuda_stages)  # ZeRO-2/3 and the offload's layouts against torch on the GPU (sums kept there too)
      step 200 cuda_stages python3 -m pytest -q -x tests/optim/test_zero_stages_cuda.py ;;
    cuda_split)  # split masters' kernels compiled, and the weights brought down, on the GPU
      step 200 cuda_split python3 -m pytest -q -x -k "cuda or split" tests/optim/test_host_adamw_cuda.py tests/optim/test_split_masters.py ;;
    profile24|profile32)
      step 260 "$s" python3 -m benchmarks.tools.profile_rows --out "$logs/$s.txt" plan "fit:openvla-${s#profile}" --compile ;;
    before24)
      step 260 before24 env -C .before PYTHONPATH=. python3 -m benchmarks.tools.profile_rows --out "$logs/before24.txt" plan fit:openvla-24 --compile ;;
    fit)
      step 560 fit python3 -m benchmarks.zero.memory_fit --rows "${FIT_ROWS:-openvla,openvla-24,openvla-32}" \
        --compile --steps "${FIT_STEPS:-3}" --warmup "${FIT_WARMUP:-2}" --row-timeout "${ROW_TIMEOUT:-200}" ;;
  esac
done
