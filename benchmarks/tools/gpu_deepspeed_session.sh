#!/usr/bin/env bash
# One device call for issue 42's peer: DeepSpeed ZeRO-2 / ZeRO-3 with offload_optimizer: cpu (its
# CPU Adam) beside parallax's capped row, in one memory_fit invocation (same model, cap, batch,
# data); every step bounded by `timeout`, RESULTS.md and results.jsonl copied out after each.
#
#   PARALLAX_COMMIT=<sha> bash benchmarks/tools/gpu_deepspeed_session.sh OUT_DIR [SECONDS]
#
# DeepSpeed travels as a folder: build it here (no internet there) with
#   DS_BUILD_OPS=0 pip install --no-deps --no-compile --target .peers/deepspeed deepspeed==0.19.8
#   pip install --no-deps --no-compile --no-index --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 --target .peers/deepspeed <wheels>
# (the wheels: hjson, pydantic, pydantic-core, annotated-types, typing-inspection,
# typing-extensions; the image has the rest: einops, msgpack, ninja, numpy, packaging, psutil,
# py-cpuinfo, tqdm, nvidia-ml-py), and name `.peers/deepspeed` in the call's `carry`.
#
# 0. the toolchain and DeepSpeed's CPU Adam JIT build alone (its exact error if it fails; the
#    build is cached in TORCH_EXTENSIONS_DIR for the rows);
# 1. memory_fit: parallax's first choice under a cap and a DeepSpeed row under the same cap, one
#    invocation (FIT_ROWS, default openvla-32,deepspeed-z2-offload-32: both fit one 10-minute
#    call; the next call, on the still-warm machine, SKIP=ds_build
#    FIT_ROWS=openvla-24,deepspeed-z3-offload-24, then the other two DeepSpeed rows).
#    HOST_LIMIT (default 112 GiB, memory_fit's) ends a row past it: DeepSpeed's own count of its
#    host memory is 16 bytes a parameter, 112 GiB for OpenVLA-7B (its record keeps the RSS at
#    which it ended). ROW_TIMEOUT (default 280 s) bounds each row.
# SKIP="name ..." skips steps already run.
set -u
out=${1:?usage: gpu_deepspeed_session.sh OUT_DIR [SECONDS]}
budget=${2:-580}
mkdir -p "$out"
logs=$(mktemp -d)  # every log, packed into $out/logs.tgz after each step
: "${PARALLAX_COMMIT:?set PARALLAX_COMMIT to the commit that runs: a device copy of the tree may hold another git state}"
[[ -d .peers/deepspeed/deepspeed ]] || echo "no .peers/deepspeed: the DeepSpeed rows will record the import error"
export PYTHONPATH=.:.peers/deepspeed PYTHONUNBUFFERED=1
export DS_BUILD_OPS=0  # every op just in time; only CPU Adam is built (with c++ and ninja)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ds_torch_extensions}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # as memory_fit's rows run
if [[ -z ${CUDA_HOME:-} ]]; then  # CPU Adam needs no nvcc; DeepSpeed's other probes read it
  for d in /usr/local/cuda /usr/local/cuda-13.0; do [[ -x $d/bin/nvcc ]] && { export CUDA_HOME=$d; break; }; done
  nvcc=$(command -v nvcc || true)
  [[ -z ${CUDA_HOME:-} && -n $nvcc ]] && export CUDA_HOME=$(dirname "$(dirname "$nvcc")")
fi
STEP_QUIET='FutureWarning|return func' STEP_WIDTH=400
source benchmarks/tools/session_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
echo "CUDA_HOME=${CUDA_HOME:-}"
step 240 ds_build python3 -m benchmarks.zero.deepspeed_offload
rows=${FIT_ROWS:-openvla-32,deepspeed-z2-offload-32}
step 560 memory_fit python3 -m benchmarks.zero.memory_fit --rows "$rows" --compile --steps "${FIT_STEPS:-3}" \
  --row-timeout "${ROW_TIMEOUT:-280}" --host-limit "${HOST_LIMIT:-112}"
