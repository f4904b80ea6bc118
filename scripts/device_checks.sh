#!/usr/bin/env bash
# The GPU checks as one command for the workplace's device tool (one GPU; Python 3.12 and torch with CUDA there,
# no megatron-core). Prepare here, each listed in .git/info/exclude and named in the call's carry (23 MiB in all):
#   .whl/   for pkg in megatron-core==0.16.1 pydantic pydantic-core annotated-types typing-inspection typing-extensions;
#           do python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $pkg; done
#           (pydantic pins pydantic-core exactly: keep the pair pip picks together)
#           and nvidia-resiliency-ext 0.6.0 for Megatron's fault injector (not on PyPI; pure Python without its
#           CUPTI extension, built under Python 3.12 for a cp312 tag): git --git-dir=<mirror of
#           NVIDIA/nvidia-resiliency-ext> archive v0.6.0 | tar -x -C /tmp/nvrx; STRAGGLER_DET_SKIP_CUPTI_EXT_BUILD=1
#           POETRY_DYNAMIC_VERSIONING_BYPASS=0.6.0 <python3.12> -m pip wheel --no-deps /tmp/nvrx -w .whl
#           (what it imports there - torch, psutil, pynvml, yaml, httpx - is in the device image)
#   .mlm/   Megatron-LM core_r0.16.0 without its tests: git --git-dir=<mirror of NVIDIA/Megatron-LM> archive
#           core_r0.16.0 megatron pretrain_gpt.py gpt_builders.py model_provider.py | tar -x -C .mlm
#   .mlm18/ the same of core_r0.18.0 (its own megatron.core, first on the jobs' path): Megatron's fault injector's
#           device faults (tests/gpu/test_megatron_fault_injector.py; skipped without it)
# then: bash scripts/device_checks.sh ["pytest -k expression" [more pytest arguments]]   (default: every test in
# tests/gpu; "" selects every test too), e.g. bash scripts/device_checks.sh "" -n 6 --timeout 300 (pytest-xdist and
# pytest-timeout are in the device image; the tests use distinct ports and share the GPU fine)
# The log goes to $OUT/gpu_tests.log, each failure at once to $OUT/gpu_failures.log (a run stopped at its limit
# prints no summary); record the result (command, device, outcome) in docs/benchmarks.md.
# Timing (2026-11-28, H200, carry [".whl", ".mlm", ".mlm18"]): every test at once, eight at a time, took 315 s
# (the slowest, the shared-device Megatron-LM cases and GPU_SLEEP, about 170 s each); the machine's start and the
# transfers about 50 s. A session has 15 device minutes, the start included: one call, timeout_s 560,
#   timeout 530 bash scripts/device_checks.sh "" -n 8 --timeout 450
# leaves about 5 minutes to rerun what failed on the same warm machine, or for benchmarks/bench_gpu.py (222 s).
# A failed test's logs come back too, packed as $OUT/logs-<test>.tgz (tests/gpu/conftest.py).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_checks: could not install .whl/ (carry it)" >&2; exit 2; }
[ -f .mlm/pretrain_gpt.py ] || { echo "device_checks: no Megatron-LM checkout in .mlm/ (carry it)" >&2; exit 2; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 MEGATRON_LM_PATH="$PWD/.mlm" ODYSSEY_GPU_FAILURES="${OUT:-/tmp}/gpu_failures.log"
[ -f .mlm18/pretrain_gpt.py ] && export MEGATRON_LM_CHECKOUTS="$PWD/.mlm18"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
python3 -c "import nvidia_resiliency_ext as n; print('nvidia-resiliency-ext', n.__version__)" 2>/dev/null \
  || echo "device_checks: no nvidia-resiliency-ext in .whl/: Megatron's fault injector tests skip"
k="${1:-}"; shift $(( $# > 0 ))
python3 -m pytest -v -rA --durations=0 tests/gpu ${k:+-k "$k"} "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
