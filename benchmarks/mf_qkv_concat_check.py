#!/usr/bin/env python
"""Check msllm against MindFormers' own qkv_concat converter, bit for bit.

MindFormers 1.9.0 runs in its own venv (``benchmarks/setup_mindformers.sh`` creates
``benchmarks/.venv-mindformers``; about 3 GB, installs from PyPI).
MindFormers' converter loads the HF model with transformers, so torch is installed into that
venv when missing (same version as msllm's). Steps:

1. (msllm venv) a seeded random ``transformers.LlamaForCausalLM`` with grouped-query attention
   (6 query / 2 key-value heads, the shape of issue #12) and one with multi-head attention,
   saved as HF directories;
2. (MindFormers venv) MindFormers' ``mindformers/models/llama/convert_weight.py``:
   ``convert_pt_to_ms`` (HF -> MindFormers names), then ``convert_to_qkv_concat`` /
   ``convert_qkv_concat_weight`` (fused ``w_qkv`` / ``w_gate_hidden`` in Megatron row order);
3. (msllm venv) ``msllm.training.checkpoint.load_params`` (the loader of training, predict and
   HF export) on both outputs: every msllm weight must equal the HF tensor exactly.

Usage::

    bash benchmarks/setup_mindformers.sh          # once
    .venv/bin/python benchmarks/mf_qkv_concat_check.py [--mf-python benchmarks/.venv-mindformers/bin/python]

Writes ``benchmarks/results/mf_qkv_concat_check.json`` and exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from msllm.fileio import write_json_atomic  # noqa: E402

SHAPES = {
    "gqa_6q_2kv": dict(vocab_size=256, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128),
    "mha_4": dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128),
}

# Runs inside the MindFormers venv: its real converter, nothing of msllm.
MF_WORKER = r'''
import inspect, sys
import mindspore as ms
import mindformers
from mindformers.models.llama import convert_weight as cw

hf_dir, plain, fused, yaml_path = sys.argv[1:5]
print("mindformers", mindformers.__version__, flush=True)
# some versions load from_pretrained(os.path.dirname(input_path)): give them a file in the directory
source = inspect.getsource(cw.convert_pt_to_ms)
input_path = hf_dir + "/config.json" if "dirname(input_path)" in source else hf_dir
cw.convert_pt_to_ms(input_path=input_path, output_path=plain, dtype=ms.float32)
params = inspect.signature(cw.convert_to_qkv_concat).parameters
if "config_path" in params:
    cw.convert_to_qkv_concat(plain, fused, yaml_path)
else:  # versions whose qkv_concat conversion takes no model config
    cw.convert_to_qkv_concat(plain, fused)
print("converted", flush=True)
'''


def mf_yaml(cfg: dict) -> str:
    """The ``model: model_config:`` keys ``convert_qkv_concat_weight`` reads."""
    return ("model:\n  model_config:\n    type: LlamaConfig\n"
            f"    hidden_size: {cfg['hidden_size']}\n    num_heads: {cfg['num_attention_heads']}\n"
            f"    n_kv_heads: {cfg['num_key_value_heads']}\n    intermediate_size: {cfg['intermediate_size']}\n"
            f"    num_layers: {cfg['num_hidden_layers']}\n    vocab_size: {cfg['vocab_size']}\n")


def check(name: str, hf_cfg: dict, mf_python: str, work: str) -> dict:
    import mindspore as ms

    from msllm.convert.verify import make_random_hf_model
    from msllm.models.llama.config import LlamaConfig
    from msllm.models.llama.names import msllm_to_hf_name
    from msllm.training.checkpoint import load_params

    hf_dir = os.path.join(work, name, "hf")
    model = make_random_hf_model(hf_dir, seed=7, **hf_cfg)
    hf = {n: t.detach().numpy() for n, t in model.state_dict().items() if "rotary" not in n}
    plain, fused = os.path.join(work, name, "plain.ckpt"), os.path.join(work, name, "qkv_concat.ckpt")
    yaml_path = os.path.join(work, name, "mf.yaml")
    with open(yaml_path, "w", encoding="utf-8") as fh:
        fh.write(mf_yaml(hf_cfg))
    r = subprocess.run([mf_python, "-c", MF_WORKER, hf_dir, plain, fused, yaml_path], capture_output=True, text=True,
                       env=dict(os.environ, GLOG_v="3"), timeout=1800, cwd=work)  # MindFormers logs to ./output
    if r.returncode != 0:
        raise SystemExit(f"MindFormers converter failed ({name}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    ms.set_device("CPU")
    cfg = LlamaConfig(vocab_size=hf_cfg["vocab_size"], hidden_size=hf_cfg["hidden_size"],
                      num_layers=hf_cfg["num_hidden_layers"], num_heads=hf_cfg["num_attention_heads"],
                      n_kv_heads=hf_cfg["num_key_value_heads"], intermediate_size=hf_cfg["intermediate_size"])
    versions = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("mindformers ")]
    result = {"mindformers": versions[0] if versions else "?"}
    for label, path in (("plain", plain), ("qkv_concat", fused)):
        params = load_params(path, cfg)
        fused_names = [n for n in ms.load_checkpoint(path) if "w_qkv" in n or "w_gate_hidden" in n]
        worst, compared = 0.0, 0
        for n, p in params.items():
            hf_name = msllm_to_hf_name(n)
            if hf_name is None or hf_name not in hf:
                continue
            worst = max(worst, float(np.abs(p.asnumpy() - hf[hf_name]).max()))
            compared += 1
        result[label] = {"tensors_compared": compared, "fused_tensors_in_file": len(fused_names),
                         "max_abs_diff": worst, "bit_exact": worst == 0.0 and compared == len(hf)}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mf-python", default=os.path.join(ROOT, "benchmarks", ".venv-mindformers", "bin", "python"))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "mf_qkv_concat_check.json"))
    args = p.parse_args()
    if not os.path.exists(args.mf_python):
        print(f"error: {args.mf_python} not found; run: bash benchmarks/setup_mindformers.sh", file=sys.stderr)
        return 2
    if subprocess.run([args.mf_python, "-c", "import torch"], capture_output=True).returncode != 0:
        # MindFormers' convert_pt_to_ms loads the HF model with transformers, which needs torch;
        # setup_mindformers.sh does not install it (the speed benchmarks do not need it)
        import torch

        version = torch.__version__.split("+")[0]
        print(f"installing torch=={version} into {args.mf_python} (MindFormers' converter needs it)", flush=True)
        subprocess.run([args.mf_python, "-m", "pip", "install", "-q", f"torch=={version}"], check=True)
    with tempfile.TemporaryDirectory(prefix="mf_qkv_") as work:
        results = {name: check(name, cfg, args.mf_python, work) for name, cfg in SHAPES.items()}
    write_json_atomic(args.out, results)
    print(json.dumps(results, indent=2))
    ok = all(r[k]["bit_exact"] for r in results.values() for k in ("plain", "qkv_concat"))
    print("PASSED: msllm reads MindFormers' output bit-exactly" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
