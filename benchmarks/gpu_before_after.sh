#!/usr/bin/env bash
# One lent GPU, two versions of hubsoup on the same machine and inputs (issue 50, item 4): BEFORE is the package
# in _before/ (untracked, so the device tool copies it: `git archive BEFORE_SHA hubsoup cards | tar -x -C _before`),
# AFTER is this tree. BEFORE's merges run in _before with only it (and the wheels) on their path.
# Run from the repository root; everything is logged to $OUT/log ($OUT: the device tool's output folder; else
# /tmp/gpu-out). Steps, each under `timeout`, the whole under TOTAL_S (480 s):
#   carried wheels (.whl/, as gpu_session.sh) -> bytecode compiled once -> bench_gpu.py BEFORE (builds the models
#   once; hubsoup only) -> bench_gpu.py AFTER (reuses them; with mergekit) -> pytest -m gpu (AFTER) -> cProfile of
#   one TIES merge, AFTER then BEFORE (callers of torch.empty and _cuda_getDeviceCount).
# Results in $OUT: gpu_bench_before.md/.json, gpu_bench_after.md/.json, pytest_gpu.txt, profile_ties_after.txt,
# profile_ties_before.txt, log.
#
#   bash benchmarks/gpu_before_after.sh            # METHODS, LAYERS, TOTAL_S, MERGEKIT=0 override the defaults
#   DRY=1 bash benchmarks/gpu_before_after.sh      # print each step's command, run nothing
#   DEVICE=cpu LAYERS=1 bash benchmarks/gpu_before_after.sh   # no GPU: every step for real at tiny sizes (the
#                                                  # bench's --device cpu dry run; pytest -m gpu then skips)
TOTAL_S="${TOTAL_S:-480}"
source "$(dirname "$0")/gpu_common.sh"
LAYERS="${LAYERS:-16}"
METHODS="${METHODS:-task_arithmetic ties dare_ties slerp sftm}"
ROOT="$PWD"
BEFORE="$ROOT/_before"
BENCH="${BENCH:-/tmp/hubsoup-gpu-bench}"
PY="${PY:-python3}"
DEVICE="${DEVICE:-cuda}"
# step SECONDS CMD...: run under `timeout` (at most what is left, less a margin for the steps after); DRY=1 prints
step() {
  local t="$1"; shift
  local l=$(( $(left) - 5 ))
  [ "$t" -gt "$l" ] && t="$l"
  if [ "$t" -lt 5 ]; then echo "!! skipped (no time left): $*"; return 124; fi
  echo "== $(date -u +%T) [+$((SECONDS - START))s, timeout ${t}s] $*" >&2
  if [ "${DRY:-0}" = 1 ]; then return 0; fi
  timeout "$t" "$@"
  local rc=$?
  echo "== rc=$rc after $((SECONDS - START)) s" >&2
  return $rc
}

install_wheels step 120
AFTER_PATH="${SITE:+$SITE:}$ROOT"
BEFORE_PATH="$BEFORE${SITE:+:$SITE}"  # never $ROOT: BEFORE's hubsoup must be the only one on its path
# BEFORE: `git archive <main's commit> hubsoup cards | tar -x -C _before` (the card templates live beside the package)
if [ -f "$BEFORE/hubsoup/__init__.py" ]; then HAVE_BEFORE=1; else
  HAVE_BEFORE=0; echo "!! $BEFORE/hubsoup missing: no BEFORE run (git archive MAIN_SHA hubsoup cards | tar -x -C _before)"
fi
if [ "$HAVE_BEFORE" = 1 ] && [ ! -d "$BEFORE/cards" ] && [ ! -d "$BEFORE/hubsoup/cards" ]; then
  echo "!! $BEFORE/cards missing: this tree's card templates copied there (they do not change merge times)"
  [ "${DRY:-0}" = 1 ] || cp -r "$ROOT/cards" "$BEFORE/cards"
fi
# both trees and the wheels compiled once, before anything is timed
step 60 "$PY" -m compileall -q -j 0 hubsoup $( [ "$HAVE_BEFORE" = 1 ] && echo "$BEFORE/hubsoup" ) $SITE > /dev/null \
  || echo "!! compileall incomplete"
