"""A network ready for inference from whatever ``load_checkpoint`` names.

Accepted (the kind is detected, see :func:`load_for_inference`):

* an msllm checkpoint (a ``.ckpt`` / ``.safetensors`` file, or a run's output / checkpoint
  directory: the newest complete checkpoint, :func:`msllm.formats.loading.resolve_checkpoint`);
* a checkpoint in MindFormers' LLaMA naming (renamed on load by
  :func:`msllm.formats.loading.load_params`);
* a Hugging Face model directory (``config.json`` + safetensors / ``.bin``, or Meta's
  ``params.json`` + ``consolidated.NN.pth``): converted in memory tensor by tensor with the
  conversion code (:func:`msllm.convert.hf.open_hf_source`); the model's shape then comes from
  its ``config.json``, so an HF download goes straight to predict or chat.

For msllm checkpoints the model shape comes from the run YAML (``model.model_config``); when the
checkpoint's manifest records the config it was saved with, a disagreement in shape or in the
numerics that define the function (rope, norm epsilon, tied head) is one clear error.
The manifest's ``"template"`` (the prompt template the model was trained with, written by the
trainer from the dataset's sidecar) and ``"tokenizer"`` travel in :class:`InferenceInfo`.

LoRA: ``adapter`` (``--adapter``) names an adapter checkpoint of LoRA training (or the PEFT
import), applied on top of the base without merging by :func:`msllm.lora.adapter.load_adapter_into`
(which refuses a base whose SHA-256 differs from the one the adapter records). A checkpoint that
holds base and adapter weights together gets the adapters applied with the run's ``pet_config``
section, else the one its manifest records (:func:`msllm.formats.manifest.manifest_pet_config`: the
manifest's ``"pet_config"`` key, or, in manifests written before that key, inside ``"model_config"``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from msllm.convert.starting import is_hf_dir
from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig

log = logging.getLogger("msllm")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED_TOKENIZER = os.path.join(ROOT, "examples", "data", "tokenizer.model")
BUNDLED_VOCAB = 32000   # LLaMA-1/2's SentencePiece model
# fields that change the function a checkpoint computes without changing any weight's shape
NUMERIC_FIELDS = ("rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings")
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_heads", "ffn_size")


@dataclass
class InferenceInfo:
    """Where the weights came from and what travels with them.

    kind: ``msllm`` (incl. MindFormers-named checkpoints) or ``hf``; path: the file or directory
    loaded; template: prompt template name from the checkpoint manifest (None: not recorded);
    tokenizer: the tokenizer that belongs to the weights (an HF directory itself when it holds
    ``tokenizer.json`` or ``tokenizer.model``, or the manifest's ``"tokenizer"``), None if unknown; eos_token_ids: every EOS id the source
    declares (HF ``config.json`` may list several); adapter: the adapter applied, if any.
    """

    kind: str
    path: str
    template: Optional[str] = None
    tokenizer: Optional[str] = None
    eos_token_ids: tuple = ()
    adapter: Optional[str] = None
    notes: list = field(default_factory=list)
    tokenizer_md5: Optional[str] = None


def _compare_manifest(mc: LlamaConfig, saved: dict, path: str) -> None:
    """MsllmError if the manifest's model config disagrees with ``mc`` in shape or numerics."""
    from msllm.config_io import from_dict

    try:
        other = from_dict(LlamaConfig, saved, "model_config")
    except MsllmError:
        return  # an older / foreign manifest: the shape check of load_into still applies
    diffs = [f"{k}={getattr(other, k)!r} (config: {getattr(mc, k)!r})"
             for k in SHAPE_FIELDS + NUMERIC_FIELDS if getattr(other, k) != getattr(mc, k)]
    if diffs:
        raise MsllmError(f"checkpoint {path} was saved for a different model than model.model_config "
                         f"describes: {'; '.join(diffs)}. Use the YAML the checkpoint was trained with "
                         "(or override --model.model_config.KEY=VALUE)")


def _names_no_model(mc: LlamaConfig) -> bool:
    """True when ``mc`` leaves every shape and numeric field at :class:`LlamaConfig`'s default: a run
    YAML that names no model (like ``configs/smollm2/run_smollm2_135m.yaml``, whose model comes from
    an HF directory's config.json), so a checkpoint's manifest supplies the model."""
    d = LlamaConfig()
    return all(getattr(mc, k) == getattr(d, k) for k in SHAPE_FIELDS + NUMERIC_FIELDS + ("intermediate_size",))


def _manifest_config(saved: dict, path: str) -> LlamaConfig:
    from msllm.config_io import from_dict

    try:
        return from_dict(LlamaConfig, saved, "model_config")
    except MsllmError as exc:
        raise MsllmError(f"{path}: the manifest's model_config cannot be read ({exc}); pass the run YAML the "
                         "checkpoint was trained with (--config)") from None


def _inference_config(mc: LlamaConfig, shape_from: Optional[LlamaConfig] = None) -> LlamaConfig:
    """``shape_from`` (an HF config.json) merged with the run's keys
    (:func:`msllm.convert.configs.merge_run_config`; conflicts logged), else ``mc``."""
    if shape_from is None:
        return mc
    from msllm.models.llama.config import merge_run_config

    merged, conflicts = merge_run_config(shape_from, mc)
    if conflicts:
        log.info("model.model_config: the Hugging Face config.json decides the model; these YAML values have no "
                 "effect: %s", "; ".join(conflicts))
    return merged


def _build(mc: LlamaConfig, fast_paths: bool, device: str):
    from msllm.models.llama.model import LlamaForCausalLM

    net = LlamaForCausalLM(mc, fast_paths=fast_paths, device=device)
    net.set_train(False)
    return net


def _load_hf(path: str, mc_run: LlamaConfig, fast_paths: bool, device: str):
    import mindspore as ms

    from msllm.convert.hf import open_hf_source, to_float32

    src = open_hf_source(path)
    try:
        mc = _inference_config(mc_run, src.config)
        net = _build(mc, fast_paths, device)
        for p in net.get_parameters():
            ref = src.params.get(p.name)
            if ref is None:
                raise MsllmError(f"{path}: no tensor for the model's parameter {p.name}")
            # into the parameter's own dtype: float32, or bfloat16 (param_init_type) where a
            # released bf16 checkpoint round-trips exactly
            p.set_data(ms.Tensor(to_float32(ref.load(), ref.dtype).astype(np.float32), p.dtype))
        eos = src.raw_config.get("eos_token_id") if isinstance(src.raw_config, dict) else None
    finally:
        src.close()
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    from msllm.data.tokenizer import tokenizer_source

    info = InferenceInfo("hf", path, None, tokenizer_source(path), eos_ids)
    gen_cfg = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_cfg):
        info.notes.append(f"{gen_cfg}: only its eos_token_id is read (every end-of-turn id stops generation); "
                          "the other decoding settings come from the run YAML's generation_config (and "
                          "MindFormers' keys in model.model_config)")
    return net, mc, info


