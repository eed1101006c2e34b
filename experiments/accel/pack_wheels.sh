#!/usr/bin/env bash
# Download the pure-Python wheels rljax needs that the GPU machine's image lacks, into the git-ignored
# experiments/accel/wheels/, for that machine's Python 3.12 (it has no network; the folder travels in
# the run's `carry` list). The image has jax, jaxlib + the CUDA plugin, flax, optax, orbax-checkpoint,
# chex, transformers (tokenizers, safetensors, huggingface-hub, numpy, pyyaml, tqdm), peft, torch
# (jinja2, sympy), triton and pytest. Of pyproject's dependencies that leaves:
#   omegaconf (+ antlr4-python3-runtime)  rljax.config imports it: needed by everything
#   gguf                                  rljax.models.gguf_io imports it at load
#   tensorboardX                          metrics logging (protobuf comes with the image's orbax)
#   math-verify (+ latex2sympy2_extended) answer rewards with use_math_verify
#   vaderSentiment                        the sentiment reward
# Not packed: datasets (Hub datasets; brings pyarrow, a 40 MB binary wheel; .jsonl / .json data are read
# without it), reasoning-gym (reasoning-gym tasks; a dozen dependencies, some compiled), matplotlib
# (plots; compiled): the check uses none of them.
# Versions: the ones `pip install` resolved for a jax 0.11.2 venv on Python 3.12 here.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DEST="$HERE/wheels"
LIMIT_MIB=64  # the device machine's carry limit: working tree + carried files
mkdir -p "$DEST"
pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --implementation cp --abi cp312 -d "$DEST" \
  "omegaconf==2.4.0" "antlr4-python3-runtime==4.13.2" "gguf==0.19.0" "tensorboardX==2.6.5" \
  "math-verify==0.9.0" "latex2sympy2_extended==1.11.0" "vaderSentiment==3.3.2"
ROOT="$(cd "$HERE/../.." && pwd)"
wheels=$(du -sb "$DEST" | cut -f1)
tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((wheels + tree))
echo "wheels: $(ls "$DEST" | wc -l) files, $((wheels / 1024)) KiB; working tree: $((tree / 1024)) KiB; total $((total / 1024)) KiB of $((LIMIT_MIB * 1024)) KiB"
if [ "$total" -ge $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "over the ${LIMIT_MIB} MiB carry limit" >&2
  exit 1
fi
