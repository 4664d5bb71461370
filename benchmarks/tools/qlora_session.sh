#!/usr/bin/env bash
# The device session of the quantized base (issue 40): OpenVLA-7B LoRA r32 at batch 16, compiled,
# the bf16 base uncapped against the NF4 and int8 bases under a 16 GiB cap, beside the HF +
# PEFT + bitsandbytes 4-bit peer; then a 12 GiB run from a checkpoint read on the host, OFT's
# LIBERO recipe on NF4 under 16 GiB, and the 300-step loss curves of both bases.
#
#   PARALLAX_COMMIT=<sha> PYTHONPATH=.:.peers/bnb bash benchmarks/tools/qlora_session.sh OUT PART
#
# PART a: the speed rows; b: 12 GiB, OFT, int8; c: the curves (metrics.jsonl of each run).
# .peers/bnb: `pip install --no-deps --target .peers/bnb bitsandbytes` (0.50; the GPU machine has
# no network), carried to the device.
set -u
out=${1:?usage: qlora_session.sh OUT_DIR a|b|c}
part=${2:?usage: qlora_session.sh OUT_DIR a|b|c}
budget=${BUDGET:-570}
mkdir -p "$out"
logs=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
: "${PARALLAX_COMMIT:?set PARALLAX_COMMIT to the commit that runs}"
STEP_TAIL=12
source benchmarks/tools/session_steps.sh
lora="python3 -m benchmarks.step.lora --compile --batch 16 --micro-batch 16 --session qlora1"
train="python3 -m parallax.train --model openvla-7b --finetune lora --compile --precision bf16"
train="$train --global-batch-size 16 --micro-batch-size 16 --save-interval 0"
capped="--quantize-base nf4 --gpu-memory-limit 16 --activation-checkpointing"
case $part in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  step 90 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/tensor/test_quant_cuda.py
  step 120 bf16 $lora --stack parallax
  step 140 nf4_16 $lora --stack parallax $capped
  step 180 hf_nf4 $lora --stack hf --quantize-base nf4
  step 130 int8_16 $lora --stack parallax --quantize-base int8 --gpu-memory-limit 16 --activation-checkpointing
  ;;
b)
  step 150 checkpoint python3 -m benchmarks.tools.random_checkpoint --model openvla-7b --out /tmp/ovla7b
  step 150 nf4_12 python3 -m parallax.train --model /tmp/ovla7b --finetune lora --compile --precision bf16 --global-batch-size 16 --micro-batch-size 8 --save-interval 0 --steps 8 --log-interval 1 --quantize-base nf4 --gpu-memory-limit 12 --activation-checkpointing --out "$logs/nf4_12"
  step 160 oft_nf4_16 python3 -m benchmarks.step.oft --compile --memory --rows parallax+compile+nf4-16
  step 120 hf_nf4_eager python3 -m benchmarks.step.lora --batch 16 --micro-batch 16 --session qlora1 --stack hf --quantize-base nf4
  ;;
c)
  step 230 curve_bf16 $train --steps 300 --log-interval 10 --out "$logs/curve_bf16"
  step 330 curve_nf4 $train --steps 300 --log-interval 10 $capped --out "$logs/curve_nf4"
  mkdir -p "$out/curves"
  for k in bf16 nf4; do cp "$logs/curve_$k/metrics.jsonl" "$out/curves/$k.jsonl" 2>/dev/null; done
  ;;
esac
cp benchmarks/RESULTS.md benchmarks/results.jsonl "$out/"
tar czf "$out/logs.tgz" -C "$logs" .