def _adapter_modules(params: dict) -> dict:
    """{module: rank} of the LoRA adapter tensors in ``params``."""
    from msllm.lora.targets import split_adapter_name

    found = {}
    for name, value in params.items():
        parts = split_adapter_name(name)
        if parts and parts[1] == "lora_A":
            found[parts[0]] = int(value.shape[0])
    return found


def _load_msllm(path: str, rank: int, mc: LlamaConfig, fast_paths: bool, device: str, pet=None):
    """``pet``: the run's ``pet_config`` (:class:`~msllm.config_lora.PetConfig` or None)."""
    from msllm.formats.loading import load_into, load_params, resolve_checkpoint
    from msllm.formats.manifest import manifest_model_config, manifest_pet_config, read_sidecar

    try:
        ckpt = resolve_checkpoint(path, 0)   # data-parallel ranks hold the same weights: rank 0's
    except MsllmError:
        if rank == 0:
            raise
        ckpt = resolve_checkpoint(path, rank)
    manifest = read_sidecar(ckpt) or {}
    if manifest.get("lora"):
        raise MsllmError(f"{ckpt} is a LoRA adapter checkpoint (no base weights): pass the base model as "
                         f"load_checkpoint and this file as --adapter")
    saved = manifest_model_config(manifest)   # without the pet_config older manifests kept in it
    if saved:
        if _names_no_model(mc):   # e.g. a run YAML for an HF model: the checkpoint's own shape, as for the HF dir
            mc = _inference_config(mc, _manifest_config(saved, ckpt))
        else:
            _compare_manifest(mc, saved, ckpt)
    net = _build(mc, fast_paths, device)
    params = load_params(ckpt, mc)
    adapters = _adapter_modules(params)
    if adapters:
        from msllm.lora.apply import apply_lora

        pet = pet if pet is not None else manifest_pet_config(manifest)
        if pet is None:
            raise MsllmError(f"checkpoint {ckpt} holds LoRA adapters ({len(adapters)} modules) but neither its "
                             "manifest nor the run config has a pet_config (lora_rank, lora_alpha) to apply them with")
        apply_lora(net, pet, modules=sorted(adapters), dropout=0.0)
    elif pet is not None:
        log.info("pet_config has no effect here: checkpoint %s holds no LoRA adapter "
                 "weights (use --adapter for a separate adapter)", ckpt)
    load_into(net, params, ckpt)
    tok, md5 = manifest.get("tokenizer"), manifest.get("tokenizer_md5")
    if isinstance(tok, dict):   # {"file": path, "md5": hex} or a path
        tok, md5 = tok.get("file") or tok.get("path"), tok.get("md5", md5)
    info = InferenceInfo("msllm", ckpt, manifest.get("template"), tok if isinstance(tok, str) else None,
                         (mc.eos_token_id,), tokenizer_md5=md5 if isinstance(md5, str) else None)
    return net, mc, info


