#!/usr/bin/env bash
# On a machine with a GPU: the CUDA suite (tests/gpu), then a short round
# benchmark with CUDA ranks (bench/round.py --device cuda). It needs Python with
# a CUDA build of torch and this package installed with its test extra
# (pip install -e '.[test]'); scripts/setup.sh installs the CPU build, so give
# the interpreter: PYTHON=/path/to/python bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "scripts/gpu-check.sh: $PY has no usable CUDA (torch.cuda.is_available() is False): run it on a GPU machine" \
       "with a CUDA build of torch (PYTHON=...)" >&2
  exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name(0))'
"$PY" -m pytest -q -rs tests/gpu
"$PY" bench/round.py --device cuda --sizes 1M,10M --dtypes f32,bf16 --rounds 5 --warmup 2 --repeats 1
