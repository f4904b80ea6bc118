#!/usr/bin/env bash
# Llama-2-7B pre-training with Odyssey on NVIDIA GPUs (NCCL), Megatron-LM core_r0.19.0.
#
# Run the same command on every machine (see scripts/odyssey_launch.sh for NNODES/NODE_RANK/MASTER_ADDR):
#   MEGATRON_LM=/path/to/Megatron-LM DATA_PREFIX=/data/llama2/redpajama_text_document \
#   TOKENIZER_MODEL=/models/Llama-2-7b-hf/tokenizer.model NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 \
#   examples/llama2/pretrain_llama2_7b_gpu.sh
#
# Default layout: 16 GPUs (2 x 8) as TP=2 x PP=2 x DP=4. DP >= 2 is what rerouting needs (a failed
# node's micro-batches go to its data-parallel twins); with DP=1 only re-arranging pipelines or a
# restart remain. The distributed optimizer runs in two instances of two ranks, so every shard of the
# Adam state survives any single failure: 6 + 12 x 2 / 4 = 12 bytes/parameter of static memory until the
# first failure; after it each layer's state stays sharded over its holders h, every shard on two of them
# (6 + 24 / h: 14 with a stage's three survivors, 12 with four); 1.7 B parameters per GPU here (about 20 GB,
# 24 GB on a rerouted stage). Gradient reduction overlaps backward, also after a failure (per layer); the
# weight all-gather overlaps the next forward until the first failure (after it each rebuilt stage gathers its
# shards right after the step). With two instances and --overlap-grad-reduce stock Megatron-LM reduces each
# step's gradients twice under pipeline parallelism; with --odyssey they are reduced once (README, Production flags).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout with patches/pretrain_gpt.core_r0.19.0.patch applied}"
: "${DATA_PREFIX:?set DATA_PREFIX to the indexed dataset prefix (see examples/llama2/README.md)}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to Llama-2 tokenizer.model}"
TP=${TP:-2}
PP=${PP:-2}
GBS=${GBS:-256}
MBS=${MBS:-1}
ITERS=${ITERS:-250000}
CKPT=${CKPT:-checkpoints/llama2-7b}
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NPROC_PER_NODE=${NPROC_PER_NODE:-8}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a collective with a dead peer raises instead of hanging

MODEL=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
  --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
)
TRAINING=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
  --use-distributed-optimizer --num-distributed-optimizer-instances 2   # every Adam shard on two ranks
  --overlap-grad-reduce --overlap-param-gather
  --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --bf16 --transformer-impl transformer_engine --attention-backend auto
  --recompute-granularity selective
  --data-path "$DATA_PREFIX" --split 990,8,2
  --save "$CKPT" --load "$CKPT" --save-interval 1000
  --log-interval 10 --eval-iters 10 --eval-interval 1000   # evaluates in any layout after a failure
  --tensorboard-dir "$CKPT/tensorboard" --log-throughput   # the writer moves to the last live rank after a failure
  --distributed-backend nccl --distributed-timeout-minutes 10
)
ODYSSEY=(
  --odyssey                                # reroute or re-arrange pipelines in-process after a failure
  --odyssey-policy auto                    # the performance model chooses per failure
  --odyssey-max-cached-failures 1          # every single failure's plan is precomputed
  --odyssey-heartbeat-timeout 60           # a rank silent this long is declared hung and fenced
  --odyssey-profile-iters 10               # plan from measured layer times after 10 iterations
  --odyssey-report odyssey-report.json
)
cd "$MEGATRON_LM"
exec "$HERE/../../scripts/odyssey_launch.sh" pretrain_gpt.py "${MODEL[@]}" "${TRAINING[@]}" "${ODYSSEY[@]}" "$@"
