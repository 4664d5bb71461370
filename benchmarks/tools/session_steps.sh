# Sourced by the device session scripts (gpu_memory, gpu_deepspeed, qlora, pi0): `step SECONDS
# NAME COMMAND...` runs COMMAND for at most SECONDS and never past the session's `budget`
# (seconds from the moment this file is sourced), skips a NAME listed in $SKIP (a second call of
# the same session), prints the log's tail and copies RESULTS.md, results.jsonl and every log
# (packed in OUT/logs.tgz: the device returns at most 8 files) into `out` after each step.
#
# The script sets `out` and `budget` first; STEP_QUIET (an extended regex of lines to leave out
# of the printed tail), STEP_TAIL (lines, 30) and STEP_WIDTH (columns, 240) tune the printout.
# `logs` is the folder the logs are written to; steps may write there too.
logs=${logs:-$(mktemp -d)}
start=$SECONDS
step() {  # step SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  [[ " ${SKIP:-} " == *" $name "* ]] && { echo "=== $name: skipped (SKIP)"; return; }
  local left=$((budget - (SECONDS - start)))
  ((left < limit)) && limit=$left
  ((limit < 20)) && { echo "=== $name: skipped (no time left)"; return; }
  echo "=== $name ($limit s): $*"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start)) s in all"
  grep -v -E "^│ *│${STEP_QUIET:+|$STEP_QUIET}" "$logs/$name.log" | tail -n "${STEP_TAIL:-30}" |
    cut -c1-"${STEP_WIDTH:-240}"
  cp benchmarks/RESULTS.md benchmarks/results.jsonl "$out/"
  tar czf "$out/logs.tgz" -C "$logs" .
}
