#!/usr/bin/env bash
# Llama-2-7B pre-training with Odyssey on Ascend 910B NPUs (HCCL) through MindSpeed.
#
# Prerequisites: CANN + torch_npu installed; MindSpeed (core) installed next to the Megatron-LM branch its
# README names (Odyssey supports core_r0.12.0 to core_r0.19.0 and main); patches/pretrain_gpt.<branch>.patch
# applied (it imports mindspeed.megatron_adaptor first, then megatron_odyssey.megatron_adaptor).
#
#   MEGATRON_LM=/path/to/Megatron-LM DATA_PREFIX=/data/llama2/redpajama_text_document \
#   TOKENIZER_MODEL=/models/Llama-2-7b-hf/tokenizer.model NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 \
#   examples/llama2/pretrain_llama2_7b_ascend.sh
#
# Default layout: 16 NPUs (2 x 8) as TP=2 x PP=2 x DP=4. Odyssey runs the ranks' new process groups
# on HCCL (torch_npu's backend for the npu device); Megatron's --distributed-backend stays "nccl",
# which MindSpeed maps to HCCL.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout with patches/pretrain_gpt.<branch>.patch applied}"
: "${DATA_PREFIX:?set DATA_PREFIX to the indexed dataset prefix (see examples/llama2/README.md)}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to Llama-2 tokenizer.model}"
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then
  # shellcheck disable=SC1091
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
fi
TP=${TP:-2}
PP=${PP:-2}
GBS=${GBS:-256}
MBS=${MBS:-1}
ITERS=${ITERS:-250000}
CKPT=${CKPT:-checkpoints/llama2-7b-npu}
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NPROC_PER_NODE=${NPROC_PER_NODE:-8}
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-600}
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-600}
export ODYSSEY_DEVICE=npu                   # the accelerator shim imports torch_npu lazily

MODEL=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
  --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
)
MINDSPEED=(
  --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb --use-flash-attn
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --transformer-impl local
)
TRAINING=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
  --use-distributed-optimizer --num-distributed-optimizer-instances 2   # every Adam shard on two ranks
  --overlap-grad-reduce --overlap-param-gather
  --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --data-path "$DATA_PREFIX" --split 990,8,2
  --save "$CKPT" --load "$CKPT" --save-interval 1000
  --log-interval 10 --eval-iters 10 --eval-interval 1000   # evaluates in any layout after a failure
  --tensorboard-dir "$CKPT/tensorboard" --log-throughput   # the writer moves to the last live rank after a failure
  --distributed-backend nccl --distributed-timeout-minutes 10
)
ODYSSEY=(
  --odyssey --odyssey-policy auto --odyssey-max-cached-failures 1
  --odyssey-heartbeat-timeout 60 --odyssey-profile-iters 10 --odyssey-report odyssey-report.json
)
cd "$MEGATRON_LM"
exec "$HERE/../../scripts/odyssey_launch.sh" pretrain_gpt.py "${MODEL[@]}" "${MINDSPEED[@]}" "${TRAINING[@]}" "${ODYSSEY[@]}" "$@"
