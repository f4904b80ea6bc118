"""Llama-2-style megatron-core ``GPTModel`` for one pipeline stage holding any layer range.

Odyssey re-arranges survivors into pipelines of different lengths and layer splits, so a stage
must hold an *arbitrary* contiguous range ``[start, end)`` of the ``L`` transformer layers, not
only Megatron's uniform split. megatron-core 0.16.1 derives a stage's layer offset from
``parallel_state``/``pg_collection.pp`` plus a uniform split (or first/last-stage overrides, or a
``pipeline_model_parallel_layout`` tied to the PP rank), none of which expresses "this process
holds layers 3..6 of pipeline #2 in a plan of pipelines [2, 2, 3]". We therefore build each stage
as a self-contained ``GPTModel`` whose config says ``num_layers = end - start`` and
``pipeline_model_parallel_size = 1`` (offset 0), and then renumber every layer's
``layer_number`` to its global (1-based) number, so the modules know who they are.

Everything that must be plan-independent works on *global names*:
``embedding.word_embeddings.weight``, ``decoder.layers.{k}.<...>`` with the global layer index
``k``, ``decoder.final_layernorm.weight``, ``output_layer.weight``, holding the *full*
(tensor-parallel-unsharded) tensors. Initial weights are a pure function of
``(seed, global layer index, parameter name)``, so layer ``k`` starts identical whichever plan,
stage or TP degree builds it.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

try:  # megatron-core is an optional ("runtime") dependency of the package.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
except ModuleNotFoundError as _exc:  # pragma: no cover - exercised only without megatron-core
    if _exc.name not in ("megatron", "megatron.core"):
        raise  # megatron-core is there but lacks a name (a release we do not know): show the real cause
    raise ImportError(
        "megatron_odyssey.runtime.model needs megatron-core: pip install 'megatron-odyssey[runtime]'"
    ) from _exc
if TYPE_CHECKING:  # megatron-core 0.15+; a Megatron-LM 0.12-0.14 checkout's own core has ModelCommProcessGroups
    from megatron.core.process_groups_config import ProcessGroupCollection


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the whole (unsplit) Llama-2-style model; defaults are test-sized.

    ``vocab_size`` is the model's (padded) vocabulary; it must be divisible by the TP degree
    (Megatron's VocabParallelEmbedding shards rows evenly). The byte tokenizer of
    :mod:`megatron_odyssey.runtime.data` needs at least 258.
    """

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int = 128
    seq_length: int = 32
    vocab_size: int = 320
    seed: int = 1234
    num_query_groups: Optional[int] = None  # None: multi-head attention (Llama-2 7B/13B)
    init_method_std: float = 0.02
    norm_epsilon: float = 1e-5
    rotary_base: int = 10000
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_layers < 1:
            raise ValueError("num_layers must be >= 1")

    @property
    def kv_channels(self) -> int:
        """Per-head dimension."""
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Number of key/value heads."""
        return self.num_query_groups or self.num_attention_heads


def pad_vocab_size(vocab_size: int, divisible_by: int = 64, tp_size: int = 1) -> int:
    """Round ``vocab_size`` up like Megatron-LM (``--make-vocab-size-divisible-by`` x TP)."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def make_transformer_config(cfg: ModelConfig, num_layers: int, tp_size: int = 1) -> TransformerConfig:
    """megatron-core ``TransformerConfig`` for a stage of ``num_layers`` layers.

    Llama-2: RMSNorm, SwiGLU (gated SiLU), no linear bias, fp32, local (non-TE) kernels.
    ``perform_initialization=False``: megatron's own init would draw full master weights only
    for us to overwrite them with the plan-independent ones (:meth:`StageGPTModel.reset_parameters`).
    ``pipeline_model_parallel_size=1`` makes megatron's layer offset 0; see the module docstring.
    Fusions that need CUDA kernels or ``torch.compile`` are off, so CPU and GPU run the same math.
    """
    if cfg.vocab_size % tp_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} not divisible by TP size {tp_size}")
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.kv_channels,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


