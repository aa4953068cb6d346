"""LLaMA model configuration: the ``model.model_config`` section of a run YAML.

Shapes follow Meta's reference implementation (``llama/model.py``, ``ModelArgs``) and the Hugging
Face ``LlamaConfig`` (``transformers/models/llama/configuration_llama.py``). Where the two name
a field differently, msllm uses the MindFormers YAML name and notes the HF one.

The model config describes the model only: MindFormers' LlamaConfig also carries decoding keys
(``top_k``, ``use_past`` ...) and ``pet_config`` (LoRA); a run YAML may keep them there, and
:func:`msllm.config.load_config` moves them into the run config's own ``generation_config`` and
``pet_config`` sections (:mod:`msllm.compat.mindformers`).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Optional, Union

from msllm.errors import MsllmError
from msllm.models.llama.families import HIDDEN_ACTS, family
from msllm.models.llama.quantization import QuantizationConfig

# dtypes a config may name; the model maps them to MindSpore dtypes.
DTYPES = ("float32", "float16", "bfloat16")


def llama_intermediate_size(hidden_size: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """SwiGLU hidden width as in Meta's LLaMA-2 ``FeedForward.__init__``.

    ``4 * hidden`` scaled by 2/3 (SwiGLU has three matrices instead of two), then by
    ``ffn_dim_multiplier`` if given, rounded up to a multiple of ``multiple_of``.
    7B: 4096 -> 11008; 13B: 5120 -> 13824; 70B (x1.3, multiple_of 4096): 8192 -> 28672.
    """
    hidden = int(2 * (4 * hidden_size) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# rotary scaling kinds msllm implements (:func:`msllm.models.llama.rotary.rotary_tables`) and the
# keys each needs, as transformers' ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` reads them
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                     "yarn": ("factor", "original_max_position_embeddings")}
# optional keys (absent = transformers' default), as ``_compute_yarn_parameters`` reads them
ROPE_SCALING_OPTIONAL = {"yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                                  "truncate")}


def check_rope_scaling(spec, where: str) -> dict:
    """``spec`` (HF ``rope_scaling`` / ``rope_parameters`` or msllm's) as msllm keeps it:
    ``{"type": KIND, key: value ...}`` with :data:`ROPE_SCALING_KEYS`'s keys for KIND.

    Raises:
        MsllmError: not a dict, a kind msllm does not implement (named), or a missing key.
    """
    if not isinstance(spec, dict):
        raise MsllmError(f"{where}: expected an object with rope_type, got {spec!r}")
    kind = spec.get("rope_type", spec.get("type"))
    if kind not in ROPE_SCALING_KEYS:
        raise MsllmError(f"{where}: rotary scaling {kind!r} is not implemented (msllm has default, "
                         f"{', '.join(ROPE_SCALING_KEYS)}); got {spec!r}")
    missing = [k for k in ROPE_SCALING_KEYS[kind] if spec.get(k) is None]
    if missing:
        raise MsllmError(f"{where}: rotary scaling {kind!r} needs {', '.join(missing)}; got {spec!r}")
    out = {"type": kind}
    for k in ROPE_SCALING_KEYS[kind] + tuple(o for o in ROPE_SCALING_OPTIONAL.get(kind, ()) if spec.get(o) is not None):
        if k == "truncate":
            out[k] = bool(spec[k])
        else:
            out[k] = int(spec[k]) if k == "original_max_position_embeddings" else float(spec[k])
    return out


@dataclass
class MoeConfig:
    """``model.model_config.moe_config``: mixture-of-experts MLPs (MindFormers' keys; HF's in brackets).

    expert_num: E routed experts per MoE layer (HF ``num_local_experts`` / ``num_experts``).
    num_experts_chosen: k experts per token (``num_experts_per_tok``).
    moe_intermediate_size: each expert's SwiGLU width; None = the model's ``intermediate_size``
        (Mixtral; Qwen-MoE set it).
    shared_expert_intermediate_size: width of Qwen2-MoE's shared expert, scaled by its sigmoid gate
        (0 = none).
    norm_topk_prob: renormalise the k chosen softmax weights to sum to 1 (Mixtral always; Qwen3-MoE
        per its config; Qwen2-MoE's default False).
    aux_loss_factor: weight of the load-balancing loss added to the training loss (HF
        ``router_aux_loss_coef``; Switch Transformer eq. 4-6 as transformers'
        ``load_balancing_loss_func``); 0 = none.
    capacity_factor: in training, the token choices an expert takes per step =
        ceil(capacity_factor x tokens x k / E), the rest dropped (MindFormers; counted and logged
        as a fraction); 0 = dropless (every routed token computed). Inference and evaluation never
        drop.
    decoder_sparse_step / mlp_only_layers: layer i is MoE when ``(i + 1) % decoder_sparse_step == 0``
        and i is not in ``mlp_only_layers`` (Qwen-MoE; the others are dense MLPs).
    """

    expert_num: int = 8
    num_experts_chosen: int = 2
    moe_intermediate_size: Optional[int] = None
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    aux_loss_factor: float = 0.0
    capacity_factor: float = 0.0
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)

    def validate(self, where: str = "model.model_config.moe_config") -> None:
        if self.expert_num < 1 or not 1 <= self.num_experts_chosen <= self.expert_num:
            raise MsllmError(f"{where}: expected expert_num >= 1 and 1 <= num_experts_chosen <= expert_num, got "
                             f"{self.expert_num} and {self.num_experts_chosen}")
        if self.capacity_factor < 0:
            raise MsllmError(f"{where}.capacity_factor must be >= 0 (0 = dropless), got {self.capacity_factor}")
        if self.decoder_sparse_step < 1:
            raise MsllmError(f"{where}.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")


@dataclass
class LlamaConfig:
    """Shape and numerics of a LLaMA decoder.

    Attributes (units: counts of elements unless said otherwise):
        vocab_size: number of token ids (LLaMA / LLaMA-2: 32000).
        hidden_size: model width C (Meta ``dim``).
        num_layers: decoder blocks L (HF ``num_hidden_layers``).
        num_heads: query heads H (HF ``num_attention_heads``).
        head_dim: D, the width of one head; None = C / H (Qwen3, Gemma and Mistral-Nemo set it:
            H * D may differ from C).
        n_kv_heads: key/value heads for grouped-query attention (HF ``num_key_value_heads``);
            ``None`` means H (multi-head attention).
        intermediate_size: SwiGLU width F; ``None`` derives it from ``multiple_of`` and
            ``ffn_dim_multiplier`` as Meta does (:func:`llama_intermediate_size`).
        seq_length: training sequence length T (tokens per sample fed to the model).
        max_position_embeddings: longest position the rotary tables cover (>= seq_length).
        rms_norm_eps: epsilon inside RMSNorm.
        rope_theta: rotary base (10000 for LLaMA-1/2, 500000 for LLaMA-3, 1e6 CodeLlama).
        rope_scaling: HF ``rope_scaling`` dict, ``{"type"/"rope_type": KIND, ...}`` with the keys
            :data:`ROPE_SCALING_KEYS` lists for KIND (``linear``; ``llama3``, Llama 3.1+; ``yarn``,
            Qwen2.5 / Qwen3 long context); other kinds are refused naming the kind.
        model_type: the Hugging Face family (:data:`msllm.models.llama.families.FAMILIES`:
            llama, qwen2, qwen3, mistral, gemma) whose ``config.json`` and architecture the model
            is written as; the switches below make the network, this names the format.
        qkv_has_bias: bias on the q, k and v projections (Qwen2; MindFormers' key).
        attention_bias: bias on q, k, v and o (HF ``LlamaConfig.attention_bias``; InternLM-1).
        qk_norm: RMSNorm (weights (D,)) over each head of q and k before rotary (Qwen3).
        sliding_window: W; a query at position q sees keys k with ``q - W < k <= q`` (Mistral
            v0.1, as transformers' ``sliding_window_overlay``); None = all earlier keys.
        rms_norm_offset: RMSNorm multiplies by ``(offset + w)`` (Gemma: 1.0, computed in float32
            as ``GemmaRMSNorm``); 0.0 = LLaMA.
        hidden_act: the gate's activation, ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU, Gemma).
        embedding_multiplier: embeddings are multiplied by it, rounded to the weights' dtype
            (Gemma: sqrt(hidden_size)); 1.0 = LLaMA.
        tie_word_embeddings: share the embedding table with the output head.
        bos_token_id / eos_token_id / pad_token_id: special ids (LLaMA: 1 / 2 / 0, pad = unk).
        ignore_token_id: label value excluded from the loss (-100, the HF/PyTorch convention).
        compute_dtype: dtype of matmuls. On CPU ``float32``, or for training ``bfloat16`` on msllm's
            CPU kernels: the linear GEMMs round their inputs to bfloat16 and sum in float32, every
            other tensor float32 (:mod:`msllm.kernels.select`; MindSpore 2.10 has no bf16 CPU operators).
        layernorm_compute_type / softmax_compute_type: dtypes of RMSNorm and softmax math.
        param_init_type: dtype parameters are stored in.
        embedding_init_type: dtype of the embedding table (MindFormers' key; its Llama-3.1 YAMLs
            keep it in bfloat16 beside float16 weights); None = ``param_init_type``.
        initializer_range: std of the normal initialisation of weight matrices.
        use_flash_attention: attention without the (B, H, T, T) score tensor (MindFormers' key):
            msllm's CPU kernel on the CPU fast path, MindSpore's ``FlashAttentionScore`` on the
            layout path (Ascend). None = wherever available, True = required (refused where it
            cannot run), False = the composed operators. Rules: :mod:`msllm.kernels.select`.
        fused_rms_norm: RMSNorm as one operator (MindFormers' key; msllm's CPU kernel, or
            MindSpore's ``RmsNorm`` on Ascend); None / True / False as above.
        cpu_kernels: msllm's CPU kernels (``msllm/kernels``: oneDNN linear layers, SwiGLU, rotary,
            cross-entropy), built by ``python -m msllm.kernels.build``; None = when built.
        quantization_config: weight-only int8 for inference (MindFormers' key;
            :class:`~msllm.models.llama.quantization.QuantizationConfig`); None or an empty section =
            none. ``param_init_type: int8`` is the shorthand for ``{quant_method: rtn, weight_dtype:
            int8, weight_quant_granularity: per_channel}``, the other parameters then float32.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    seq_length: int = 2048
    max_position_embeddings: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = False
    # family switches (msllm/models/llama/families.py); the defaults are LLaMA's
    model_type: str = "llama"
    qkv_has_bias: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    rms_norm_offset: float = 0.0
    hidden_act: str = "silu"
    embedding_multiplier: float = 1.0
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    ignore_token_id: int = -100
    compute_dtype: str = "float32"
    layernorm_compute_type: str = "float32"
    softmax_compute_type: str = "float32"
    param_init_type: str = "float32"
    embedding_init_type: Optional[str] = None
    initializer_range: float = 0.02
    # fused operators (msllm/kernels/select.py); None = use where available
    use_flash_attention: Optional[bool] = None
    fused_rms_norm: Optional[bool] = None
    cpu_kernels: Optional[bool] = None
    # pipeline stage split (MindFormers' keys, msllm/training/pipeline.py stage_assignment): extra
    # layers per stage (an int, a list per stage, or per interleave chunk and stage) and the
    # number of interleaved chunks per stage; read only when parallel_config.pipeline_stage > 1
    offset: Union[int, list] = 0
    pp_interleave_num: int = 1
    # mixture of experts (MindFormers ``moe_config``, msllm/models/llama/moe.py); None = dense MLPs
    moe_config: Optional[MoeConfig] = None
    # weight-only int8 inference (MindFormers ``quantization_config``, msllm/models/llama/quantization.py)
    quantization_config: Optional[QuantizationConfig] = None

    def __post_init__(self) -> None:
        if isinstance(self.moe_config, dict):
            self.moe_config = MoeConfig(**self.moe_config)
        if isinstance(self.quantization_config, dict):
            self.quantization_config = QuantizationConfig(**self.quantization_config)
        if self.param_init_type == "int8":   # the shorthand: RTN per output channel, other weights float32
            if self.quantization_config is None or self.quantization_config.is_off():
                self.quantization_config = QuantizationConfig(quant_method="rtn")
            self.param_init_type = "float32"
        if self.quantization_config is not None:
            self.quantization_config.validate()
            if self.quantization_config.is_off():
                self.quantization_config = None
        if self.head_dim is None and self.num_heads > 0:
            if self.hidden_size % self.num_heads:
                raise MsllmError(f"model.model_config.hidden_size={self.hidden_size} must be divisible by "
                                 f"num_heads={self.num_heads} (or set head_dim)")
            self.head_dim = self.hidden_size // self.num_heads  # stored, so a manifest says it
        self.validate()

    # ---- derived shapes -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """H * D: the width of the query projection's output (the o projection's input)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """K * D: the width of the key and value projections' outputs."""
        return self.kv_heads * self.head_dim

    @property
    def o_bias(self) -> bool:
        """The o projection has a bias (``attention_bias``); q/k/v have one with either key."""
        return self.attention_bias

    @property
    def qkv_bias(self) -> bool:
        return self.qkv_has_bias or self.attention_bias

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return llama_intermediate_size(self.hidden_size, self.multiple_of, self.ffn_dim_multiplier)

    def is_moe_layer(self, i: int) -> bool:
        """Layer i's MLP is a mixture of experts (:class:`MoeConfig`'s sparse step and dense list)."""
        m = self.moe_config
        return m is not None and (i + 1) % m.decoder_sparse_step == 0 and i not in m.mlp_only_layers

    @property
    def expert_size(self) -> int:
        """Each routed expert's SwiGLU width."""
        return self.moe_config.moe_intermediate_size or self.ffn_size

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes (``max_position_embeddings``, else ``seq_length``):
        it bounds requests and selects rope scaling; nothing is allocated by it."""
        return self.max_position_embeddings or self.seq_length

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of decoder layer ``layer`` (None: every earlier key). The one place a
        per-layer rule (Qwen2's ``max_window_layers``, Gemma 2's alternate layers) would go: the
        model builds its kernels and one mask per distinct window from it. Today every layer
        has ``sliding_window``."""
        return self.sliding_window

    def validate(self, where: str = "model.model_config") -> None:
        """Raise :class:`MsllmError` naming the key if the shapes are inconsistent."""
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length", "multiple_of"):
            if getattr(self, key) <= 0:
                raise MsllmError(f"{where}.{key} must be positive, got {getattr(self, key)}")
        if self.head_dim is None or self.head_dim <= 0:
            raise MsllmError(f"{where}.head_dim must be positive, got {self.head_dim}")
        if self.head_dim % 2:
            raise MsllmError(f"{where}: head_dim={self.head_dim} must be even for rotary embeddings")
        if self.kv_heads <= 0 or self.num_heads % self.kv_heads:
            raise MsllmError(
                f"{where}.n_kv_heads={self.n_kv_heads} must divide num_heads={self.num_heads}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            raise MsllmError(f"{where}.max_position_embeddings={self.max_position_embeddings} "
                             f"is shorter than seq_length={self.seq_length}")
        if self.embedding_init_type is not None and self.embedding_init_type not in DTYPES:
            raise MsllmError(f"{where}.embedding_init_type={self.embedding_init_type!r}: expected one of {DTYPES} "
                             "or null (= param_init_type)")
        for key in ("compute_dtype", "layernorm_compute_type", "softmax_compute_type", "param_init_type"):
            if getattr(self, key) not in DTYPES:
                also = " (param_init_type also takes int8: weight-only int8 inference)" if key == "param_init_type" else ""
                raise MsllmError(f"{where}.{key}={getattr(self, key)!r}: expected one of {DTYPES}{also}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling, f"{where}.rope_scaling")
        family(self.model_type, f"{where}.model_type")
        moe = self.moe_config
        if moe is not None:
            moe.validate(f"{where}.moe_config")
        if self.hidden_act not in HIDDEN_ACTS:
            raise MsllmError(f"{where}.hidden_act={self.hidden_act!r}: expected one of {HIDDEN_ACTS}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise MsllmError(f"{where}.sliding_window={self.sliding_window}: expected a positive number "
                             f"of keys, or null for none")

    # ---- sizes ---------------------------------------------------------------------
    def num_params(self) -> int:
        """Exact parameter count of :class:`msllm.models.llama.model.LlamaForCausalLM`: the sum of
        the sizes in :func:`msllm.models.llama.names.param_shapes` (the one table of shapes)."""
        from math import prod

        from msllm.models.llama.names import param_shapes

        return sum(prod(shape) for shape in param_shapes(self).values())

    def idle_expert_params(self) -> int:
        """Routed-expert parameters a token does not run: (E - k) experts x 3 I C per MoE layer."""
        m = self.moe_config
        if m is None:
            return 0
        idle = (m.expert_num - m.num_experts_chosen) * 3 * self.expert_size * self.hidden_size
        return idle * sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def active_params(self) -> int:
        """Parameters one token runs through (all of them for a dense model; with experts the k
        chosen ones): the "active" count MoE releases quote (Mixtral-8x7B 12.9B of 46.7B)."""
        return self.num_params() - self.idle_expert_params()

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but the embedding lookup, norms and
        biases; with experts only the k routed experts a token runs (the active parameters).

        This is the N of the ``6N`` training-FLOPs rule (Kaplan et al. 2020, sec. 2.1; PaLM,
        Chowdhery et al. 2022, appendix B). The output head is a matmul and counts.
        """
        c = self.hidden_size
        norms = (2 * self.num_layers + 1) * c + (2 * self.num_layers * self.head_dim if self.qk_norm else 0)
        biases = self.num_layers * ((self.q_size + 2 * self.kv_size if self.qkv_bias else 0)
                                    + (c if self.o_bias else 0))  # added, not multiplied
        embed_lookup = 0 if self.tie_word_embeddings else self.vocab_size * c
        return self.active_params() - norms - biases - embed_lookup

    def train_flops_per_token(self, seq_length: Optional[int] = None) -> float:
        """Model FLOPs per trained token (forward + backward, no recompute).

        ``6 N + 12 L H D T`` with N = :meth:`matmul_params`, L layers, H heads, D head_dim,
        T sequence length: PaLM (Chowdhery et al. 2022), appendix B. The second term is the
        attention score and value matmuls (QK^T and PV), which 6N does not count; it counts
        every query against T keys (the full T x T square, not the causal half). With a
        ``sliding_window`` W a query's keys lie in a band W wide, so T becomes min(W, T) (the
        band's width, counted the same way).
        """
        t = seq_length or self.seq_length
        keys = float(t if self.sliding_window is None else min(self.sliding_window, t))
        return 6.0 * self.matmul_params() + 12.0 * self.num_layers * self.num_heads * self.head_dim * keys


# Published LLaMA-2 shapes (Touvron et al. 2023, table 1 / Meta params.json); parameter counts
# 6.74B / 13.0B / 69.0B. "tiny" is msllm's CPU demo model.
PRESETS: dict[str, dict] = {
    "7b": dict(hidden_size=4096, num_layers=32, num_heads=32, multiple_of=256, rms_norm_eps=1e-5,
               seq_length=4096),
    "13b": dict(hidden_size=5120, num_layers=40, num_heads=40, multiple_of=256, rms_norm_eps=1e-5,
                seq_length=4096),
    "70b": dict(hidden_size=8192, num_layers=80, num_heads=64, n_kv_heads=8, multiple_of=4096,
                ffn_dim_multiplier=1.3, rms_norm_eps=1e-5, seq_length=4096),
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, n_kv_heads=2, multiple_of=32,
                 seq_length=256),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """A :class:`LlamaConfig` for a named preset (``7b``, ``13b``, ``70b``, ``tiny``)."""
    if name not in PRESETS:
        raise MsllmError(f"unknown LLaMA preset {name!r}; expected one of {sorted(PRESETS)}")
    return LlamaConfig(**{**PRESETS[name], **overrides})




HF_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "n_kv_heads", "head_dim", "intermediate_size",
             "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
             "model_type", "qkv_has_bias", "attention_bias", "qk_norm", "sliding_window", "rms_norm_offset",
             "hidden_act", "embedding_multiplier", "moe_config", "bos_token_id", "eos_token_id", "initializer_range")
"""The model fields an HF ``config.json`` decides (:func:`merge_run_config`); every other field
(seq_length, dtypes, kernels, pad_token_id of the data) comes from the run YAML's
``model.model_config``."""


def merge_run_config(hf_cfg: LlamaConfig, run: LlamaConfig) -> tuple[LlamaConfig, list[str]]:
    """The model config of a run that loads an HF directory: :data:`HF_FIELDS` from its
    ``config.json`` (``hf_cfg``), the rest from the run YAML's ``model.model_config`` (``run``),
    and the YAML's ``moe_config.capacity_factor`` (a training setting config.json has no key for).

    Returns ``(config, conflicts)``: ``conflicts`` names each field the YAML sets to a value other
    than :class:`LlamaConfig`'s default that ``config.json`` overrides (``"vocab_size=32000 (config.json:
    49152)"``), for one start-up log line. A YAML ``seq_length`` beyond the model's positions is cut
    to ``max_position_embeddings`` and named there too.
    Raises MsllmError (from :meth:`LlamaConfig.validate`) for an inconsistent result."""
    defaults = LlamaConfig()
    conflicts = [f"{k}={getattr(run, k)!r} (config.json: {getattr(hf_cfg, k)!r})" for k in HF_FIELDS
                 if getattr(run, k) != getattr(defaults, k) and getattr(run, k) != getattr(hf_cfg, k)
                 and not (k == "head_dim" and run.head_dim == run.hidden_size // run.num_heads)]
    keep = {f.name: getattr(run, f.name) for f in dataclasses.fields(LlamaConfig) if f.name not in HF_FIELDS}
    keep.pop("multiple_of"), keep.pop("ffn_dim_multiplier")
    if hf_cfg.moe_config is not None and run.moe_config is not None and run.moe_config.capacity_factor:
        # token dropping is a training setting config.json has no key for: the YAML's
        hf_cfg = dataclasses.replace(hf_cfg, moe_config=dataclasses.replace(
            hf_cfg.moe_config, capacity_factor=run.moe_config.capacity_factor))
    limit = hf_cfg.max_position_embeddings
    if limit is not None and keep["seq_length"] > limit:
        conflicts.append(f"seq_length={keep['seq_length']} (the model's max_position_embeddings: {limit})")
        keep["seq_length"] = limit
    return dataclasses.replace(hf_cfg, **keep), conflicts


__all__ = ["LlamaConfig", "MoeConfig", "ROPE_SCALING_KEYS", "ROPE_SCALING_OPTIONAL", "check_rope_scaling", "PRESETS", "preset", "llama_intermediate_size", "DTYPES", "field", "HF_FIELDS",
           "merge_run_config"]