def _apply_adapter(net, adapter: str, info: InferenceInfo, rank: int) -> None:
    """LoRA adapter ``adapter`` onto the loaded base (:func:`msllm.lora.adapter.load_adapter_into`:
    the base's SHA-256 must be the one the adapter records; not merged, dropout off)."""
    from msllm.lora.adapter import load_adapter_into

    lora = load_adapter_into(net, adapter, base_path=info.path, rank=rank)
    info.adapter = adapter
    info.notes.append(f"LoRA adapter {adapter}: {len(lora.modules)} module(s), rank {lora.rank}, "
                      f"scale {lora.scale:g}")


def load_for_inference(cfg, path: Optional[str] = None, adapter: Optional[str] = None, rank: int = 0,
                       fast_paths: Optional[bool] = None):
    """Build the model and load weights for predict / chat / eval.

    Args:
        cfg: the :class:`~msllm.config.RunConfig` (``model.model_config``, ``fast_paths``,
            ``load_checkpoint``).
        path: what to load; default ``cfg.load_checkpoint``. An HF/Meta directory (has
            ``config.json`` / ``params.json``), else an msllm/MindFormers checkpoint file or
            directory (rank 0's newest complete checkpoint; this ``rank``'s if rank 0 has none).
        adapter: a LoRA adapter checkpoint to apply on top (``--adapter``).
        fast_paths: the model's builder argument; None = ``cfg.fast_paths`` (benchmarks compare).

    Returns:
        ``(net, model_config, info)``: a ``LlamaForCausalLM`` in inference mode (float32 on CPU,
        or bfloat16 parameters with ``param_init_type: bfloat16``; with ``quantization_config`` the
        linear layers then quantized to int8, :func:`msllm.models.llama.int8_model.quantize_model`)
        with the weights loaded, the :class:`LlamaConfig` it was built from, and
        :class:`InferenceInfo`. On msllm's CPU kernels each kind of decoder-layer weight is then stacked
        over the layers (:func:`msllm.models.llama.stacked.stack_decoder_weights`; inference only).

    Raises:
        MsllmError: nothing to load, a missing/unreadable/corrupt checkpoint, a shape or config
            mismatch between checkpoint and config (naming both), a malformed HF directory.
    """
    path = path or cfg.load_checkpoint
    if not path:
        raise MsllmError("nothing to run: set load_checkpoint (--load_checkpoint CKPT: an msllm or MindFormers "
                         "checkpoint, or a Hugging Face model directory)")
    if not os.path.exists(path):
        raise MsllmError(f"load_checkpoint {path!r} does not exist")
    fast = cfg.fast_paths if fast_paths is None else fast_paths
    if is_hf_dir(path):
        net, mc, info = _load_hf(path, cfg.model_config, fast, cfg.context.device_target)
    else:
        net, mc, info = _load_msllm(path, rank, cfg.model_config, fast, cfg.context.device_target,
                                    cfg.pet_config)
    if adapter:
        _apply_adapter(net, adapter, info, rank)
    if mc.quantization_config is not None:   # weight-only int8, quantized from the loaded weights
        from msllm.models.llama.int8_model import quantize_model

        quantize_model(net, mc.quantization_config, net.kernels.cpu)
    if net.kernels.cpu is not None:   # the decode step's one operator takes each kind of weight once
        from msllm.models.llama.stacked import stack_decoder_weights

        stack_decoder_weights(net.model, net.kernels.cpu)
    for note in info.notes:
        log.info("%s", note)
    net.set_train(False)
    log.info("loaded %s weights from %s (%d layers, hidden %d, heads %d/%d kv, vocab %d, context %d)%s",
             info.kind, info.path, mc.num_layers, mc.hidden_size, mc.num_heads, mc.kv_heads, mc.vocab_size,
             mc.max_positions, f"; template {info.template!r}" if info.template else "")
    return net, mc, info


