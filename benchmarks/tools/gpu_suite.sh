#!/usr/bin/env bash
# Every GPU figure of the layer, pipeline, ZeRO, checkpoint and training benchmarks in one go,
# on the GPUs of one machine (2 by default). Each script appends its table to RESULTS.md and
# results.jsonl; a failing or slow script (bounded by `timeout`) never stops the next.
#
#   bash benchmarks/tools/gpu_suite.sh OUT_DIR [NGPUS]
#
# OUT_DIR receives three files: RESULTS.md and results.jsonl as updated, and logs.tgz (every
# script's log and the training runs' metrics.jsonl).
# The throughput comparison with PyTorch's own tools is benchmarks/step/openvla.py.
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR [NGPUS]}
n=${2:-2}
scratch=${SCRATCH:-/tmp/parallax-suite}
rm -rf "$scratch"; mkdir -p "$out" "$scratch/logs"
logs=$scratch/logs
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
run() {  # run SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  echo "=== $name: $*" | tee -a "$logs/suite.log"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$logs/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$logs/suite.log"
  tail -n 25 "$logs/$name.log"
  save
}
save() {  # after every script, so a run cut short still returns what it measured
  for d in "$scratch"/*/; do
    [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$logs/metrics_$(basename "$d").jsonl"
  done
  tar czf "$out/logs.tgz" -C "$scratch" logs
  cp benchmarks/RESULTS.md benchmarks/results.jsonl "$out/"
}
tr="torchrun --nproc-per-node $n"

run 60 tp_layers $tr -m benchmarks.layers.tp
run 120 pipeline_bubble $tr -m benchmarks.pipeline.bubble --out "$scratch/traces" \
  --microbatches 4,8,16 --iters 5
run 100 zero_memory $tr -m benchmarks.zero.memory
run 150 openvla_load $tr -m benchmarks.checkpoint.load --out "$scratch/openvla-7b-random"
rm -rf "$scratch/openvla-7b-random"

# issue 6: the default tiny run, and openvla-7b (random weights, bf16) at tp2, pp2, dp2
run 60 train_tiny $tr -m parallax.train --out "$scratch/tiny" --save-interval 0 --log-interval 50
big="--model openvla-7b --precision bf16 --steps 5 --warmup-steps 1 --global-batch-size 16 \
  --micro-batch-size 4 --save-interval 0 --log-interval 1"
for layout in "--tp $n" "--pp $n" "--dp $n"; do
  name=7b$(echo "$layout" | tr -d ' -')
  # shellcheck disable=SC2086
  run 100 "train_$name" $tr -m parallax.train $big $layout --out "$scratch/$name"
done
python -m benchmarks.tools.train_report --title "parallax.train on $n GPUs (issue 6 runs)" --gpus "$n" \
  --run "tiny dp$n (default command)=$scratch/tiny" --run "openvla-7b tp$n=$scratch/7btp$n" \
  --run "openvla-7b pp$n=$scratch/7bpp$n" --run "openvla-7b dp$n=$scratch/7bdp$n" \
  --command "$tr -m parallax.train [--save-interval 0]; $tr -m parallax.train $big --tp|--pp|--dp $n" \
  --notes "median after 2 warm-up steps; tiny: 150 steps, gbs 32 fp32; 7b: 5 steps, gbs 16, mbs 4" \
  2>&1 | tee "$logs/train_report.log"
save
