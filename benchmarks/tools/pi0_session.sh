#!/usr/bin/env bash
# The device session of issue 38's pi0.5 rows (one H200): parallax against LeRobot's own policy
# in the same invocation (benchmarks/step/pi0.py), one part per device call (<= 10 minutes each;
# a session has 30 minutes of device time, so a, b and c fit one session, d the next).
#
#   PARALLAX_COMMIT=<sha> bash benchmarks/tools/pi0_session.sh OUT PART      # carry .peers/lerobot
#
# PART a: full fine-tuning (parallax eager and compiled, lerobot eager and compiled);
#      b: LoRA (parallax, PEFT on LeRobot's policy), compiled only, and inference at batch 1
#         (predict_action_chunk against select_action's chunk), eager and compiled;
#      c: small cards: the planner's choice under --gpu-memory-limit 16 (LoRA) and 24 (full),
#         beside the uncapped compiled rows they are compared with (parallax only);
#      d: LeRobot at its default compile mode (max-autotune) for training, the mode a and b
#         replace by torch.compile's default for their 10 minutes, and pi0 (not 0.5) rows.
# .peers/lerobot: `bash benchmarks/tools/make_lerobot_peer.sh OPENPI_DIR` on a machine with the
# registry (lerobot 0.4.4, transformers 4.53.2 + openpi's transformers_replace, ~46 MiB),
# named in the call's carry. The results files and logs.tgz (every log) land in OUT.
set -u
out=${1:?usage: pi0_session.sh OUT_DIR a|b|c|d}
part=${2:?usage: pi0_session.sh OUT_DIR a|b|c|d}
budget=${BUDGET:-570}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
: "${PARALLAX_COMMIT:?set PARALLAX_COMMIT to the commit that runs}"
STEP_QUIET='[Ww][Aa][Rr][Nn][Ii][Nn][Gg]'
source benchmarks/tools/session_steps.sh
bench="python3 -m benchmarks.step.pi0 --model pi05 --batch 8 --compile"
case $part in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ls .peers/lerobot >/dev/null || echo "no .peers/lerobot: the lerobot rows will say so"
  step 560 full $bench --rows full --peer-compile-mode default --peer-timeout 300
  ;;
b)
  step 300 lora $bench --rows lora --compile-only --peer-compile-mode default --peer-timeout 200
  step 260 infer $bench --rows infer --peer-timeout 150
  ;;
c)
  step 560 small $bench --rows small --compile-only --stacks parallax
  ;;
d)
  step 330 lerobot_autotune $bench --rows full --compile-only --stacks lerobot --peer-timeout 320
  step 230 pi0 python3 -m benchmarks.step.pi0 --model pi0 --batch 8 --compile --compile-only --rows full,infer --peer-compile-mode default --peer-timeout 100
  ;;
esac
cp benchmarks/RESULTS.md benchmarks/results.jsonl "$out/"
