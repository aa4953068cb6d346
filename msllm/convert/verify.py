"""Logits parity: the same token ids through HF ``transformers.LlamaForCausalLM`` and msllm's
``LlamaForCausalLM`` (MindSpore, CPU), both in float32.

The ids are a real English sentence tokenized with the real LLaMA tokenizer
(``examples/data/tokenizer.model``), or the ``--tokenizer`` given (any kind
:func:`msllm.data.tokenizer.load_tokenizer` reads), BOS first when the tokenizer has one;
for a model whose vocabulary is smaller than the tokenizer's, ids are taken modulo the vocabulary.
The check reports ``max |logit_hf - logit_msllm|`` over every position and vocabulary entry and
both models' greedy continuations (argmax, a few tokens). It passes when the difference is at
most the tolerance (1e-4 by default, for float32) and the continuations agree.

The msllm side loads its weights from the converted ``.ckpt`` through the trainer's own path
(``load_params`` -> ``load_into``, MindFormers names renamed on the way), so the check
covers what training will see. Weights stored in fp16/bf16 are cast to float32 on both sides.

Greedy decoding feeds a fixed-length buffer (prompt + new tokens, later slots padded) and reads
the logits at the last real position: with a causal mask later slots cannot change earlier
logits, and GRAPH mode compiles once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig

SENTENCE = ("The capital of France is Paris, and the capital of Germany is Berlin. "
            "In 1969, Neil Armstrong became the first person to walk on the Moon.")
DEFAULT_TOLERANCE = 1e-4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TOKENIZER = os.path.join(ROOT, "examples", "data", "tokenizer.model")


class ParityError(Exception):
    """The converted model's logits differ from the reference beyond the tolerance (not a user
    input error: the CLI exits 1, not 2)."""


@dataclass
class ParityReport:
    """Result of :func:`check_parity`.

    max_abs_diff: max |logit difference| over (T, V); tokens: the prompt ids (T of them);
    hf_next / msllm_next: greedy continuations (ids); hf_text / msllm_text: their decoded text;
    reference_std: standard deviation of the HF logits (the scale the difference is measured on).
    """

    max_abs_diff: float
    tolerance: float
    tokens: list
    hf_next: list
    msllm_next: list
    hf_text: str
    msllm_text: str
    modulo_vocab: bool
    reference_std: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.max_abs_diff <= self.tolerance) and self.hf_next == self.msllm_next

    def lines(self) -> list[str]:
        """Human-readable summary, one fact per line."""
        note = " (ids mod vocab_size)" if self.modulo_vocab else ""
        return [f"verify: {len(self.tokens)} prompt tokens{note}: {SENTENCE!r}",
                f"verify: max |logit diff| = {self.max_abs_diff:.3e} (tolerance {self.tolerance:g}; "
                f"HF logits std {self.reference_std:.3g})",
                f"verify: HF greedy    {self.hf_next} {self.hf_text!r}",
                f"verify: msllm greedy {self.msllm_next} {self.msllm_text!r}",
                f"verify: {'PASSED' if self.ok else 'FAILED'}"]


def sentence_ids(vocab_size: int, tokenizer_path: Optional[str] = None, text: str = SENTENCE,
                 max_len: Optional[int] = None) -> tuple[list[int], bool]:
    """``([bos] + tokenize(text), modulo)``: ids < ``vocab_size`` (mod when the tokenizer's
    vocabulary is larger; ``modulo`` tells), at most ``max_len`` of them."""
    from msllm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_path or DEFAULT_TOKENIZER)
    ids = ([tok.bos_id] if tok.bos_id is not None and tok.bos_id >= 0 else []) + tok.encode(text)
    modulo = vocab_size < tok.vocab_size
    if modulo:
        ids = [i % vocab_size for i in ids]
    return (ids[:max_len] if max_len else ids), modulo


def greedy(logits_fn: Callable[[list], np.ndarray], ids: list, n_new: int, pad: int = 0) -> list[int]:
    """Greedy continuation of ``ids`` by ``n_new`` tokens; ``logits_fn(ids) -> (T, V)``.

    Runs on a fixed buffer of ``len(ids) + n_new`` ids (see the module docstring)."""
    buf = list(ids) + [pad] * n_new
    out = []
    for k in range(n_new):
        pos = len(ids) + k - 1
        nxt = int(np.argmax(logits_fn(buf)[pos]))
        buf[pos + 1] = nxt
        out.append(nxt)
    return out


def msllm_network(cfg: LlamaConfig, ckpt_path: str, seq_length: int, mode: str = "pynative",
                  fast_paths: bool = False):
    """msllm ``LlamaForCausalLM`` (float32, MindSpore CPU, ``mode`` pynative/graph, the CPU
    ``fast_paths`` or the Ascend-shaped path) with the weights of ``ckpt_path`` loaded as the
    trainer loads them. Sets the global MindSpore context."""
    import mindspore as ms

    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.formats.loading import load_into, load_params

    if mode not in ("pynative", "graph"):
        raise MsllmError(f"verify mode {mode!r}: expected pynative or graph")
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE if mode == "pynative" else ms.GRAPH_MODE)
    fp32 = replace(cfg, seq_length=seq_length, max_position_embeddings=cfg.max_positions,
                   compute_dtype="float32", layernorm_compute_type="float32",
                   softmax_compute_type="float32", param_init_type="float32")
    net = LlamaForCausalLM(fp32, fast_paths=fast_paths)
    net.set_train(False)
    load_into(net, load_params(ckpt_path, fp32), ckpt_path)
    return net


def msllm_logits_fn(net) -> Callable[[list], np.ndarray]:
    """``ids -> (T, V) float32 logits`` of an msllm network."""
    import mindspore as ms

    def run(ids):
        return net(ms.Tensor(np.asarray([ids], np.int32))).asnumpy()[0]
    return run


def hf_model(hf_dir: str):
    """``transformers.AutoModelForCausalLM.from_pretrained(hf_dir)`` in float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_model_from_ckpt(ckpt_path: str, cfg: LlamaConfig):
    """The transformers model of ``cfg``'s family (``LlamaForCausalLM``, ``Qwen2ForCausalLM`` ...)
    built from ``cfg`` holding the weights of msllm checkpoint ``ckpt_path`` (for inputs without
    an HF directory, e.g. Meta checkpoints)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from msllm.convert.configs import msllm_config_to_hf
    from msllm.convert.driver import msllm_weights
    from msllm.formats.dtypes import to_float32
    from msllm.models.llama.names import msllm_to_hf_name

    hf_cfg = msllm_config_to_hf(cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg),
                                             attn_implementation="eager").eval()
    state = {msllm_to_hf_name(n): torch.from_numpy(to_float32(r.load(), r.dtype))
             for n, r in msllm_weights(ckpt_path, cfg).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"HF model state mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def hf_logits_fn(model) -> Callable[[list], np.ndarray]:
    """``ids -> (T, V) float32 logits`` of a transformers causal LM."""
    import torch

    def run(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()
    return run


def round_weights(hf=None, net=None, dtype: Optional[str] = None) -> None:
    """Round every weight of the HF model ``hf`` and/or msllm network ``net`` to ``dtype``
    (``float16``/``bfloat16``) and back to float32, in place; None or float32 does nothing.

    Used when a conversion casts (``--dtype``): both sides then hold the same rounded values
    (torch's rounding and :func:`msllm.formats.dtypes.cast` are both round-to-nearest-even).
    """
    if dtype in (None, "float32"):
        return
    from msllm.formats.dtypes import cast

    if hf is not None:
        import torch

        tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.to(tdtype).float())
    if net is not None:
        import mindspore as ms

        for p in net.get_parameters():
            x = p.asnumpy().astype(np.float32)
            p.set_data(ms.Tensor(cast(cast(x, "float32", dtype), dtype, "float32"), ms.float32))


def check_parity(cfg: LlamaConfig, ckpt_path: str, hf_dir: Optional[str] = None, hf=None,
                 tolerance: float = DEFAULT_TOLERANCE, n_new: int = 5, mode: str = "pynative",
                 tokenizer_path: Optional[str] = None, round_to: Optional[str] = None,
                 fast_paths: bool = False) -> ParityReport:
    """Run the sentence through the HF model (``hf`` or loaded from ``hf_dir``, else built from
    the checkpoint) and through msllm loaded from ``ckpt_path``; return the :class:`ParityReport`.

    ``round_to``: the dtype a conversion cast to (see :func:`round_weights`), so a cast output is
    compared with the equally rounded reference. The MindSpore execution mode is restored
    afterwards. Does not raise on a mismatch (see :meth:`ParityReport.ok`); raises MsllmError for
    bad inputs.
    """
    from msllm.data.tokenizer import load_tokenizer

    import mindspore as ms

    n_new = max(1, n_new)
    ids, modulo = sentence_ids(cfg.vocab_size, tokenizer_path, max_len=max(2, cfg.max_positions - n_new))
    if hf is None:
        hf = hf_model(hf_dir) if hf_dir else hf_model_from_ckpt(ckpt_path, cfg)
    previous_mode = ms.get_context("mode")
    try:
        net = msllm_network(cfg, ckpt_path, len(ids) + n_new, mode, fast_paths)
        round_weights(hf, net, round_to)
        hf_fn, ms_fn = hf_logits_fn(hf), msllm_logits_fn(net)
        ref = hf_fn(ids)
        got = ms_fn(ids)
        diff = float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64))))
        hf_next, ms_next = greedy(hf_fn, ids, n_new), greedy(ms_fn, ids, n_new)
    finally:
        ms.set_context(mode=previous_mode)  # leave the process's execution mode as it was
    tok = load_tokenizer(tokenizer_path or DEFAULT_TOKENIZER)

    def text(next_ids):
        return tok.decode([i for i in next_ids if i < tok.vocab_size])
    return ParityReport(diff, tolerance, ids, hf_next, ms_next, text(hf_next), text(ms_next), modulo,
                        float(np.std(ref)))


def make_random_hf_model(out_dir: Optional[str] = None, seed: int = 0, dtype: str = "float32",
                         fmt: str = "safetensors", max_shard_size: Optional[str] = None, model_type: str = "llama",
                         **config):
    """A seeded random transformers causal LM of ``model_type``'s family (``llama`` ->
    ``LlamaForCausalLM``, ``qwen2``, ``qwen3``, ``mistral``, ``gemma``; for tests and benchmarks; no hub).

    ``config``: the family's config fields. Every weight is drawn at a scale that keeps
    activations O(1) (matrices N(0, 1/in_features), embedding N(0, 1), RMSNorm scales
    1 + N(0, 0.2) (Gemma's stored w = N(0, 0.2), its scale being 1 + w), biases N(0, 0.2)), so
    logits are O(1) and a wrong layout shows up far above the tolerance.
    ``fmt``: ``safetensors`` (``save_pretrained``, sharded when ``max_shard_size`` is given) or
    ``bin`` (``pytorch_model.bin``, or shards + ``pytorch_model.bin.index.json`` with
    ``max_shard_size``, as transformers 4 wrote them). Returns the model (float32, eval).
    """
    import copy
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config),
                                             attn_implementation="eager").eval()
    offset = model_type == "gemma"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                neutral = 0.0 if offset or name.endswith(".bias") else 1.0
                p.copy_(neutral + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)   # fan-in: (out, in), experts (E, out, in)
    if out_dir is None:
        return model
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    saved = model
    if tdtype != torch.float32:
        # round the returned model's weights (not its buffers: the rotary inv_freq stays float32,
        # as from_pretrained(dtype=float32) recomputes it) and save a low-precision copy
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(tdtype).float())
        saved = copy.deepcopy(model).to(tdtype)
    if fmt == "safetensors":
        saved.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    elif fmt == "bin":
        os.makedirs(out_dir, exist_ok=True)
        saved.config.save_pretrained(out_dir)
        state = {k: v.contiguous() for k, v in saved.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        if max_shard_size is None:
            torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
        else:
            names = list(state)
            half = len(names) // 2
            weight_map = {}
            for k, part in enumerate((names[:half], names[half:])):
                fname = f"pytorch_model-{k + 1:05d}-of-00002.bin"
                torch.save({n: state[n] for n in part}, os.path.join(out_dir, fname))
                weight_map.update({n: fname for n in part})
            with open(os.path.join(out_dir, "pytorch_model.bin.index.json"), "w") as fh:
                json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    else:
        raise ValueError(f"fmt {fmt!r}: expected safetensors or bin")
    return model


def write_random_hf_dir(out_dir: str, seed: int = 0, dtype: str = "float32", max_shard_size="2GB",
                        **config) -> dict:
    """Write a random LLaMA HF directory (``config.json`` + safetensors) without torch, one tensor
    at a time, so models of any size can be made with little memory (memory benchmarks).

    ``config``: HF ``LlamaConfig`` fields (``vocab_size``, ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, optional ``num_key_value_heads``...). Values
    are N(0, 1/in_features) (norms 1 + N(0, 0.2)). Returns the ``config.json`` dict.
    """
    import json

    from msllm.convert.configs import hf_config_to_msllm
    from msllm.convert.driver import parse_size, plan_shards
    from msllm.formats.dtypes import cast, tensor_nbytes
    from msllm.formats.safetensors import SafetensorsWriter
    from msllm.models.llama.names import msllm_to_hf_name, param_shapes

    hf_cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": dtype, **config}
    cfg = hf_config_to_msllm(hf_cfg, "config")
    shapes = {msllm_to_hf_name(n): s for n, s in param_shapes(cfg).items()}
    shards = plan_shards([(n, tensor_nbytes(s, dtype)) for n, s in shapes.items()], parse_size(max_shard_size))
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map = {}
    for fname, shard in zip(names, shards):
        with SafetensorsWriter(os.path.join(out_dir, fname), [(n, dtype, shapes[n]) for n in shard]) as w:
            for n in shard:
                shape = shapes[n]
                x = (1 + 0.2 * rng.standard_normal(shape, np.float32)) if len(shape) == 1 else \
                    rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(shape[1]))
                w.write(n, cast(x, "float32", dtype))
                weight_map[n] = fname
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": sum(tensor_nbytes(s, dtype) for s in shapes.values())},
                       "weight_map": weight_map}, fh)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_cfg, fh, indent=2)
    return hf_cfg


__all__ = ["SENTENCE", "DEFAULT_TOLERANCE", "ParityError", "ParityReport", "sentence_ids", "greedy",
           "msllm_network", "hf_model", "hf_model_from_ckpt", "round_weights", "check_parity",
           "make_random_hf_model", "write_random_hf_dir"]
