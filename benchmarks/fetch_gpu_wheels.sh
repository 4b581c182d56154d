#!/usr/bin/env bash
# Download the wheels that the H200 image lacks (it has torch/transformers/accelerate/safetensors, no
# registry access) into .whl/ (git-ignored), for Python 3.12 on x86-64 Linux. On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${PY:-.venv/bin/python}
platform_args=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps "${platform_args[@]}" -d .whl \
  datasets==5.2.0 'dill<0.4.2' 'multiprocess<0.70.20' einops hjson msgpack ninja py-cpuinfo pydantic pydantic-core annotated-types typing-inspection typing-extensions
# deepspeed ships only as a source archive: build a pure-Python wheel (its ops compile just in time).
ls .whl/deepspeed-*.whl >/dev/null 2>&1 || "$PY" -m pip wheel -q --no-deps -w .whl deepspeed
ls -la .whl
