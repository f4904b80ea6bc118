#!/usr/bin/env bash
# The GPU checks as one command for the workplace's device tool (one GPU; Python 3.12 and torch with CUDA there,
# no megatron-core). Prepare here, both listed in .git/info/exclude and named in the call's carry (13 MiB):
#   .whl/  for pkg in megatron-core==0.16.1 pydantic pydantic-core annotated-types typing-inspection typing-extensions;
#          do python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $pkg; done
#          (pydantic pins pydantic-core exactly: keep the pair pip picks together)
#   .mlm/  Megatron-LM core_r0.16.0 without its tests: git --git-dir=<mirror of NVIDIA/Megatron-LM> archive
#          core_r0.16.0 megatron pretrain_gpt.py gpt_builders.py model_provider.py | tar -x -C .mlm
# then: bash scripts/device_checks.sh ["pytest -k expression" [more pytest arguments]]   (default: every test in
# tests/gpu; "" selects every test too), e.g. bash scripts/device_checks.sh "" -n 6 --timeout 300 (pytest-xdist and
# pytest-timeout are in the device image; the tests use distinct ports and share the GPU fine)
# The log goes to $OUT/gpu_tests.log, each failure at once to $OUT/gpu_failures.log (a run stopped at its limit
# prints no summary); record the result (command, device, outcome) in docs/benchmarks.md.
# Timing (2026-11-26, H100, 6 workers): the eight lighter tests take about 4 min together; each shared-device
# Megatron-LM case runs stock then Odyssey, over 2 min each under that load. A session has 15 device minutes, the
# machine's start included: one call, e.g. run with timeout_s 560:
#   timeout 530 bash scripts/device_checks.sh "" -n 7 --timeout 400
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_checks: could not install .whl/ (carry it)" >&2; exit 2; }
[ -f .mlm/pretrain_gpt.py ] || { echo "device_checks: no Megatron-LM checkout in .mlm/ (carry it)" >&2; exit 2; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 MEGATRON_LM_PATH="$PWD/.mlm" ODYSSEY_GPU_FAILURES="${OUT:-/tmp}/gpu_failures.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
k="${1:-}"; shift $(( $# > 0 ))
python3 -m pytest -v -rA --durations=0 tests/gpu ${k:+-k "$k"} "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
