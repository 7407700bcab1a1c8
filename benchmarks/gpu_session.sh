#!/usr/bin/env bash
# What a session with a GPU should check, in few calls (device time is short and a fresh machine
# costs minutes). Part `attention`: the compiled Hopper kernels against float64 (windows and
# soft-caps included), speed against cuDNN and XLA, block shapes, sliding windows against cuDNN's.
# Part `training`: the MoE layer and training-step MFU by attention. Part `numerics`: FP8 (per-tensor and row
# scales) and int8 against bfloat16 matmuls, tokens/s on llama-1b, and FP8 on a 16-layer Llama-3-8B slice that fits
# one GPU (target 1.25x). Part `memory`: what host offload costs a step (the optimizer state, the layer stack's
# parameters with it, each layer's input)
# on llama-1b and a 16-layer Llama-3-8B slice, against the same steps on the device.
# Usage, from the repository root: bash benchmarks/gpu_session.sh attention|training|numerics|memory|all
# Packages the GPU image lacks (pydantic, tensorboardX) travel as wheels in .whl/ (see
# docs/benchmarks.md); results land in docs/benchmarks.md and, when $OUT is set, it and the log there.
set -uo pipefail
part="${1:-all}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
log="${OUT:-/tmp}/gpu_session_${part}.log"
status=0
run() { echo "=== $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log" || status=1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$log"
if [ "$part" = attention ] || [ "$part" = all ]; then
  JAX_PLATFORMS=cuda run python3 -m pytest -q -p no:cacheprovider tests/test_flash_attention_gpu.py -k compiled
  run python3 benchmarks/attention.py --record
  run python3 benchmarks/attention.py --record --sweep 8192
  run python3 benchmarks/attention.py --record --windows 1024 4096  # 8k and 16k tokens, against cuDNN's window
fi
if [ "$part" = training ] || [ "$part" = all ]; then
  run python3 benchmarks/moe.py --record --rounds 3
  run python3 benchmarks/mfu.py --record --batch 4  # 8 x 4096 tokens of llama-1b run out of memory on an 80 GB H100
fi
if [ "$part" = numerics ] || [ "$part" = all ]; then
  run python3 benchmarks/mfu.py --record --batch 4 --impls cudnn --matmuls default fp8 fp8-row int8
  run python3 benchmarks/mfu.py --record --model llama3-8b --layers 16 --batch 2 --impls cudnn --matmuls default fp8
fi
if [ "$part" = memory ] || [ "$part" = all ]; then
  run python3 benchmarks/mfu.py --record --batch 4 --impls cudnn --offload none optimizer params layer_inputs
  run python3 benchmarks/mfu.py --record --model llama3-8b --layers 16 --batch 2 --impls cudnn --offload none optimizer \
    params
fi
if [ -n "${OUT:-}" ]; then cp docs/benchmarks.md "$OUT/"; fi
exit $status
