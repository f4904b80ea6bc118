#!/usr/bin/env bash
# The GPU checks as one command for the workplace's device tool (one GPU; Python 3.12 and torch with CUDA there,
# no megatron-core). Prepare here, both listed in .git/info/exclude and named in the call's carry:
#   .whl/  the megatron-core cp312 wheel and pydantic with its dependencies (pip download, see the device README)
#   .mlm/  a Megatron-LM checkout (git --git-dir=<mirror> archive core_r0.16.0 | tar -x -C .mlm)
# then: bash scripts/device_checks.sh ["pytest -k expression"]   (default: every test in tests/gpu)
# The log goes to $OUT/gpu_tests.log; record the result (command, device, outcome) in docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_checks: could not install .whl/ (carry it)" >&2; exit 2; }
[ -f .mlm/pretrain_gpt.py ] || { echo "device_checks: no Megatron-LM checkout in .mlm/ (carry it)" >&2; exit 2; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 MEGATRON_LM_PATH="$PWD/.mlm"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
python3 -m pytest -v -rA tests/gpu ${1:+-k "$1"} 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
