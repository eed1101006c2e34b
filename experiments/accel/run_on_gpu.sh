#!/usr/bin/env bash
# The one command to run on the GPU machine (repository root, no network): put the carried wheels
# (experiments/accel/pack_wheels.sh) on the path beside the image's packages, then run the check with
# a hard timeout that leaves time for one rerun in the session's device minutes. Arguments go to
# gpu_check.py. The results file (experiments/results/gpu_check_<gpu>.md) and the log are also copied
# to $OUT when it is set (the device tool brings back what is under $OUT).
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE="${RLJAX_WHEEL_SITE:-/tmp/rljax-wheels}"
shopt -s nullglob
wheels=(experiments/accel/wheels/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "no wheels in experiments/accel/wheels/: run experiments/accel/pack_wheels.sh here first and carry the folder" >&2
  exit 2
fi
# --target: a plain folder on PYTHONPATH, whatever environment the image's python3 lives in
python3 -m pip install --quiet --no-index --no-deps --target "$SITE" "${wheels[@]}" || exit 2
# a rerun on the same (still warm) machine reuses the first run's compiled programs
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/rljax-jax-cache}"
LOG="${OUT:-/tmp}/gpu_check.log"
PYTHONPATH="$PWD:$SITE" timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-480}" \
  python3 experiments/accel/gpu_check.py "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  cp experiments/results/gpu_check_*.md "$OUT"/ 2>/dev/null || true
fi
echo "gpu_check exit status $rc (124: timed out; the results file holds the parts that finished)"
exit "$rc"
