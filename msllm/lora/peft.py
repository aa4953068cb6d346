"""LoRA adapters <-> Hugging Face PEFT adapter directories.

A PEFT LoRA directory (``peft.PeftModel.save_pretrained``) holds ``adapter_config.json``
(``peft.LoraConfig`` fields: ``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules``, ``bias``, ``fan_in_fan_out``, ``use_rslora``, ``use_dora``, ...) and
``adapter_model.safetensors`` with tensors ``base_model.model.<module>.lora_A.weight`` (r, in) and
``...lora_B.weight`` (out, r) (``peft.utils.save_and_load.get_peft_model_state_dict`` drops the
adapter name ``default``). msllm's adapter names are ``<module>.lora_A.weight`` with the same
(HF) module names, so the tensors copy 1:1. Reference: peft 0.21 (``peft/tuners/lora/config.py``,
``peft/tuners/lora/layer.py``).

Only vanilla LoRA on LLaMA's linear layers imports: DoRA, bias terms, per-module ranks or alphas
(``rank_pattern`` / ``alpha_pattern``), ``modules_to_save``, ``fan_in_fan_out`` (GPT-2 style
Conv1D) and modules LLaMA does not have are refused with one error naming what was found.
``use_rslora`` (scale alpha / sqrt(r)) imports as the equivalent ``lora_alpha = alpha * sqrt(r)``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from typing import Optional

import numpy as np

from msllm.errors import MsllmError
from msllm.lora.targets import adapter_names, exact_target_regex, is_linear_module, linear_modules

log = logging.getLogger("msllm")

PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.default)?\.weight$")
# adapter_config.json fields that change the computation away from vanilla LoRA when truthy
_REFUSED_TRUE = ("use_dora", "lora_bias", "fan_in_fan_out", "layer_replication", "use_qalora", "use_bdlora")
_REFUSED_NONEMPTY = ("modules_to_save", "rank_pattern", "alpha_pattern", "trainable_token_indices")


def _peft_target_modules(modules: list[str], model_config) -> object:
    """``target_modules`` for ``adapter_config.json``: the short names (``["q_proj", "v_proj"]``,
    PEFT's usual form, matched as name suffixes) when they select exactly ``modules`` in a model
    of ``model_config``; otherwise a regex PEFT ``re.fullmatch``-es to exactly these modules."""
    if model_config is not None:
        short = sorted({m.rsplit(".", 1)[-1] for m in modules})
        same = [m for m in linear_modules(model_config) if m.rsplit(".", 1)[-1] in short]
        if sorted(same) == sorted(modules):
            return short
    return exact_target_regex(modules)


def export_peft(adapter_ckpt: str, out_dir: str, base_model_name_or_path: Optional[str] = None) -> dict:
    """msllm adapter checkpoint -> PEFT directory ``out_dir`` (``adapter_config.json`` +
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained(hf_base_model, out_dir)``
    loads.

    ``base_model_name_or_path`` goes into the config (default: the recorded base if it is an HF
    directory, else null). ``out_dir`` must not exist or be empty; it is built beside itself and
    renamed at the end. Returns the ``adapter_config.json`` dict. Raises MsllmError for a file
    that is not an adapter, or a non-empty ``out_dir``.
    """
    from safetensors.numpy import save_file

    from msllm.formats.dtypes import to_float32
    from msllm.formats.mindspore_ckpt import scan_checkpoint
    from msllm.lora.adapter import model_config_of, pet_config_of, read_adapter_manifest

    manifest = read_adapter_manifest(adapter_ckpt)
    rec, pet = manifest["lora"], pet_config_of(manifest)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise MsllmError(f"--torch_ckpt_dir {out_dir}: already exists and is not an empty directory")
    refs = scan_checkpoint(adapter_ckpt)
    tensors = {}
    for module in rec["modules"]:
        for name in adapter_names(module):
            if name not in refs:
                raise MsllmError(f"LoRA adapter {adapter_ckpt} lacks {name}")
            ref = refs[name]
            tensors[PREFIX + name] = np.ascontiguousarray(to_float32(ref.load(), ref.dtype))
    base = rec.get("base") or {}
    if base_model_name_or_path is None and base.get("kind") == "hf_dir":
        base_model_name_or_path = base.get("path")
    alpha = float(pet.lora_alpha)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(pet.lora_rank),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha, "lora_dropout": float(pet.lora_dropout),
        "target_modules": _peft_target_modules(rec["modules"], model_config_of(manifest)),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path, "revision": None,
    }
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", suffix=".tmp", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=2)
            fh.write("\n")
        os.chmod(tmp, 0o755)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return config


def _read_peft_dir(peft_dir: str) -> tuple[dict, dict]:
    """(adapter_config, {name: float32 array}) of a PEFT directory; MsllmError naming the file."""
    cfg_path = os.path.join(peft_dir, "adapter_config.json")
    if not os.path.isdir(peft_dir):
        raise MsllmError(f"{peft_dir}: not a directory (expected a PEFT adapter directory)")
    if not os.path.isfile(cfg_path):
        raise MsllmError(f"{peft_dir}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MsllmError(f"{cfg_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise MsllmError(f"{cfg_path}: expected a JSON object")
    st, binf = os.path.join(peft_dir, "adapter_model.safetensors"), os.path.join(peft_dir, "adapter_model.bin")
    if os.path.isfile(st):
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            raw = load_file(st)
        except (SafetensorError, OSError, ValueError) as exc:
            raise MsllmError(f"{st}: cannot be read as safetensors ({exc})") from None
        tensors = {k: v.astype(np.float32) for k, v in raw.items()}
    elif os.path.isfile(binf):
        from msllm.formats.torch_weights import torch_load

        tensors = {k: v.float().numpy() for k, v in torch_load(binf).items()}
    else:
        raise MsllmError(f"{peft_dir}: no adapter_model.safetensors or adapter_model.bin")
    return config, tensors


def _check_vanilla(config: dict, where: str) -> tuple[int, float]:
    """(r, alpha with rsLoRA folded in) of a vanilla LoRA config; MsllmError otherwise."""
    if config.get("peft_type") != "LORA":
        raise MsllmError(f"{where}: peft_type={config.get('peft_type')!r}; msllm imports LoRA adapters "
                         "(peft_type LORA) only")
    task = config.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise MsllmError(f"{where}: task_type={task!r}; msllm's LLaMA is a causal LM (CAUSAL_LM)")
    for key in _REFUSED_TRUE:
        if config.get(key):
            raise MsllmError(f"{where}: {key}={config[key]!r} is not vanilla LoRA; msllm supports plain "
                             "LoRA on Linear layers (W + alpha/r B A) only")
    for key in _REFUSED_NONEMPTY:
        if config.get(key):
            raise MsllmError(f"{where}: {key}={config[key]!r}; msllm supports one rank and alpha for all "
                             "modules and no fully trained extra modules")
    if config.get("bias", "none") != "none":
        raise MsllmError(f"{where}: bias={config['bias']!r}; msllm's LoRA has no bias terms (expected 'none')")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise MsllmError(f"{where}: r={r!r}; expected an integer > 0")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise MsllmError(f"{where}: lora_alpha={alpha!r}; expected a number > 0")
    alpha = float(alpha)
    if config.get("use_rslora"):  # PEFT: scaling = alpha / sqrt(r) = (alpha * sqrt(r)) / r
        alpha = alpha * math.sqrt(r)
        log.info("%s: use_rslora: imported as lora_alpha %.6g (= alpha * sqrt(r)), the same scale", where, alpha)
    return r, alpha


def import_peft(peft_dir: str, out_ckpt: str, base: Optional[str] = None, rank: int = 0) -> dict:
    """PEFT LoRA directory -> msllm adapter checkpoint ``out_ckpt`` (+ manifest).

    Args:
        peft_dir: ``adapter_config.json`` + ``adapter_model.safetensors`` (or ``.bin``).
        out_ckpt: the adapter ``.ckpt`` to write (atomically).
        base: the msllm/HF base model it will be used with (optional): its shapes are checked and
            its identity recorded, so later loads refuse another base; without it the manifest
            records no base (``"base": null``) and loads check shapes only.

    Returns the manifest. Raises MsllmError (nothing written): not a PEFT LoRA directory, a non-
    vanilla LoRA (see the module docstring), a tensor for a module LLaMA does not have (an adapter
    for another architecture), an A without its B, ranks that disagree with ``r``, shapes that do
    not fit ``base``.
    """
    import mindspore as ms

    from msllm.formats.manifest import write_sidecar
    from msllm.fileio import atomic_path
    from msllm.lora.adapter import lora_record
    from msllm.config_lora import PetConfig

    if not out_ckpt.endswith(".ckpt"):
        raise MsllmError(f"{out_ckpt!r}: expected an adapter file name ending in .ckpt")
    config, tensors = _read_peft_dir(peft_dir)
    where = os.path.join(peft_dir, "adapter_config.json")
    r, alpha = _check_vanilla(config, where)
    found: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        module = m.group("module") if m else None
        if module is None or not is_linear_module(module):
            arch = config.get("base_model_name_or_path")
            raise MsllmError(
                f"{peft_dir}: tensor {key} does not adapt a LLaMA linear layer (expected "
                f"{PREFIX}model.layers.{{i}}.self_attn.q_proj.lora_A.weight style names for "
                f"q/k/v/o_proj, gate/up/down_proj or lm_head); this adapter is for another architecture"
                + (f" (base_model_name_or_path {arch!r})" if arch else ""))
        found.setdefault(module, {})[m.group("which")] = value
    if not found:
        raise MsllmError(f"{peft_dir}: the adapter holds no LoRA tensors")
    for module, pair in found.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise MsllmError(f"{peft_dir}: {module} has {sorted(pair)} but not both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise MsllmError(f"{peft_dir}: {module} lora_A {list(a.shape)} / lora_B {list(b.shape)} do not have "
                             f"rank r={r} of {where}")
    modules = sorted(found, key=_module_order)
    model_config, identity = None, None
    if base:
        from msllm.convert.starting import base_identity, open_base

        src = open_base(base, rank=rank)
        src.close()
        shapes = linear_modules(src.config)
        for module in modules:
            if module not in shapes:
                raise MsllmError(f"{peft_dir}: adapts {module}, which base {base} does not have "
                                 f"({src.config.num_layers} layers)")
            out_f, in_f = shapes[module]
            if found[module]["lora_A"].shape[1] != in_f or found[module]["lora_B"].shape[0] != out_f:
                raise MsllmError(f"{peft_dir}: {module} adapts a ({found[module]['lora_B'].shape[0]}, "
                                 f"{found[module]['lora_A'].shape[1]}) weight, base {base} has ({out_f}, {in_f})")
        identity = base_identity(base, rank)
        model_config = src.config
    pet = PetConfig(pet_type="lora", lora_rank=r, lora_alpha=alpha, lora_dropout=float(config.get("lora_dropout") or 0.0),
                    target_modules=exact_target_regex(modules))
    items = []
    for module in modules:
        a_name, b_name = adapter_names(module)
        items.append({"name": a_name, "data": ms.Tensor(found[module]["lora_A"])})
        items.append({"name": b_name, "data": ms.Tensor(found[module]["lora_B"])})
    with atomic_path(out_ckpt) as tmp:
        ms.save_checkpoint(items, tmp)
    record = lora_record(pet, modules, identity, source="peft")
    record["peft"] = {"path": os.path.abspath(peft_dir),
                      "base_model_name_or_path": config.get("base_model_name_or_path")}
    return write_sidecar(out_ckpt, model_config, pet, lora=record)


def _module_order(module: str) -> tuple:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    order = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    if m:
        return (int(m.group(1)), order.index(m.group(2)) if m.group(2) in order else 99)
    return (1 << 30, 0)


__all__ = ["export_peft", "import_peft", "PREFIX"]
