# Sourced by gpu_session.sh and gpu_before_after.sh, from the repository root: the log, the clock and the carried
# wheels, the same way in both. Sets OUT (the device tool's output folder; else /tmp/gpu-out), START, left() (the
# seconds TOTAL_S leaves) and SITE (where the wheels went; empty when none were carried or their install failed).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
START=$SECONDS
left() { echo $(( TOTAL_S - (SECONDS - START) )); }
echo "== $(date -u) $(basename "$0") in $PWD, git $(git rev-parse --short HEAD 2>/dev/null || echo '?') + $(git status --short 2>/dev/null | wc -l) changed file(s)"

# install_wheels RUNNER...: the wheels the call carried (.whl/: packages the image lacks, such as mergekit) into
# /tmp/site, the pip command run under RUNNER (`timeout 150`, or a script's own step wrapper)
install_wheels() {
  SITE=""
  if ! compgen -G ".whl/*.whl" > /dev/null; then
    echo "!! no .whl/*.whl: mergekit must be importable already (else its rows fail)"; return 0
  fi
  echo "== the carried wheels: $(ls .whl | tr '\n' ' ')"
  if "$@" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl; then SITE="/tmp/site"; else echo "!! wheel install failed (rc=$?)"; fi
}

# modules are compiled once before anything is timed, as an installed package's are: the image sets
# PYTHONDONTWRITEBYTECODE, so every process would compile what it imports (~2.5 s of each run's start)
echo "PYTHONDONTWRITEBYTECODE was ${PYTHONDONTWRITEBYTECODE-unset}"; unset PYTHONDONTWRITEBYTECODE
