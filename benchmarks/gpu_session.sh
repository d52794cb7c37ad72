#!/usr/bin/env bash
# The one script a lent GPU runs, from the repository root. Everything is logged to $OUT/log ($OUT: the
# device tool's output folder; else /tmp/gpu-out): first the device kernels alone (gpu_probe.py), then bench_gpu.py against mergekit, the `gpu` tests and a
# profile of one merge. The benchmarks write $OUT/gpu_probe.json, gpu_bench.md and .json (copy them to
# benchmarks/results/ afterwards). Each step has a timeout; the whole stays under 10 minutes.
#
#   bash benchmarks/gpu_session.sh     # PROBE=0, METHODS, VARIANTS, LAYERS, TESTS_S, BENCH_S, TOTAL_S override the defaults
TOTAL_S="${TOTAL_S:-560}"
source "$(dirname "$0")/gpu_common.sh"
install_wheels timeout 150
export PYTHONPATH="${SITE:+$SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "PYTHONPATH=$PYTHONPATH"
timeout 60 python3 -m compileall -q -j 0 hubsoup ${PYTHONPATH%%:*} > /dev/null 2>&1 || echo "!! compileall incomplete"
timeout 90 python3 -c "import hubsoup.api, hubsoup.cli, mergekit.merge, mergekit.scripts.run_yaml" \
  || echo "!! warm-up imports failed"  # both tools' modules compiled before either is timed
# the disk the outputs go to: page-cache write rate, then what a final fsync waits for
timeout 60 python3 - <<'PY' || echo "!! disk probe failed"
import os, time
path, chunk, total = "/tmp/hubsoup-disk-probe", bytes(64 << 20), 2 << 30
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
t = time.perf_counter()
for off in range(0, total, len(chunk)):
    os.pwrite(fd, chunk, off)
w = time.perf_counter() - t
os.fsync(fd)
s = time.perf_counter() - t - w
os.close(fd); os.remove(path)
print(f"disk probe: {total / 1e9:.1f} GB written at {total / 1e9 / w:.1f} GB/s (page cache), fsync {s:.2f} s "
      f"(write + sync {total / 1e9 / (w + s):.1f} GB/s)")
PY
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
timeout 60 python3 - <<'PY' || echo "!! version check failed"
import importlib, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
for m in ("transformers", "huggingface_hub", "safetensors", "accelerate", "peft", "mergekit", "pydantic"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')} ({mod.__file__})")
    except Exception as e:
        print(f"{m}: NOT importable ({type(e).__name__}: {e})")
import hubsoup
print("hubsoup", hubsoup.__file__)
PY

BENCH="/tmp/hubsoup-gpu-bench"
if [ "${PROBE:-1}" = 1 ]; then
  echo "== $(date -u +%T) gpu_probe.py (timeout 110s)"
  timeout 110 python3 benchmarks/gpu_probe.py --out "$OUT"
  echo "== probe rc=$? after $((SECONDS - START)) s"
fi

BENCH_S="${BENCH_S:-300}"
echo "== $(date -u +%T) bench_gpu.py (timeout ${BENCH_S}s)"
timeout "$BENCH_S" python3 benchmarks/bench_gpu.py --layers "${LAYERS:-16}" --budget $(( BENCH_S - 15 )) \
  --run-timeout 150 ${VARIANTS:---variant ties:HUBSOUP_DEVICE_SELECT=histogram --variant sftm:HUBSOUP_SFTM_SVD=svd} \
  ${METHODS:+--methods $METHODS} --work "$BENCH" --out "$OUT"
echo "== bench rc=$? after $((SECONDS - START)) s"
[ -f "$OUT/gpu_bench.md" ] && cat "$OUT/gpu_bench.md"

TESTS_S="${TESTS_S:-$(( $(left) - 45 ))}"
if [ "$TESTS_S" -gt 30 ]; then
  echo "== $(date -u +%T) pytest -m gpu (timeout ${TESTS_S}s)"
  timeout "$TESTS_S" python3 -m pytest -m gpu -q -x -p no:cacheprovider -o addopts="" tests/engine/test_gpu.py
  echo "== pytest rc=$? after $((SECONDS - START)) s"
else
  echo "== no time left for pytest -m gpu ($TESTS_S s)"
fi

# where a merge's time goes: the Python profile of the benchmark's TIES merge (main thread), by own time, and who
# calls the costliest built-ins (run 3: torch.empty 0.31 s and a CUDA device count per pinned allocation 0.18 s)
if [ -d "$BENCH/ft3" ] && [ "$(left)" -gt 30 ]; then
  echo "== $(date -u +%T) cProfile of hubsoup merge --method ties"
  timeout $(( $(left) - 10 )) python3 -m cProfile -o "$OUT/profile_ties.prof" -m hubsoup merge "$BENCH/ft1" \
    "$BENCH/ft2" "$BENCH/ft3" --base "$BENCH/base" --method ties -p density=0.2 -p scope=tensor -p merge=mean \
    --device cuda --out /tmp/prof-out --overwrite --quiet > "$OUT/profile_ties.txt" 2>&1
  grep -m1 "merged" "$OUT/profile_ties.txt"
  timeout 20 python3 - "$OUT/profile_ties.prof" >> "$OUT/profile_ties.txt" <<'PY' || echo "!! profile report failed"
import pstats, sys
st = pstats.Stats(sys.argv[1])
st.sort_stats("tottime").print_stats(40)
st.print_callers(r"torch.empty|_cuda_getDeviceCount|isfinite|is_available|device_count")
PY
  sed -n '/Ordered by/,$p' "$OUT/profile_ties.txt" | head -30
fi
echo "== done in $((SECONDS - START)) s; in $OUT: $(ls "$OUT" | tr '\n' ' ')"
sleep 1  # tee writes the last lines before the folder is collected