# --------------------------------------------------------------------------------------------
# Global names
# --------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_WRAPPER_PREFIX = "module."


def strip_wrapper_prefix(name: str) -> str:
    """Drop the ``module.`` prefixes that DDP / Float16Module wrappers add."""
    while name.startswith(_WRAPPER_PREFIX):
        name = name[len(_WRAPPER_PREFIX):]
    return name


def global_layer_index(global_name: str) -> Optional[int]:
    """Global transformer-layer index of a name, or None for embedding/final norm/output."""
    m = _LAYER_RE.match(strip_wrapper_prefix(global_name))
    return int(m.group(1)) if m else None


def to_global_name(local_name: str, layer_start: int) -> str:
    """Stage-local state-dict name -> plan-independent global name."""
    name = strip_wrapper_prefix(local_name)
    m = _LAYER_RE.match(name)
    if m is None:
        return name
    return f"decoder.layers.{int(m.group(1)) + layer_start}.{m.group(2)}"


def to_local_name(
    global_name: str, layer_start: int, layer_end: int, pre_process: bool, post_process: bool
) -> Optional[str]:
    """Global name -> this stage's local name, or None when the stage does not hold it."""
    m = _LAYER_RE.match(global_name)
    if m is not None:
        k = int(m.group(1))
        if layer_start <= k < layer_end:
            return f"decoder.layers.{k - layer_start}.{m.group(2)}"
        return None
    if global_name.startswith("embedding."):
        return global_name if pre_process else None
    if global_name.startswith("decoder.final_layernorm.") or global_name.startswith("output_layer."):
        return global_name if post_process else None
    return global_name


def full_parameter_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Global name -> full (unsharded) shape of every parameter of the whole model, in order."""
    h, ffn, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.kv_channels
    shapes: Dict[str, Tuple[int, ...]] = {"embedding.word_embeddings.weight": (v, h)}
    for k in range(cfg.num_layers):
        p = f"decoder.layers.{k}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attention.linear_proj.weight"] = (h, cfg.num_attention_heads * cfg.kv_channels)
        shapes[p + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        shapes[p + "mlp.linear_fc1.weight"] = (2 * ffn, h)
        shapes[p + "mlp.linear_fc2.weight"] = (h, ffn)
    shapes["decoder.final_layernorm.weight"] = (h,)
    shapes["output_layer.weight"] = (v, h)
    return shapes


# --------------------------------------------------------------------------------------------
# Tensor-parallel layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPPartition:
    """How megatron shards a parameter over the TP group.

    ``dim`` None means replicated. ``gated`` marks SwiGLU ``linear_fc1``: its full tensor is
    ``[gate; up]`` but each TP shard stores ``[gate_shard; up_shard]`` (the MLP chunks the
    *local* output in two), so shards are not contiguous slices of the full tensor.
    """

    dim: Optional[int]
    gated: bool = False


_REPLICATED = TPPartition(None)
_PARTITION_RULES: Tuple[Tuple[str, TPPartition], ...] = (
    ("embedding.word_embeddings.weight", TPPartition(0)),  # VocabParallelEmbedding: vocab rows
    ("output_layer.weight", TPPartition(0)),  # ColumnParallelLinear: vocab rows
    ("self_attention.linear_qkv.weight", TPPartition(0)),  # column parallel; groups contiguous
    ("self_attention.linear_qkv.bias", TPPartition(0)),
    ("self_attention.linear_proj.weight", TPPartition(1)),  # RowParallelLinear: input columns
    ("mlp.linear_fc1.weight", TPPartition(0, gated=True)),
    ("mlp.linear_fc1.bias", TPPartition(0, gated=True)),
    ("mlp.linear_fc2.weight", TPPartition(1)),
)


def tp_partition(global_name: str) -> TPPartition:
    """The TP layout of a parameter, from its name (row-parallel biases, norms: replicated)."""
    name = strip_wrapper_prefix(global_name)
    for suffix, part in _PARTITION_RULES:
        if name.endswith(suffix):
            return part
    return _REPLICATED


def scatter_tp_tensor(global_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of a full tensor (pure slicing, no communication)."""
    part = tp_partition(global_name)
    if part.dim is None or tp_size == 1:
        return full
    if full.shape[part.dim] % (2 * tp_size if part.gated else tp_size):
        raise ValueError(f"{global_name}: dim {part.dim} of {tuple(full.shape)} not divisible by TP {tp_size}")
    if part.gated:
        gate, up = torch.chunk(full, 2, dim=part.dim)
        return torch.cat(
            [torch.chunk(gate, tp_size, dim=part.dim)[tp_rank], torch.chunk(up, tp_size, dim=part.dim)[tp_rank]],
            dim=part.dim,
        )
    return torch.chunk(full, tp_size, dim=part.dim)[tp_rank]


