"""Hugging Face <-> msllm LLaMA weights: the one name table, the config mapping and the streaming
conversions in both directions.

Formats (sources):

* HF: a directory with ``config.json`` (``transformers.LlamaConfig``) and the weights as
  ``model.safetensors`` / ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
  or ``pytorch_model.bin`` / ``pytorch_model-0000i-of-0000n.bin`` + ``pytorch_model.bin.index.json``
  (``transformers/modeling_utils.py`` ``save_pretrained``). Weights of
  ``transformers/models/llama/modeling_llama.py``; q/k rows in the "rotate_half" layout.
* Meta: ``params.json`` + ``consolidated.NN.pth`` (``facebookresearch/llama``), q/k rows in the
  interleaved (complex-pair) rotary layout, converted with :func:`permute_meta_to_hf` exactly as
  ``permute`` in HF ``transformers/models/llama/convert_llama_weights_to_hf.py``.
* safetensors: 8-byte little-endian header length N, N bytes of JSON header
  ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
  byte buffer (``huggingface/safetensors`` README, "Format").
* MindSpore ``.ckpt``: protobuf ``Checkpoint { repeated Value value = 1; }``,
  ``Value { required string tag = 1; TensorProto tensor = 2; }``,
  ``TensorProto { repeated int64 dims = 1; required string tensor_type = 2; required bytes
  tensor_content = 3; }`` (``mindspore/train/checkpoint.proto``). MindSpore's own writer
  (``mindspore/train/serialization.py`` ``_exec_save``) appends one serialized ``Checkpoint``
  holding one ``Value`` per tensor (per 512 MiB chunk of a tensor); concatenated protobuf
  messages parse as one message, so the file can be written and read one tensor at a time.
  MindSpore 2.10 has no public streaming writer (``save_checkpoint`` takes the whole list), so
  :class:`CkptWriter` / :func:`scan_ckpt` implement that same framing; the tests check the bytes
  are identical to ``mindspore.save_checkpoint`` and that ``mindspore.load_checkpoint`` reads them.

Memory: every conversion reads its input one tensor at a time (plain reads at recorded offsets;
``.bin``/``.pth`` through ``torch.load(mmap=True, weights_only=True)``) and writes its output one
tensor at a time, so the peak is about one tensor plus its dtype-cast copy, independent of the
model size (measured in ``benchmarks/convert_peak_rss.py``).

Atomicity: the ``.ckpt`` is written through :func:`msllm.fileio.atomic_path`, its manifest after
it; an HF directory is written as a temporary directory beside the target and renamed at the end.
Every input problem raises one :class:`MsllmError` naming the file and tensor or key, before any
output is published. torch / transformers are imported only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

from msllm.errors import MsllmError
from msllm.fileio import atomic_path, write_json_atomic
from msllm.models.llama.config import LlamaConfig

# ---------------------------------------------------------------------------------------------
# The name table: msllm parameter <-> HF tensor <-> Meta tensor. ``{i}`` is the layer index.
# The shape of each entry as a function of the config is in :func:`param_shapes`.

PARAM_TABLE: tuple[tuple[str, str, str], ...] = (
    # (msllm, Hugging Face, Meta consolidated.*.pth)
    ("model.embed_tokens.embedding_table", "model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight",
     "layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
     "layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight",
     "layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight",
     "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight",
     "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight",
     "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight",
     "layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight",
     "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight",
     "layers.{i}.ffn_norm.weight"),
    ("model.norm.weight", "model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight", "output.weight"),
)

# Entries of a trainer checkpoint that are not model weights (optimizer state, counters). msllm's
# trainer writes these; ``scale_sense`` and ``accu_grads.*`` are MindFormers' loss scale and
# gradient-accumulation buffers.
TRAINER_ENTRIES = frozenset({"global_step", "learning_rate", "loss_scale", "current_iterator_step",
                             "last_overflow_iterator_step", "epoch_num", "step_num", "scale_sense"})
TRAINER_PREFIXES = ("adam_m.", "adam_v.", "accu_grads.")

# HF tensors that are buffers, not weights (old transformers saved the rotary inverse frequencies).
_HF_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
# Meta: the rotary table some consolidated checkpoints carry.
_META_IGNORED = frozenset({"rope.freqs"})


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_COLUMNS = {"msllm": 0, "hf": 1, "meta": 2}
_REGEX = {col: [(_template_regex(row[idx]), row) for row in PARAM_TABLE] for col, idx in _COLUMNS.items()}


def translate_name(name: str, src: str, dst: str) -> Optional[str]:
    """Map tensor ``name`` from naming ``src`` to naming ``dst`` (each ``msllm``/``hf``/``meta``)
    with :data:`PARAM_TABLE`; None if ``name`` is not a model weight of that naming."""
    for regex, row in _REGEX[src]:
        m = regex.match(name)
        if m:
            target = row[_COLUMNS[dst]]
            return target.format(i=m.group("i")) if "i" in regex.groupindex else target
    return None


def hf_to_msllm_name(name: str) -> Optional[str]:
    """``model.embed_tokens.weight`` -> ``model.embed_tokens.embedding_table``; others map to
    themselves; None for names that are not LLaMA weights."""
    return translate_name(name, "hf", "msllm")


def msllm_to_hf_name(name: str) -> Optional[str]:
    """Inverse of :func:`hf_to_msllm_name`."""
    return translate_name(name, "msllm", "hf")


def layer_index(name: str) -> Optional[int]:
    """Layer index in ``...layers.{i}...`` names, else None."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """``{msllm name: shape}`` of every weight of ``LlamaForCausalLM(cfg)``, in checkpoint order.

    Shapes: embedding (V, C); q_proj (H*D, C); k_proj/v_proj (K*D, C); o_proj (C, H*D);
    gate/up (F, C); down (C, F); norms (C,); lm_head (V, C), absent when ``tie_word_embeddings``.
    """
    c, v, f = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    hd, kd = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = {"self_attn.q_proj.weight": (hd, c), "self_attn.k_proj.weight": (kd, c),
                 "self_attn.v_proj.weight": (kd, c), "self_attn.o_proj.weight": (c, hd),
                 "mlp.gate_proj.weight": (f, c), "mlp.up_proj.weight": (f, c),
                 "mlp.down_proj.weight": (c, f), "input_layernorm.weight": (c,),
                 "post_attention_layernorm.weight": (c,)}
    shapes = {"model.embed_tokens.embedding_table": (v, c)}
    for i in range(cfg.num_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    shapes["model.norm.weight"] = (c,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, c)
    return shapes


def is_trainer_entry(name: str) -> bool:
    """True for checkpoint entries of the train step that are not weights (``adam_m.*``,
    ``adam_v.*``, ``global_step``, ``loss_scale``, ``epoch_num`` ...)."""
    return name in TRAINER_ENTRIES or name.startswith(TRAINER_PREFIXES)


# ---------------------------------------------------------------------------------------------
# Rotary layouts. Meta's ``apply_rotary_emb`` rotates adjacent pairs (x[2j], x[2j+1]) of each head;
# HF's rotate_half rotates (x[j], x[j + D/2]). Reordering the output rows of wq / wk per head
# turns one into the other without changing the function the attention computes.


def permute_meta_to_hf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Meta interleaved q/k rows -> HF rotate_half rows.

    ``w``: (n_heads * D, in) in any dtype; returns a new (n_heads * D, in) array whose head ``h``
    row ``j`` (j < D/2) is Meta row ``2j`` and row ``j + D/2`` is Meta row ``2j + 1``. Same as
    ``permute`` in HF ``transformers/models/llama/convert_llama_weights_to_hf.py``:
    ``w.view(n_heads, D // 2, 2, in).transpose(1, 2).reshape(n_heads * D, in)``.
    Use ``n_heads = num_key_value_heads`` for wk. Raises ValueError if the rows do not split.
    """
    rows, cols = w.shape
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def permute_hf_to_meta(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`permute_meta_to_hf`: HF rotate_half rows -> Meta interleaved rows."""
    rows, cols = w.shape
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, d // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


# ---------------------------------------------------------------------------------------------
# dtypes. Arrays are held in a "storage" numpy dtype: float32, float16, float64, int32, int64, and
# bfloat16 as its raw uint16 bits (numpy has no bfloat16).

DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float64": np.float64,
            "int32": np.int32, "int64": np.int64}
_ST_CODES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I32": "int32",
             "I64": "int64"}
_ST_CODE_OF = {v: k for k, v in _ST_CODES.items()}
_MS_TYPES = {"Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16", "Float64": "float64",
             "Int32": "int32", "Int64": "int64"}
_MS_TYPE_OF = {v: k for k, v in _MS_TYPES.items()}
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def normalize_dtype(name: Optional[str]) -> Optional[str]:
    """``fp32``/``fp16``/``bf16`` (or the long names) -> ``float32``/``float16``/``bfloat16``;
    None stays None (keep the input dtype). MsllmError for anything else."""
    if name is None:
        return None
    if name not in DTYPE_ALIASES:
        raise MsllmError(f"--dtype {name!r}: expected fp32, fp16 or bf16")
    return DTYPE_ALIASES[name]


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> bfloat16 bits (uint16), round to nearest even; NaN -> 0x7FC0.

    Bit-identical to ``torch.Tensor.to(torch.bfloat16)`` (c10 ``round_to_nearest_even``).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat_in, out = x.reshape(-1), np.empty(x.shape, np.uint16)
    flat_out = out.reshape(-1)
    step = 1 << 20  # in blocks, so the temporaries stay small next to a large tensor
    for start in range(0, flat_in.size, step):
        block = flat_in[start:start + step]
        u = block.view(np.uint32)
        t = u >> np.uint32(16)
        t &= np.uint32(1)
        t += np.uint32(0x7FFF)
        t += u
        t >>= np.uint32(16)
        part = flat_out[start:start + step]
        part[:] = t
        part[np.isnan(block)] = 0x7FC0
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def cast(data: np.ndarray, src: str, dst: Optional[str]) -> np.ndarray:
    """Convert storage array ``data`` of dtype ``src`` to dtype ``dst`` (None or equal: unchanged).

    float <-> float goes through float32 where needed; rounding is round-to-nearest-even like
    ``torch.Tensor.to``. Raises MsllmError for a non-float conversion.
    """
    if dst is None or dst == src:
        return data
    if src not in FLOAT_DTYPES or dst not in FLOAT_DTYPES:
        raise MsllmError(f"cannot convert a {src} tensor to {dst}")
    f32 = bf16_bits_to_f32(data) if src == "bfloat16" else data
    if dst == "bfloat16":
        return f32_to_bf16_bits(f32.astype(np.float32, copy=False))
    with np.errstate(over="ignore"):  # out-of-range values become +-inf, as in torch
        return f32.astype(_STORAGE[dst])


def to_float32(data: np.ndarray, dtype: str) -> np.ndarray:
    """Storage array -> float32 (for numerics: verification, comparisons)."""
    return cast(data, dtype, "float32")


def tensor_nbytes(shape: Iterable[int], dtype: str) -> int:
    """Bytes of a tensor of ``shape`` and msllm dtype name ``dtype``."""
    return int(np.prod(tuple(shape), dtype=np.int64)) * np.dtype(_STORAGE[dtype]).itemsize


# ---------------------------------------------------------------------------------------------
# Tensors of an input, loaded on demand.


@dataclass
class TensorRef:
    """One tensor of an input file: name, shape and dtype known, data read by ``load()``.

    ``load()`` returns the storage array (see :func:`cast`) of ``shape``; ``where`` names the file
    for messages.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    where: str
    loader: Callable[[], np.ndarray] = field(repr=False)

    def load(self) -> np.ndarray:
        return self.loader()


def _read_exact(fh, offset: int, nbytes: int, dtype: str, shape: tuple, where: str, name: str) -> np.ndarray:
    arr = np.empty(shape, _STORAGE[dtype])
    fh.seek(offset)
    got = fh.readinto(memoryview(arr).cast("B")) if nbytes else 0
    if got != nbytes:
        raise MsllmError(f"{where}: tensor {name} is truncated ({got} of {nbytes} bytes)")
    return arr


class _Files:
    """Open file handles shared by the loaders of one conversion; closed at the end."""

    def __init__(self):
        self._open: dict[str, object] = {}

    def get(self, path: str):
        if path not in self._open:
            self._open[path] = open(path, "rb")
        return self._open[path]

    def close(self) -> None:
        for fh in self._open.values():
            fh.close()
        self._open.clear()


def read_safetensors_header(path: str) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]], dict]:
    """Parse the header of safetensors file ``path``.

    Returns ``(data_start, {name: (dtype, shape, begin, end)}, metadata)`` with absolute byte
    offsets ``begin``/``end`` and msllm dtype names. Raises MsllmError naming the file (and the
    tensor) for a truncated file, a header that is not JSON, an unsupported dtype, or offsets that
    disagree with the shape or run past the end of the file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise MsllmError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise MsllmError(f"{path}: not a safetensors file (header length {n} does not fit in {size} bytes)")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MsllmError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise MsllmError(f"{path}: safetensors header is not a JSON object")
    start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    out = {}
    for name, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise MsllmError(f"{path}: tensor {name}: malformed safetensors header entry {info!r}") from None
        if code not in _ST_CODES:
            raise MsllmError(f"{path}: tensor {name} has dtype {code}; supported: {sorted(_ST_CODES)}")
        dtype = _ST_CODES[code]
        if end - begin != tensor_nbytes(shape, dtype) or begin < 0 or start + end > size:
            raise MsllmError(f"{path}: tensor {name}: data_offsets {[begin, end]} do not match shape "
                             f"{list(shape)} {code} or run past the end of the file ({size} bytes)")
        out[name] = (dtype, shape, start + begin, start + end)
    return start, out, metadata


def _safetensors_refs(path: str, files: _Files) -> dict[str, TensorRef]:
    _, entries, _ = read_safetensors_header(path)
    refs = {}
    for name, (dtype, shape, begin, end) in entries.items():
        def load(path=path, name=name, dtype=dtype, shape=shape, begin=begin, end=end):
            return _read_exact(files.get(path), begin, end - begin, dtype, shape, path, name)
        refs[name] = TensorRef(name, shape, dtype, path, load)
    return refs


def _torch_load(path: str) -> dict:
    """``torch.load(path, weights_only=True)`` memory-mapped when the file allows it."""
    try:
        import torch
    except ImportError:
        raise MsllmError(f"{path}: reading .bin/.pth weights needs torch (pip install -e \".[convert]\")") from None

    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle / zip errors come in many types
        raise MsllmError(f"{path}: cannot be read with torch.load(weights_only=True): "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise MsllmError(f"{path}: expected a dict of tensors, got {type(sd).__name__}")
    return sd


_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                 "torch.float64": "float64", "torch.int32": "int32", "torch.int64": "int64"}


def _torch_to_storage(t) -> np.ndarray:
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _torch_refs(path: str) -> dict[str, TensorRef]:
    import torch

    sd = _torch_load(path)
    refs = {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise MsllmError(f"{path}: entry {name!r} is a {type(t).__name__}, not a tensor")
        dtype = _TORCH_DTYPES.get(str(t.dtype))
        if dtype is None:
            raise MsllmError(f"{path}: tensor {name} has dtype {t.dtype}; supported: {sorted(_TORCH_DTYPES)}")
        refs[name] = TensorRef(name, tuple(t.shape), dtype, path, lambda t=t: _torch_to_storage(t))
    return refs


# ---------------------------------------------------------------------------------------------
# Configs.


def _read_json(path: str, what: str) -> object:
    if not os.path.isfile(path):
        raise MsllmError(f"{path}: {what} not found")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise MsllmError(f"{path}: {what} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MsllmError(f"{path}: {what} cannot be read ({exc})") from None


def _hf_rope(hf: dict, where: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, msllm rope_scaling) from legacy ``rope_theta``/``rope_scaling`` or the
    transformers-5 ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or None
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    spec = scaling if scaling is not None else params
    if not isinstance(spec, dict):
        raise MsllmError(f"{where}: rope_scaling/rope_parameters must be an object, got {spec!r}")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind == "linear" and "factor" in spec:
        return float(theta), {"type": "linear", "factor": float(spec["factor"])}
    key = "rope_scaling" if scaling is not None else "rope_parameters"
    raise MsllmError(f"{where}: {key} {spec!r} is not supported (msllm implements default and "
                     "linear rotary scaling only)")


def hf_config_to_msllm(hf: dict, where: str = "config.json") -> LlamaConfig:
    """HF ``LlamaConfig`` dict (``config.json``) -> msllm :class:`LlamaConfig`.

    Field mapping: num_hidden_layers -> num_layers, num_attention_heads -> num_heads,
    num_key_value_heads -> n_kv_heads, rope_theta / rope_parameters.rope_theta -> rope_theta,
    rope_scaling (linear only) -> rope_scaling; ``seq_length`` is set to max_position_embeddings
    (a run YAML sets its own). ``eos_token_id`` lists keep their first id; ``pad_token_id`` null -> 0.

    Raises MsllmError naming ``where`` and the key: not ``model_type: llama`` /
    ``LlamaForCausalLM``, a missing or non-integer size, biases, an activation other than silu,
    ``head_dim != hidden_size / num_attention_heads``, an unsupported rope scaling.
    """
    if not isinstance(hf, dict):
        raise MsllmError(f"{where}: expected a JSON object")
    archs = hf.get("architectures")
    if hf.get("model_type") != "llama" or (archs is not None and archs != ["LlamaForCausalLM"]):
        raise MsllmError(f"{where}: unsupported architecture (model_type={hf.get('model_type')!r}, "
                         f"architectures={archs!r}); expected model_type 'llama' and ['LlamaForCausalLM']")

    def need_int(key, default=None):
        value = hf.get(key)
        value = default if value is None else value
        if value is None or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MsllmError(f"{where}: {key} must be a positive integer, got {value!r}")
        return value

    heads = need_int("num_attention_heads")
    hidden = need_int("hidden_size")
    kv = need_int("num_key_value_heads", heads)
    if hf.get("hidden_act", "silu") != "silu":
        raise MsllmError(f"{where}: hidden_act={hf['hidden_act']!r}; msllm's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise MsllmError(f"{where}: {key}=true is not supported (msllm LLaMA has no biases)")
    if hf.get("head_dim") not in (None, hidden // heads):
        raise MsllmError(f"{where}: head_dim={hf['head_dim']} differs from hidden_size / "
                         f"num_attention_heads = {hidden // heads}; not supported")
    theta, scaling = _hf_rope(hf, where)
    max_pos = need_int("max_position_embeddings", 2048)
    eos = hf.get("eos_token_id", 2)
    if isinstance(eos, list):
        eos = eos[0] if eos else 2
    pad = hf.get("pad_token_id")
    try:
        return LlamaConfig(
            vocab_size=need_int("vocab_size"), hidden_size=hidden, num_layers=need_int("num_hidden_layers"),
            num_heads=heads, n_kv_heads=kv, intermediate_size=need_int("intermediate_size"),
            seq_length=max_pos, max_position_embeddings=max_pos,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=int(hf.get("bos_token_id") if hf.get("bos_token_id") is not None else 1),
            eos_token_id=int(eos if eos is not None else 2), pad_token_id=int(pad if pad is not None else 0),
            initializer_range=float(hf.get("initializer_range", 0.02)))
    except MsllmError as exc:
        raise MsllmError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise MsllmError(f"{where}: {exc}") from None


def msllm_config_to_hf(cfg: LlamaConfig, dtype: str = "float32") -> dict:
    """msllm :class:`LlamaConfig` -> HF ``config.json`` dict for ``LlamaForCausalLM``.

    Writes both the legacy ``rope_theta``/``rope_scaling``/``torch_dtype`` keys (transformers 4)
    and ``rope_parameters``/``dtype`` (transformers 5); both versions load it.
    """
    scaling = None
    rope_parameters = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        factor = float(cfg.rope_scaling["factor"])
        scaling = {"type": "linear", "rope_type": "linear", "factor": factor}
        rope_parameters = {"rope_type": "linear", "rope_theta": float(cfg.rope_theta), "factor": factor}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


YAML_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "n_kv_heads", "intermediate_size",
             "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
             "bos_token_id", "eos_token_id", "pad_token_id")


def model_config_yaml(cfg: LlamaConfig) -> str:
    """The ``model: model_config:`` block of a run YAML for ``cfg`` (shape keys only)."""
    import yaml

    d = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
         "num_heads": cfg.num_heads, "n_kv_heads": cfg.kv_heads, "intermediate_size": cfg.ffn_size,
         "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": float(cfg.rope_theta),
         "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_positions,
         "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
         "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if d["rope_scaling"] is None:
        del d["rope_scaling"]
    return yaml.safe_dump({"model": {"model_config": d}}, sort_keys=False, default_flow_style=False)


def meta_params_to_msllm(params: dict, where: str, vocab_rows: int, ffn_rows: int) -> LlamaConfig:
    """Meta ``params.json`` -> :class:`LlamaConfig`.

    ``vocab_size`` is -1 in LLaMA-1/2 params.json: the embedding's row count ``vocab_rows`` is
    used; the SwiGLU width is the w1 row count ``ffn_rows``. Without ``max_seq_len`` the context is
    2048 (the LLaMA-1 value, as HF's converter assumes for version 1).
    """
    if not isinstance(params, dict):
        raise MsllmError(f"{where}: expected a JSON object")
    try:
        dim, n_layers, n_heads = int(params["dim"]), int(params["n_layers"]), int(params["n_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MsllmError(f"{where}: needs integer dim, n_layers and n_heads ({exc})") from None
    max_pos = int(params.get("max_seq_len", 2048))
    try:
        return LlamaConfig(vocab_size=vocab_rows, hidden_size=dim, num_layers=n_layers, num_heads=n_heads,
                           n_kv_heads=int(params.get("n_kv_heads") or n_heads), intermediate_size=ffn_rows,
                           seq_length=max_pos, max_position_embeddings=max_pos,
                           rms_norm_eps=float(params.get("norm_eps", 1e-5)),
                           rope_theta=float(params.get("rope_theta", 10000.0)))
    except MsllmError as exc:
        raise MsllmError(f"{where}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Reading an HF (or Meta) directory.


@dataclass
class HFSource:
    """A LLaMA checkpoint directory ready to convert.

    kind: ``safetensors``, ``bin`` or ``meta``; config: the msllm config it describes;
    raw_config: ``config.json`` (or ``params.json``) as read; params: ``{msllm name: TensorRef}``
    in checkpoint order, validated against the config (names, shapes), loading HF-layout values;
    files: the weight files read.
    """

    directory: str
    kind: str
    config: LlamaConfig
    raw_config: dict
    params: dict
    files: list
    _files: _Files = field(default_factory=_Files, repr=False)

    def close(self) -> None:
        self._files.close()


def _weight_files(hf_dir: str) -> tuple[str, list[str], Optional[str]]:
    """(kind, files, index path) of the weights in ``hf_dir``, the way transformers picks them:
    safetensors before .bin, an index before a single file."""
    def p(name):
        return os.path.join(hf_dir, name)

    for kind, index, single, pattern in (
            ("safetensors", "model.safetensors.index.json", "model.safetensors", r".*\.safetensors$"),
            ("bin", "pytorch_model.bin.index.json", "pytorch_model.bin", r"^pytorch_model.*\.bin$")):
        if os.path.isfile(p(index)):
            data = _read_json(p(index), "weight index")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise MsllmError(f"{p(index)}: expected an object with a non-empty \"weight_map\"")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not isinstance(shard, str) or not os.path.isfile(p(shard)):
                    raise MsllmError(f"{p(index)} names shard {shard!r}, which is missing from {hf_dir}")
            return kind, [p(s) for s in shards], p(index)
        if os.path.isfile(p(single)):
            return kind, [p(single)], None
        found = sorted(f for f in os.listdir(hf_dir) if re.match(pattern, f))
        if found:
            return kind, [p(f) for f in found], None
    meta = sorted(f for f in os.listdir(hf_dir) if re.match(r"^consolidated\.\d+\.pth$", f))
    if meta:
        return "meta", [p(f) for f in meta], None
    raise MsllmError(f"{hf_dir}: no weights found (expected model.safetensors[.index.json], "
                     "pytorch_model.bin[.index.json], or consolidated.NN.pth with params.json)")


def _check_params(named: dict, cfg: LlamaConfig, where: str, naming: str) -> dict:
    """``named``: {msllm name: (source name, shape, file)} -> validated; MsllmError for a missing
    tensor or a shape that disagrees with ``where``'s config."""
    shapes = param_shapes(cfg)
    for msllm_name, (src_name, shape, path) in named.items():
        if msllm_name not in shapes and msllm_name != "lm_head.weight":  # tied: lm_head is ignored
            raise MsllmError(f"{path}: unknown tensor {src_name} (layer index >= num_layers="
                             f"{cfg.num_layers} of {where}?)")
    for msllm_name in shapes:  # model order, so the first mismatch reported is the earliest weight
        if msllm_name not in named:
            continue
        src_name, shape, path = named[msllm_name]
        if tuple(shape) != shapes[msllm_name]:
            raise MsllmError(f"{path}: tensor {src_name} has shape {list(shape)}, but {where} implies "
                             f"{list(shapes[msllm_name])}")
    missing = [n for n in shapes if n not in named]
    if missing:
        src = translate_name(missing[0], "msllm", naming) or missing[0]
        raise MsllmError(f"{os.path.dirname(where) or where}: {len(missing)} tensor(s) of the model are "
                         f"missing from the weights, e.g. {src}")
    return shapes


def open_hf_source(hf_dir: str) -> HFSource:
    """Inspect an HF (or Meta) checkpoint directory: config, weight files, names and shapes.

    Nothing but headers is read (tensor data is read later, one tensor at a time, by
    ``TensorRef.load``). Raises MsllmError naming the file / tensor / key for: a missing directory,
    missing or malformed ``config.json`` / index / ``params.json``, an unsupported architecture, a
    shard named by the index that is missing, a tensor the index puts in a shard that lacks it, a
    tensor twice, an unknown or missing tensor, a shape that disagrees with the config.
    """
    if not os.path.isdir(hf_dir):
        raise MsllmError(f"{hf_dir}: not a directory (expected an HF checkpoint directory)")
    kind, paths, index = _weight_files(hf_dir)
    if kind == "meta":
        return _open_meta(hf_dir, paths)
    cfg_path = os.path.join(hf_dir, "config.json")
    raw = _read_json(cfg_path, "config.json (the HF model config)")
    cfg = hf_config_to_msllm(raw, cfg_path)
    files = _Files()
    refs: dict[str, TensorRef] = {}
    try:
        for path in paths:
            for name, ref in (_safetensors_refs(path, files) if kind == "safetensors" else _torch_refs(path)).items():
                if name in refs:
                    raise MsllmError(f"{path}: tensor {name} is also in {refs[name].where}")
                refs[name] = ref
        if index is not None:
            for name, shard in _read_json(index, "weight index")["weight_map"].items():
                ref = refs.get(name)
                if ref is None or os.path.basename(ref.where) != shard:
                    raise MsllmError(f"{index} puts tensor {name} in {shard}, which does not hold it")
        named, params = {}, {}
        for name, ref in refs.items():
            msllm_name = hf_to_msllm_name(name)
            if msllm_name is None:
                if _HF_IGNORED.match(name):
                    continue
                raise MsllmError(f"{ref.where}: unknown tensor {name} (not a LlamaForCausalLM weight)")
            if ref.dtype not in FLOAT_DTYPES:
                raise MsllmError(f"{ref.where}: tensor {name} has dtype {ref.dtype}; expected a float tensor")
            named[msllm_name] = (name, ref.shape, ref.where)
            params[msllm_name] = ref
        shapes = _check_params(named, cfg, cfg_path, "hf")
    except BaseException:
        files.close()
        raise
    ordered = {n: params[n] for n in shapes}
    return HFSource(hf_dir, kind, cfg, raw, ordered, paths, files)


def _open_meta(hf_dir: str, paths: list[str]) -> HFSource:
    """Meta ``consolidated.NN.pth`` (+ ``params.json``): model-parallel shards are joined
    (column-parallel weights along rows, row-parallel ones and the LLaMA-1/2 embedding along
    columns, norms replicated; as HF ``convert_llama_weights_to_hf.py``), wq/wk permuted with
    :func:`permute_meta_to_hf`."""
    params_path = os.path.join(hf_dir, "params.json")
    raw = _read_json(params_path, "params.json (the Meta model config)")
    shards = [_torch_refs(p) for p in paths]
    names = list(shards[0])
    for p, refs in zip(paths, shards):
        if set(refs) != set(names):
            odd = sorted(set(refs) ^ set(names))[0]
            raise MsllmError(f"{p}: tensor {odd} is not in every consolidated.NN.pth shard")
    n = len(shards)

    def concat_axis(name: str, shape: tuple) -> Optional[int]:
        if n == 1 or len(shape) == 1:
            return None
        if name.startswith("tok_embeddings"):  # LLaMA-1/2 split the embedding by columns, LLaMA-3 by rows
            return 1 if shape[1] * n == raw.get("dim") else 0
        return 1 if re.search(r"(attention\.wo|feed_forward\.w2)\.weight$", name) else 0

    joined = {}
    for name in names:
        if name in _META_IGNORED:
            continue
        parts = [refs[name] for refs in shards]
        axis = concat_axis(name, parts[0].shape)
        shape = list(parts[0].shape)
        if axis is not None:
            shape[axis] = sum(r.shape[axis] for r in parts)
        joined[name] = (parts, axis, tuple(shape))
    try:
        vocab = joined["tok_embeddings.weight"][2][0]
        ffn = joined["layers.0.feed_forward.w1.weight"][2][0]
    except KeyError as exc:
        raise MsllmError(f"{paths[0]}: tensor {exc.args[0]} is missing") from None
    cfg = meta_params_to_msllm(raw, params_path, vocab, ffn)
    named, params = {}, {}
    for name, (parts, axis, shape) in joined.items():
        msllm_name = translate_name(name, "meta", "msllm")
        if msllm_name is None:
            raise MsllmError(f"{parts[0].where}: unknown tensor {name} (not a Meta LLaMA weight)")
        heads = cfg.num_heads if ".wq." in name else cfg.kv_heads if ".wk." in name else None

        def load(parts=parts, axis=axis, heads=heads):
            arrays = [r.load() for r in parts]
            w = arrays[0] if axis is None else np.concatenate(arrays, axis=axis)
            return permute_meta_to_hf(w, heads) if heads else w

        named[msllm_name] = (name, shape, parts[0].where)
        params[msllm_name] = TensorRef(name, shape, parts[0].dtype, parts[0].where, load)
    shapes = _check_params(named, cfg, params_path, "meta")
    return HFSource(hf_dir, "meta", cfg, raw, {k: params[k] for k in shapes}, paths)


# ---------------------------------------------------------------------------------------------
# MindSpore .ckpt, one tensor at a time.

CKPT_CHUNK = 512 * 1024 * 1024  # bytes per Value, MindSpore serialization.SLICE_SIZE (KB) * 1024


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(number: int, payload_len: int) -> bytes:
    return _varint((number << 3) | 2) + _varint(payload_len)


class CkptWriter:
    """Write a MindSpore ``.ckpt`` one tensor at a time (see the module docstring for the format).

    ``write(name, data, dtype)``: ``data`` a storage array (:func:`cast`), ``dtype`` its msllm
    dtype name. The bytes equal ``mindspore.save_checkpoint`` of the same tensors in the same
    order (tensors above ``chunk`` bytes are split into consecutive Values like MindSpore's
    ``_write_parameter_bytes_data``). Use as a context manager; the file is closed on exit.
    """

    def __init__(self, path: str, chunk: int = CKPT_CHUNK):
        self.path = path
        self.chunk = chunk
        self._fh = open(path, "wb")

    def write(self, name: str, data: np.ndarray, dtype: str) -> None:
        if dtype not in _MS_TYPE_OF:
            raise MsllmError(f"tensor {name}: dtype {dtype} cannot be stored in a .ckpt")
        data = np.ascontiguousarray(data)
        raw = memoryview(data).cast("B") if data.nbytes else memoryview(b"")
        tag = name.encode("utf-8")
        type_name = _MS_TYPE_OF[dtype].encode()
        dims = b"".join(b"\x08" + _varint(int(d)) for d in data.shape)
        for start in range(0, max(len(raw), 1), self.chunk):
            part = raw[start:start + self.chunk]
            tensor = dims + _len_field(2, len(type_name)) + type_name
            tensor_len = len(tensor) + len(_len_field(3, len(part))) + len(part)
            value_head = _len_field(1, len(tag)) + tag + _len_field(2, tensor_len)
            value_len = len(value_head) + tensor_len
            self._fh.write(_len_field(1, value_len) + value_head + tensor + _len_field(3, len(part)))
            self._fh.write(part)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class CkptEntry:
    """One tensor of a ``.ckpt``: name, dims, dtype, and its byte ranges in the file."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # msllm dtype name, or the MindSpore type string when not a supported numeric type
    slices: list
    path: str

    def load(self, fh=None) -> np.ndarray:
        """The storage array (see :func:`cast`)."""
        if self.dtype not in _STORAGE:
            raise MsllmError(f"{self.path}: entry {self.name} has type {self.dtype}, not a numeric tensor")
        own = fh is None
        fh = fh or open(self.path, "rb")
        try:
            total = sum(n for _, n in self.slices)
            expected = tensor_nbytes(self.shape, self.dtype)
            if total != expected:
                raise MsllmError(f"{self.path}: entry {self.name} holds {total} bytes, its shape "
                                 f"{list(self.shape)} {self.dtype} needs {expected}")
            arr = np.empty(self.shape, _STORAGE[self.dtype])
            view, pos = memoryview(arr).cast("B") if expected else memoryview(bytearray()), 0
            for offset, n in self.slices:
                fh.seek(offset)
                if fh.readinto(view[pos:pos + n]) != n:
                    raise MsllmError(f"{self.path}: entry {self.name} is truncated")
                pos += n
            return arr
        finally:
            if own:
                fh.close()


class _Reader:
    def __init__(self, fh, path):
        self.fh, self.path = fh, path

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.fh.read(1)
            if not b:
                raise MsllmError(f"{self.path}: not a MindSpore checkpoint (truncated protobuf)")
            result |= (b[0] & 0x7F) << shift
            if not b[0] & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise MsllmError(f"{self.path}: not a MindSpore checkpoint (bad varint)")

    def fields(self, end: int):
        """Yield (field number, wire type, value) up to byte ``end``; for length-delimited
        fields value = (offset, length) and the caller must leave the file at offset + length."""
        while self.fh.tell() < end:
            key = self.varint()
            number, wire = key >> 3, key & 7
            if wire == 0:
                yield number, wire, self.varint()
            elif wire == 2:
                n = self.varint()
                off = self.fh.tell()
                if off + n > end:
                    raise MsllmError(f"{self.path}: not a MindSpore checkpoint (field runs past its message)")
                yield number, wire, (off, n)
            elif wire == 1:
                yield number, wire, self.fh.read(8)
            elif wire == 5:
                yield number, wire, self.fh.read(4)
            else:
                raise MsllmError(f"{self.path}: not a MindSpore checkpoint (wire type {wire})")


def scan_ckpt(path: str) -> dict[str, CkptEntry]:
    """Index a MindSpore ``.ckpt`` without reading tensor data: ``{name: CkptEntry}`` in file order.

    Consecutive Values with the same tag are one tensor (MindSpore's chunking). A trailing
    ``crc_num`` record (``save_checkpoint(crc_check=True)``) is skipped. Raises MsllmError naming
    the file if it is missing or is not an unencrypted MindSpore checkpoint.
    """
    if not os.path.isfile(path):
        raise MsllmError(f"{path}: checkpoint file not found")
    size = os.path.getsize(path)
    entries: dict[str, CkptEntry] = {}
    last = None
    with open(path, "rb") as fh:
        end = size
        if size >= 17:
            fh.seek(size - 17)
            if fh.read(7) == b"crc_num":
                end = size - 17
            fh.seek(0)
        r = _Reader(fh, path)
        for number, wire, val in r.fields(end):
            if number != 1 or wire != 2:
                raise MsllmError(f"{path}: not a MindSpore checkpoint (unexpected field {number})")
            v_off, v_len = val
            tag, dims, type_name, content = None, [], None, None
            for f2, w2, val2 in r.fields(v_off + v_len):
                if f2 == 1 and w2 == 2:
                    tag = fh.read(val2[1]).decode("utf-8", "replace")
                elif f2 == 2 and w2 == 2:
                    t_off, t_len = val2
                    for f3, w3, val3 in r.fields(t_off + t_len):
                        if f3 == 1 and w3 == 0:
                            dims.append(val3 - (1 << 64) if val3 >= 1 << 63 else val3)
                        elif f3 == 1 and w3 == 2:  # packed dims
                            stop = val3[0] + val3[1]
                            while fh.tell() < stop:
                                dims.append(r.varint())
                        elif f3 == 2 and w3 == 2:
                            type_name = fh.read(val3[1]).decode("utf-8", "replace")
                        elif f3 == 3 and w3 == 2:
                            content = val3
                            fh.seek(val3[0] + val3[1])
                        elif w3 == 2:
                            fh.seek(val3[0] + val3[1])
                elif f2 == 3:
                    raise MsllmError(f"{path}: entry {tag} is a MapParameter, which msllm does not convert")
                elif w2 == 2:
                    fh.seek(val2[0] + val2[1])
            if tag is None or type_name is None or content is None:
                raise MsllmError(f"{path}: not a MindSpore checkpoint (a value lacks its tag, type or data)")
            if tag == last:
                entries[tag].slices.append(content)
            else:
                if tag in entries:
                    raise MsllmError(f"{path}: entry {tag} appears twice")
                dtype = _MS_TYPES.get(type_name, type_name)
                shape = () if dims == [0] else tuple(dims)  # MindSpore's loader reads dims [0] as a scalar
                entries[tag] = CkptEntry(tag, shape, dtype, [content], path)
            last = tag
    return entries


def scan_msllm_checkpoint(path: str) -> dict[str, TensorRef]:
    """``{name: TensorRef}`` of an msllm checkpoint (``.ckpt``, or ``.safetensors`` as the trainer
    writes with ``format: safetensors``), tensor data read on ``load()``."""
    if path.endswith(".safetensors"):
        if not os.path.isfile(path):
            raise MsllmError(f"{path}: checkpoint file not found")
        return _safetensors_refs(path, _Files())
    return {name: TensorRef(name, e.shape, e.dtype, path, e.load) for name, e in scan_ckpt(path).items()}


# ---------------------------------------------------------------------------------------------
# Writing safetensors, one tensor at a time.


class SafetensorsWriter:
    """Write a safetensors file whose tensor list is known in advance, one tensor at a time.

    ``specs``: [(name, dtype, shape)] in file order; ``write(name, data)`` must follow that order
    with storage arrays of the declared dtype and shape. ``metadata`` goes to ``__metadata__``
    (transformers requires ``{"format": "pt"}``). The header is padded with spaces to a multiple of
    8 bytes, as the reference implementation does.
    """

    def __init__(self, path: str, specs: list, metadata: Optional[dict] = None):
        self.path = path
        self.specs = list(specs)
        header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
        for name, dtype, shape in self.specs:
            n = tensor_nbytes(shape, dtype)
            header[name] = {"dtype": _ST_CODE_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)
        self._fh = open(path, "wb")
        self._fh.write(len(blob).to_bytes(8, "little") + blob)
        self._next = 0

    def write(self, name: str, data: np.ndarray) -> None:
        exp_name, dtype, shape = self.specs[self._next]
        if name != exp_name or tuple(data.shape) != tuple(shape) or data.dtype != _STORAGE[dtype]:
            raise ValueError(f"{self.path}: expected {exp_name} {list(shape)} {dtype}, got {name} "
                             f"{list(data.shape)} {data.dtype}")
        data = np.ascontiguousarray(data)
        if data.nbytes:
            self._fh.write(memoryview(data).cast("B"))
        self._next += 1

    def close(self) -> None:
        self._fh.close()
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: {len(self.specs) - self._next} tensor(s) were not written")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self._fh.close()


def parse_size(text) -> int:
    """``"2GB"`` -> 2 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 (bytes); units as
    transformers ``convert_file_size_to_int``. MsllmError for anything else."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise MsllmError(f"--max_shard_size {text!r}: expected bytes or a size like 2GB, 500MB, 1GiB")
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    value = float(m.group(1)) * (units[m.group(2).upper()] if m.group(2) else 1)
    if value < 1:
        raise MsllmError(f"--max_shard_size {text!r} must be at least one byte")
    return int(value)


def plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split tensors (in order) into shards of at most ``max_shard_size`` bytes; a tensor larger
    than that gets a shard of its own (as transformers ``split_torch_state_dict_into_shards``)."""
    shards, current, used = [], [], 0
    for name, n in sizes:
        if current and used + n > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        shards.append(current)
    return shards


# ---------------------------------------------------------------------------------------------
# Conversions.


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, dynamic_ncols=True)


@dataclass
class ConversionResult:
    """What a conversion wrote: output path, the msllm config, tensor count, bytes, dtypes."""

    output: str
    config: LlamaConfig
    tensors: int
    bytes: int
    dtypes: list
    source_kind: str


def convert_hf_to_msllm(hf_dir: str, out_path: str, dtype: Optional[str] = None, progress: bool = True,
                        before_publish: Optional[Callable[[str, LlamaConfig], None]] = None) -> ConversionResult:
    """HF (or Meta) checkpoint directory -> msllm ``.ckpt`` + manifest (``OUT.ckpt.json``).

    Args:
        hf_dir: directory with ``config.json`` + safetensors / ``.bin`` (possibly sharded), or
            ``params.json`` + ``consolidated.NN.pth``.
        out_path: the ``.ckpt`` to write (replaced atomically if it exists).
        dtype: ``fp32``/``fp16``/``bf16`` (or long names) to cast every tensor to; None keeps
            each tensor's dtype.
        progress: show a tqdm bar over tensors (stderr).
        before_publish: called as ``before_publish(tmp_ckpt_path, config)`` after the data is
            written and before it is renamed onto ``out_path``; an exception there (e.g. a failed
            parity check) removes the output.

    Tensor names are mapped with :data:`PARAM_TABLE`; values are copied bit for bit unless
    ``dtype`` casts them (and Meta wq/wk are permuted). Returns a :class:`ConversionResult`.
    Raises MsllmError (see :func:`open_hf_source`) before anything is written.
    """
    from msllm.training.checkpoint import write_sidecar

    dtype = normalize_dtype(dtype)
    if not out_path.endswith(".ckpt"):
        raise MsllmError(f"--mindspore_ckpt_path {out_path!r}: expected a file name ending in .ckpt")
    src = open_hf_source(hf_dir)
    written, dtypes = 0, set()
    try:
        with atomic_path(out_path) as tmp:
            with CkptWriter(tmp) as writer, _progress(len(src.params), "hf -> msllm", progress) as bar:
                for name, ref in src.params.items():
                    out_dtype = dtype or ref.dtype
                    data = cast(ref.load(), ref.dtype, out_dtype)
                    writer.write(name, data, out_dtype)
                    written += data.nbytes
                    dtypes.add(out_dtype)
                    del data
                    bar.update(1)
            if before_publish is not None:
                before_publish(tmp, src.config)
    finally:
        src.close()
    write_sidecar(out_path, src.config, converted_from=os.path.abspath(hf_dir), source_format=src.kind,
                  dtype=sorted(dtypes)[0] if len(dtypes) == 1 else sorted(dtypes))
    return ConversionResult(out_path, src.config, len(src.params), written, sorted(dtypes), src.kind)


def msllm_model_config(ckpt_path: str, config_path: Optional[str]) -> LlamaConfig:
    """The model config of checkpoint ``ckpt_path``: its manifest's ``model_config``, else the
    ``model.model_config`` of run YAML ``config_path``.

    Raises MsllmError naming what is missing (no manifest / no model_config in it, and no
    ``--config``), a file whose size or SHA-256 disagrees with its manifest
    (:func:`msllm.training.checkpoint.verify_checkpoint`), or a manifest config that disagrees
    with the ``--config`` one in a shape field.
    """
    from msllm.config import from_dict, load_config
    from msllm.training.checkpoint import read_sidecar, sidecar_path, verify_checkpoint

    manifest = read_sidecar(ckpt_path)
    yaml_cfg = load_config(config_path).model_config if config_path else None
    side_cfg = None
    if manifest is not None:
        problem = verify_checkpoint(ckpt_path, full=True)  # size and SHA-256 against the manifest
        if problem:
            raise MsllmError(f"{ckpt_path} does not match its manifest {sidecar_path(ckpt_path)}: {problem} "
                             "(truncated or replaced?)")
        if manifest.get("model_config") is not None:
            try:
                side_cfg = from_dict(LlamaConfig, manifest["model_config"], "model_config")
            except MsllmError as exc:
                raise MsllmError(f"{sidecar_path(ckpt_path)}: {exc}") from None
    if side_cfg is not None and yaml_cfg is not None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_heads", "ffn_size",
                    "tie_word_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps"):
            if getattr(side_cfg, key) != getattr(yaml_cfg, key):
                raise MsllmError(f"{config_path}: model_config {key}={getattr(yaml_cfg, key)!r} disagrees "
                                 f"with {sidecar_path(ckpt_path)} ({getattr(side_cfg, key)!r})")
    if side_cfg is not None:
        return side_cfg
    if yaml_cfg is not None:
        return yaml_cfg
    why = "has no manifest" if manifest is None else "has a manifest without model_config"
    raise MsllmError(f"{ckpt_path} {why} ({sidecar_path(ckpt_path)}); pass --config RUN_YAML "
                     "(the run config it was trained with) so the model shape is known")


def msllm_weights(ckpt_path: str, cfg: LlamaConfig) -> dict[str, TensorRef]:
    """The model weights of msllm (or MindFormers-named) checkpoint ``ckpt_path`` in
    :func:`param_shapes` order, trainer entries dropped, names and shapes checked against ``cfg``.

    Raises MsllmError naming the file and tensor: unknown entry, missing weight, wrong shape,
    non-float weight.
    """
    from msllm.convert.mindformers import concat_splits
    from msllm.convert.names import msllm_name_map

    refs = scan_msllm_checkpoint(ckpt_path)
    renamed = msllm_name_map(list(refs), ckpt_path)
    items = []
    for old, ref in refs.items():
        try:
            pieces = concat_splits(old, *ref.shape) if len(ref.shape) == 2 else None
        except ValueError as exc:
            raise MsllmError(f"{ckpt_path}: {exc}") from None
        if not pieces:
            items.append((old, renamed[old], ref))
            continue
        for name, a, b in pieces:  # MindFormers qkv_concat: rows of one stored tensor
            items.append((old, name, TensorRef(name, (b - a,) + ref.shape[1:], ref.dtype, ref.where,
                                               lambda ref=ref, a=a, b=b: np.ascontiguousarray(ref.load()[a:b]))))
    shapes = param_shapes(cfg)
    found: dict[str, TensorRef] = {}
    for old, name, ref in items:
        if is_trainer_entry(name):
            continue
        if name not in shapes:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            raise MsllmError(f"{ckpt_path}: unknown entry {old} (not a weight of the model in the "
                             f"config, nor a trainer entry such as adam_m.* or global_step)")
        if ref.dtype not in FLOAT_DTYPES:
            raise MsllmError(f"{ckpt_path}: weight {old} has dtype {ref.dtype}; expected a float tensor")
        if tuple(ref.shape) != shapes[name]:
            raise MsllmError(f"{ckpt_path}: weight {old} has shape {list(ref.shape)}, the model config "
                             f"implies {list(shapes[name])}")
        found[name] = ref
    missing = [n for n in shapes if n not in found]
    if missing:
        raise MsllmError(f"{ckpt_path} lacks {len(missing)} weight(s) of the model, e.g. {missing[0]}")
    return {n: found[n] for n in shapes}


def convert_msllm_to_hf(ckpt_path: str, out_dir: str, config_path: Optional[str] = None,
                        dtype: Optional[str] = None, max_shard_size="2GB", progress: bool = True,
                        before_publish: Optional[Callable[[str, LlamaConfig], None]] = None) -> ConversionResult:
    """msllm ``.ckpt`` -> HF directory loadable by ``AutoModelForCausalLM.from_pretrained``.

    Writes ``config.json`` (:func:`msllm_config_to_hf`) and ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` when the weights exceed
    ``max_shard_size`` (bytes or ``"2GB"``-style). Model config from the checkpoint manifest, else
    ``config_path`` (:func:`msllm_model_config`). ``dtype`` None keeps each tensor's dtype. Trainer
    entries (``adam_m.*``, ``global_step`` ...) are skipped; MindFormers names are accepted.

    The directory is built as a hidden temporary directory beside ``out_dir`` and renamed onto it
    at the end (after ``before_publish(tmp_dir, config)``); ``out_dir`` must not exist or be empty.
    Raises MsllmError before writing anything for bad input.
    """
    dtype = normalize_dtype(dtype)
    limit = parse_size(max_shard_size)
    if not os.path.isfile(ckpt_path):
        raise MsllmError(f"--mindspore_ckpt_path {ckpt_path}: checkpoint file not found")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise MsllmError(f"--torch_ckpt_dir {out_dir}: already exists and is not an empty directory; "
                         "remove it or choose another")
    cfg = msllm_model_config(ckpt_path, config_path)
    weights = msllm_weights(ckpt_path, cfg)
    out_dtype = {n: dtype or r.dtype for n, r in weights.items()}
    hf_names = {n: msllm_to_hf_name(n) for n in weights}
    sizes = [(n, tensor_nbytes(r.shape, out_dtype[n])) for n, r in weights.items()]
    shards = plan_shards(sizes, limit)
    total = sum(n for _, n in sizes)
    counts: dict[str, int] = {}
    for d in out_dtype.values():
        counts[d] = counts.get(d, 0) + 1
    config_dtype = max(counts, key=counts.get)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", suffix=".tmp", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the published directory gets the usual mode
    try:
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
        weight_map = {}
        with _progress(len(weights), "msllm -> hf", progress) as bar:
            for fname, shard in zip(names, shards):
                specs = [(hf_names[n], out_dtype[n], weights[n].shape) for n in shard]
                with SafetensorsWriter(os.path.join(tmp, fname), specs, {"format": "pt"}) as w:
                    for n in shard:
                        ref = weights[n]
                        data = ref.load()
                        w.write(hf_names[n], cast(data, ref.dtype, out_dtype[n]))
                        weight_map[hf_names[n]] = fname
                        del data
                        bar.update(1)
        if len(shards) > 1:
            write_json_atomic(os.path.join(tmp, "model.safetensors.index.json"),
                              {"metadata": {"total_size": total}, "weight_map": weight_map})
        write_json_atomic(os.path.join(tmp, "config.json"), msllm_config_to_hf(cfg, config_dtype))
        write_json_atomic(os.path.join(tmp, "generation_config.json"),
                          {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                           "pad_token_id": cfg.pad_token_id})
        if before_publish is not None:
            before_publish(tmp, cfg)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConversionResult(out_dir, cfg, len(weights), total, sorted(counts), "msllm")


def read_hf_tensors(hf_dir: str) -> dict[str, np.ndarray]:
    """All weights of an HF directory as ``{HF name: storage array}`` (tests and small models)."""
    src = open_hf_source(hf_dir)
    try:
        return {msllm_to_hf_name(n): ref.load() for n, ref in src.params.items()}
    finally:
        src.close()


def read_msllm_tensors(ckpt_path: str) -> dict[str, tuple[np.ndarray, str]]:
    """All entries of an msllm ``.ckpt`` that are numeric tensors: ``{name: (storage array, dtype)}``."""
    return {n: (r.load(), r.dtype) for n, r in scan_msllm_checkpoint(ckpt_path).items() if r.dtype in _STORAGE}


__all__ = ["PARAM_TABLE", "TRAINER_ENTRIES", "translate_name", "hf_to_msllm_name", "msllm_to_hf_name",
           "param_shapes", "permute_meta_to_hf", "permute_hf_to_meta", "hf_config_to_msllm",
           "msllm_config_to_hf", "model_config_yaml", "open_hf_source", "convert_hf_to_msllm",
           "convert_msllm_to_hf", "CkptWriter", "scan_ckpt", "SafetensorsWriter", "read_safetensors_header",
           "cast", "f32_to_bf16_bits", "bf16_bits_to_f32"]