def find_tokenizer(info: InferenceInfo, explicit: Optional[str] = None, vocab_size: Optional[int] = None) -> str:
    """Where the tokenizer is: ``explicit`` (``--tokenizer``: a ``.model``, a ``tokenizer.json`` or
    an HF model directory), else the one that came with the weights (:attr:`InferenceInfo.tokenizer`:
    the HF directory's own, or the file a checkpoint's manifest records; if that file is gone but
    the bundled LLaMA tokenizer has the recorded MD5, the bundled one), else the bundled LLaMA
    tokenizer ``examples/data/tokenizer.model`` (LLaMA-1/2's and msllm's demo's, logged) -- but
    only for a model of LLaMA's ``vocab_size`` 32000 (``vocab_size`` None: not checked).

    Raises MsllmError: the chosen file does not exist; no tokenizer came with a model whose
    vocab_size is not 32000 (no silent fallback)."""
    from msllm.data.tokenizer import file_md5

    if explicit:
        if not os.path.exists(explicit):
            raise MsllmError(f"--tokenizer {explicit} does not exist")
        return explicit
    if info.tokenizer:
        if os.path.exists(info.tokenizer):
            return info.tokenizer
        bundled_ok = os.path.isfile(BUNDLED_TOKENIZER) and file_md5(BUNDLED_TOKENIZER) == info.tokenizer_md5
        if info.tokenizer_md5 and bundled_ok:
            log.info("tokenizer: %s (recorded with %s) is gone; the bundled %s has the same MD5", info.tokenizer,
                     info.path, BUNDLED_TOKENIZER)
            return BUNDLED_TOKENIZER
        raise MsllmError(f"the tokenizer recorded with {info.path} ({info.tokenizer}) does not exist: pass the "
                         "model's tokenizer with --tokenizer")
    if vocab_size is not None and vocab_size != BUNDLED_VOCAB:
        raise MsllmError(f"{info.path} brings no tokenizer and the model's vocab_size is {vocab_size}, so the bundled "
                         f"LLaMA tokenizer ({BUNDLED_VOCAB} ids) is not its tokenizer: pass --tokenizer (the model's "
                         "tokenizer.model, tokenizer.json or Hugging Face directory)")
    if not os.path.isfile(BUNDLED_TOKENIZER):
        raise MsllmError("no tokenizer: pass --tokenizer PATH (a tokenizer.model, a tokenizer.json or an HF directory)")
    log.info("tokenizer: %s (the bundled LLaMA tokenizer; the checkpoint names none)", BUNDLED_TOKENIZER)
    return BUNDLED_TOKENIZER


def open_tokenizer(info: InferenceInfo, mc: LlamaConfig, explicit: Optional[str] = None,
                   pad_id: Optional[int] = None):
    """The tokenizer for the loaded model (:func:`find_tokenizer`, then
    :func:`msllm.data.tokenizer.load_tokenizer`), checked to fit ``mc.vocab_size``
    (:func:`msllm.data.tokenizer.check_vocab`); its end-of-turn ids gain the ones the weights
    declare (:attr:`InferenceInfo.eos_token_ids`). Logged once.

    Raises MsllmError: as :func:`find_tokenizer`, a malformed tokenizer, ids beyond the model's vocabulary."""
    from msllm.data.tokenizer import check_vocab, load_tokenizer

    from msllm.data.tokenizer import file_md5

    tok = load_tokenizer(find_tokenizer(info, explicit, mc.vocab_size), pad_id)
    check_vocab(tok, mc.vocab_size, info.path)
    if mc.vocab_size != BUNDLED_VOCAB and os.path.isfile(BUNDLED_TOKENIZER) and tok.kind == "sentencepiece" \
            and file_md5(tok.model_file) == file_md5(BUNDLED_TOKENIZER):
        raise MsllmError(f"tokenizer {tok.model_file} is the bundled LLaMA tokenizer ({BUNDLED_VOCAB} ids), but the "
                         f"model ({info.path}) has vocab_size {mc.vocab_size}: it is not this model's tokenizer; "
                         "pass the model's own (--tokenizer)")
    tok.eos_ids = tuple(dict.fromkeys(tuple(info.eos_token_ids) + tuple(tok.eos_ids)))
    log.info("tokenizer: %s (%s, %d ids, BOS %s, end-of-turn ids %s)", tok.model_file, tok.kind, tok.vocab_size,
             "added" if tok.add_bos else "not added", list(tok.eos_ids))
    return tok