def merge_tp_shards(global_name: str, shards: List[torch.Tensor]) -> torch.Tensor:
    """Full tensor from all TP shards in TP-rank order (inverse of :func:`scatter_tp_tensor`)."""
    part = tp_partition(global_name)
    if part.dim is None or len(shards) == 1:
        return shards[0]
    if part.gated:
        halves = [torch.chunk(s, 2, dim=part.dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=part.dim)
    return torch.cat(shards, dim=part.dim)


def gather_tp_tensor(
    global_name: str, shard: torch.Tensor, tp_group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """All-gather a parameter's shards over ``tp_group`` into the full tensor (every TP rank gets it)."""
    part = tp_partition(global_name)
    if tp_group is None or part.dim is None or dist.get_world_size(tp_group) == 1:
        return shard
    shard = shard.detach().contiguous()
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, shard, group=tp_group)
    return merge_tp_shards(global_name, shards)


# --------------------------------------------------------------------------------------------
# Deterministic initialisation
# --------------------------------------------------------------------------------------------


def param_seed(seed: int, layer_index: Optional[int], param_name: str) -> int:
    """Seed for one parameter from (model seed, global layer index or None, name within layer).

    A cryptographic hash rather than ``hash()``: stable across processes and Python versions.
    """
    key = f"{seed}|{-1 if layer_index is None else layer_index}|{param_name}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def _name_within_layer(global_name: str) -> Tuple[Optional[int], str]:
    m = _LAYER_RE.match(global_name)
    if m is None:
        return None, global_name
    return int(m.group(1)), m.group(2)


def init_full_tensor(cfg: ModelConfig, global_name: str, shape: Tuple[int, ...]) -> torch.Tensor:
    """The initial full tensor of a parameter, a pure function of (cfg.seed, layer, name).

    Megatron/Llama scheme: norms = 1, biases = 0, weights ~ N(0, std), with the residual-branch
    output projections (``linear_proj``, ``linear_fc2``) scaled by 1/sqrt(2 L).
    Uses a private generator, so building a model never disturbs the global RNG streams.
    """
    layer, name = _name_within_layer(global_name)
    if "layernorm" in name or name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float32)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.float32)
    std = cfg.init_method_std
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * cfg.num_layers)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(param_seed(cfg.seed, layer, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def initial_full_state_dict(cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """The whole model's initial parameters by global name (what any plan starts from)."""
    return {n: init_full_tensor(cfg, n, s) for n, s in full_parameter_shapes(cfg).items()}


# --------------------------------------------------------------------------------------------
# Stage model
# --------------------------------------------------------------------------------------------


def _tp_group_of(pg_collection: Optional[ProcessGroupCollection]) -> Optional[dist.ProcessGroup]:
    if pg_collection is not None:
        return getattr(pg_collection, "tp", None)
    from megatron.core import parallel_state

    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


class StageGPTModel(GPTModel):
    """A ``GPTModel`` holding global transformer layers ``[layer_start, layer_end)``.

    ``pre_process`` (embedding) defaults to ``layer_start == 0`` and ``post_process`` (final
    norm + output layer) to ``layer_end == num_layers``. Non-first stages take their input via
    ``set_input_tensor`` (as in megatron's schedules); with labels, the last stage returns the
    per-token loss ``[b, s]``, otherwise the stage returns hidden states ``[s, b, h]``.
    Process groups: ``pg_collection`` when given (``tp``, ``cp``, ``pp``, ``embd`` used), else
    megatron's ``parallel_state`` groups. Note megatron 0.16's
    ``tensor_parallel.vocab_parallel_cross_entropy`` always uses ``parallel_state``'s TP group.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_start: int,
        layer_end: int,
        *,
        pre_process: Optional[bool] = None,
        post_process: Optional[bool] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        initialize: bool = True,
    ) -> None:
        if not 0 <= layer_start < layer_end <= cfg.num_layers:
            raise ValueError(f"bad layer range [{layer_start}, {layer_end}) for {cfg.num_layers} layers")
        tp_group = _tp_group_of(pg_collection)
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        tconfig = make_transformer_config(cfg, layer_end - layer_start, tp_size)
        pre = layer_start == 0 if pre_process is None else pre_process
        post = layer_end == cfg.num_layers if post_process is None else post_process
        super().__init__(
            config=tconfig,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=cfg.rotary_base,
            pg_collection=pg_collection,
        )
        self.model_config = cfg
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.tp_size = tp_size
        self._tp_group = tp_group
        for i, layer in enumerate(self.decoder.layers):
            _set_layer_number(layer, layer_start + i + 1)
        self._mark_tp_attributes()
        if initialize:
            self.reset_parameters()

    # -- names ---------------------------------------------------------------------------

    def global_name(self, local_name: str) -> str:
        """Local parameter/state name -> global name."""
        return to_global_name(local_name, self.layer_start)

    def local_name(self, global_name: str) -> Optional[str]:
        """Global name -> local name, or None when this stage does not hold it."""
        return to_local_name(global_name, self.layer_start, self.layer_end, self.pre_process, self.post_process)

    def named_global_parameters(self) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        """(global name, local parameter shard) for every parameter of the stage."""
        for name, p in self.named_parameters():
            yield self.global_name(name), p

    def global_layer_indices(self) -> List[int]:
        """Global indices of the transformer layers this stage holds."""
        return list(range(self.layer_start, self.layer_end))

    def _mark_tp_attributes(self) -> None:
        """Set megatron's ``tensor_model_parallel``/``partition_dim``/``partition_stride``.

        megatron sets them only inside its own initialisation, which we skip
        (``perform_initialization=False``); its optimizer and grad-norm code
        (``param_is_not_tensor_parallel_duplicate``) rely on them. Values match what megatron
        itself sets, including ``partition_stride=2`` for the gated ``linear_fc1``.
        """
        for gname, p in self.named_global_parameters():
            part = tp_partition(gname)
            if part.dim is None:
                defaults = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}
            else:
                defaults = {
                    "tensor_model_parallel": True,
                    "partition_dim": part.dim,
                    "partition_stride": 2 if part.gated else 1,
                }
            for attr, value in defaults.items():
                if not hasattr(p, attr):
                    setattr(p, attr, value)

    # -- state ---------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Set every parameter to its plan-independent initial value (this rank's TP shard)."""
        for gname, p in self.named_global_parameters():
            full_shape = list(p.shape)
            part = tp_partition(gname)
            if part.dim is not None:
                full_shape[part.dim] *= self.tp_size
            full = init_full_tensor(self.model_config, gname, tuple(full_shape))
            p.copy_(scatter_tp_tensor(gname, full, self.tp_rank, self.tp_size))

    @torch.no_grad()
    def global_state_dict(self, gather: bool = True) -> Dict[str, torch.Tensor]:
        """Parameters by global name, detached fp32 copies; full tensors when ``gather``
        (a collective over the TP group: every TP rank must call it), else local shards."""
        out: Dict[str, torch.Tensor] = {}
        for gname, p in self.named_global_parameters():
            t = gather_tp_tensor(gname, p, self._tp_group) if gather else p
            out[gname] = t.detach().float().clone()
        return out

    @torch.no_grad()
    def global_grads(self, gather: bool = True, attr: str = "grad") -> Dict[str, torch.Tensor]:
        """Gradients by global name (``attr``: ``grad``, or ``main_grad`` under megatron DDP).

        Parameters without a gradient get zeros, so every TP rank joins the same collectives.
        """
        out: Dict[str, torch.Tensor] = {}
        for gname, p in self.named_global_parameters():
            g = getattr(p, attr, None)
            g = torch.zeros_like(p) if g is None else g
            t = gather_tp_tensor(gname, g, self._tp_group) if gather else g
            out[gname] = t.detach().float().clone()
        return out

    @torch.no_grad()
    def load_global_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> List[str]:
        """Copy full tensors (global names) into this stage's shards; names for other stages are
        ignored. Returns the global names of this stage's parameters that were missing
        (raises instead when ``strict``)."""
        missing: List[str] = []
        for gname, p in self.named_global_parameters():
            if gname not in state:
                missing.append(gname)
                continue
            shard = scatter_tp_tensor(gname, state[gname], self.tp_rank, self.tp_size)
            if shard.shape != p.shape:
                raise ValueError(f"{gname}: shard {tuple(shard.shape)} vs parameter {tuple(p.shape)}")
            p.copy_(shard)
        if strict and missing:
            raise KeyError(f"missing parameters for stage [{self.layer_start}, {self.layer_end}): {missing}")
        return missing


def _set_layer_number(layer: torch.nn.Module, number: int) -> None:
    """Give a transformer layer (and its attention modules) its global 1-based number."""
    layer.layer_number = number
    attn = getattr(layer, "self_attention", None)
    if attn is not None and hasattr(attn, "layer_number"):
        attn.layer_number = number
        core = getattr(attn, "core_attention", None)
        if core is not None and hasattr(core, "layer_number"):
            core.layer_number = max(1, number)
    mlp = getattr(layer, "mlp", None)
    if mlp is not None and hasattr(mlp, "set_layer_number"):
        mlp.set_layer_number(number)


def build_stage_model(
    cfg: ModelConfig,
    layer_start: int,
    layer_end: int,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
    initialize: bool = True,
) -> StageGPTModel:
    """Build the stage holding global layers ``[layer_start, layer_end)`` (see :class:`StageGPTModel`)."""
    return StageGPTModel(
        cfg,
        layer_start,
        layer_end,
        pre_process=pre_process,
        post_process=post_process,
        pg_collection=pg_collection,
        initialize=initialize,
    )


def masked_lm_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the per-token loss over the tokens where ``loss_mask`` is 1 (Megatron's lm loss)."""
    mask = loss_mask.to(per_token_loss.dtype).reshape(-1)
    return (per_token_loss.reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)


def stage_forward(
    model: StageGPTModel,
    batch: Mapping[str, torch.Tensor],
    input_tensor: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Run one micro-batch through a stage: hidden states ``[s, b, h]`` out, or, on the last
    stage, the per-token loss ``[b, s]``. ``input_tensor`` feeds a non-first stage."""
    if not model.pre_process:
        if input_tensor is None:
            raise ValueError("a stage without the embedding needs input_tensor")
        model.set_input_tensor(input_tensor)
    return model(
        input_ids=batch["tokens"] if model.pre_process else None,
        position_ids=batch["position_ids"] if model.pre_process else None,
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"] if model.post_process else None,
    )