PYTHONPATH="$AFTER_PATH" step 60 "$PY" -c "import torch, hubsoup.api, hubsoup.cli, mergekit.merge, mergekit.scripts.run_yaml
print('python', __import__('sys').version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| available', torch.cuda.is_available(), '| after:', hubsoup.api.__file__)" || echo "!! warm-up imports failed"
if [ "$HAVE_BEFORE" = 1 ]; then
  (cd "$BEFORE" && PYTHONPATH="$BEFORE_PATH" step 60 "$PY" -c "import hubsoup.api, hubsoup.cli; print('before:', hubsoup.api.__file__)") \
    || echo "!! BEFORE imports failed"
fi
[ "${DRY:-0}" = 1 ] || [ "$DEVICE" != cuda ] || timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

# the models are built once (by the first run), then reused; each run reads them warm first
DEV_ARGS=(--layers "$LAYERS" --run-timeout 120 --work "$BENCH" --reuse --device "$DEVICE" --methods $METHODS)
if [ "$HAVE_BEFORE" = 1 ]; then
  B_S=150
  PYTHONPATH="$AFTER_PATH" step "$B_S" "$PY" benchmarks/bench_gpu.py "${DEV_ARGS[@]}" --budget $(( B_S - 10 )) \
    --no-mergekit --tree "$BEFORE" --out "$OUT" --name gpu_bench_before
  [ -f "$OUT/gpu_bench_before.md" ] && cat "$OUT/gpu_bench_before.md"
fi
A_S=190
PYTHONPATH="$AFTER_PATH" step "$A_S" "$PY" benchmarks/bench_gpu.py "${DEV_ARGS[@]}" --budget $(( A_S - 10 )) \
  --tree "$ROOT" --out "$OUT" --name gpu_bench_after $( [ "${MERGEKIT:-1}" = 1 ] || echo --no-mergekit )
[ -f "$OUT/gpu_bench_after.md" ] && cat "$OUT/gpu_bench_after.md"

# the gpu tests of this tree (the new ones: device counts per merge, bounded pinned buffers, tiny rings' bytes)
T_S=$(( $(left) - 45 ))
[ "$T_S" -gt 150 ] && T_S=150
PYTHONPATH="$AFTER_PATH" step "$T_S" "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider -o addopts="" \
  tests/engine/test_gpu.py > "$OUT/pytest_gpu.txt" 2>&1
tail -25 "$OUT/pytest_gpu.txt" 2>/dev/null

# where one TIES merge's time goes: callers of torch.empty and of the CUDA device count, AFTER then BEFORE
profile() {  # profile NAME TREE PATH
  local name="$1" tree="$2" path="$3"
  [ -d "$BENCH/ft3" ] || [ "${DRY:-0}" = 1 ] || { echo "!! no bench models for the profile"; return; }
  (cd "$tree" && PYTHONPATH="$path" step 40 "$PY" -m cProfile -o "$OUT/profile_ties_$name.prof" -m hubsoup merge \
    "$BENCH/ft1" "$BENCH/ft2" "$BENCH/ft3" --base "$BENCH/base" --method ties -p density=0.2 -p scope=tensor \
    -p merge=mean --device "$DEVICE" --out "/tmp/prof-out-$name" --overwrite --quiet) \
    > "$OUT/profile_ties_$name.txt" 2>&1
  [ "${DRY:-0}" = 1 ] && { cat "$OUT/profile_ties_$name.txt"; return; }
  grep -m1 "merged" "$OUT/profile_ties_$name.txt"
  step 20 "$PY" - "$OUT/profile_ties_$name.prof" >> "$OUT/profile_ties_$name.txt" <<'PY' || echo "!! profile report failed"
import pstats, sys
st = pstats.Stats(sys.argv[1])
st.sort_stats("tottime").print_stats(30)
st.print_callers(r"torch.empty|_cuda_getDeviceCount|is_available|device_count")
PY
  grep -E "ncalls|torch.empty\}|_cuda_getDeviceCount\}" "$OUT/profile_ties_$name.txt" | head -6
}
profile after "$ROOT" "$AFTER_PATH"
[ "$HAVE_BEFORE" = 1 ] && profile before "$BEFORE" "$BEFORE_PATH"
echo "== done in $((SECONDS - START)) s; in $OUT: $(ls "$OUT" | tr '\n' ' ')"
sleep 1  # tee writes the last lines before the folder is collected
