"""Shared pieces of the msllm benchmarks: shapes, the real data, common initial weights, the
optimiser, RSS and result lines, the machine. (Running workers and writing results: harness.py.)

Imports only numpy and the standard library at top level (MindSpore and msllm inside the
functions that need them) so that every framework's worker (each in its own interpreter / venv)
can use it. The data and the initial weights are written once into
``benchmarks/.cache`` (git-ignored) by the parent process and read by the workers, so msllm,
MindFormers and PyTorch train from the same weights on the same batches.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = os.path.join(HERE, ".cache")
MAIN_PY = os.path.join(ROOT, ".venv", "bin", "python")
MF_VENV = os.environ.get("MF_VENV", os.path.join(HERE, ".venv-mindformers"))
MF_PY = os.path.join(MF_VENV, "bin", "python")
EXAMPLES = os.path.join(ROOT, "examples", "data")

# A CPU without AVX-512 (AMD Zen 3), measured on any AVX2 machine: msllm's kernels compiled for haswell (AVX2 +
# FMA: every vector helper in 8 lanes), its run-time-selected linears on their AVX2 paths, and oneDNN's JIT
# capped at AVX2 (ONEDNN_MAX_CPU_ISA, oneDNN's documented switch; the sgemm msllm's kernels and MindSpore's
# MatMul call). MindSpore's own nnacl kernels still pick their ISA from the CPU. The clock and memory stay
# this machine's.
AVX2_ENV = {"MSLLM_KERNELS_MARCH": "haswell", "MSLLM_GEMV_ISA": "avx2", "MSLLM_INT8_ISA": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}


def isa_env(isa: str) -> dict:
    """The environment an msllm worker gets for ``isa``: ``native`` (none) or ``avx2`` (:data:`AVX2_ENV` and a
    kernel library of its own in ``benchmarks/.cache/kernels-haswell``, built here first if missing or stale)."""
    if isa == "native":
        return {}
    if isa != "avx2":
        raise ValueError(f"isa {isa!r}: expected native or avx2")
    env = dict(AVX2_ENV, MSLLM_KERNELS_DIR=os.path.join(CACHE, "kernels-haswell"))
    r = subprocess.run([MAIN_PY, "-m", "msllm.kernels.build"], capture_output=True, text=True,
                       env=dict(os.environ, **env), cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"building msllm's kernels with {env}:\n{r.stderr[-3000:]}")
    return env


def run_isa_child(script: str, isa: str, spec: dict, tag: str, unset: str = "") -> dict:
    """Runs ``script --child <spec as JSON>`` in a process of its own with :func:`isa_env` (``isa``) and without the
    variable ``unset`` (the child alternates it itself); returns the JSON the child printed on its line starting
    with ``tag``. Raises SystemExit with the child's stderr if it failed or printed no such line."""
    env = dict(os.environ, **isa_env(isa))
    env.pop(unset, None)
    r = subprocess.run([MAIN_PY, os.path.abspath(script), "--child", json.dumps(spec)], env=env, capture_output=True,
                       text=True, cwd=ROOT)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith(tag + " ")]
    if r.returncode != 0 or not line:
        raise SystemExit(f"{isa}: child failed\n{r.stderr[-3000:]}")
    return json.loads(line[0].split(" ", 1)[1])


def kernel_build(env: dict) -> dict:
    """Flags, instruction sets and digest of the kernel library a worker with ``env`` loads (its
    build_info.json, read by msllm's own :func:`msllm.kernels.build.read_info`); {} when there is none."""
    use_repo()
    from msllm.kernels import build

    info = build.read_info(env.get("MSLLM_KERNELS_DIR") or build.build_dir()) or {}
    return {k: info.get(k) for k in ("flags", "isa", "digest")}


# tiny and medium: the shapes of issue #6 ("tiny" = the reference shape of shared NOTES.md);
# large: issue #14 (hidden 1024, 12 layers, 16 heads, FFN 2816, seq 1024, batch 2).
SHAPES = {
    "tiny": dict(vocab_size=32000, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688,
                 seq_length=256, batch_size=8),
    "medium": dict(vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1376,
                   seq_length=512, batch_size=4),
    "large": dict(vocab_size=32000, hidden_size=1024, num_layers=12, num_heads=16, intermediate_size=2816,
                  seq_length=1024, batch_size=2),
}
# the LLaMA family's other members on the medium shape (issue #20): Qwen2 (q/k/v biases) and
# Mistral (sliding window 256, half the sequence, so the window cuts)
SHAPES["medium-qwen2"] = dict(SHAPES["medium"], family="qwen2")
SHAPES["medium-mistral"] = dict(SHAPES["medium"], family="mistral", sliding_window=256)
# mixture of experts (issue #22): the tiny shape with Mixtral's MLPs, 4 / 8 / 16 experts of the
# tiny FFN's width, top 2, the load-balancing loss on (coefficient 0.02) in both frameworks
for _e in (4, 8, 16):
    SHAPES[f"moe-tiny-e{_e}"] = dict(SHAPES["tiny"], family="mixtral", experts=_e, top_k=2, aux_loss_coef=0.02)

# Optimiser of every framework: AdamW as msllm's trainer configures it (configs/llama/*.yaml),
# MindSpore AdamWeightDecay semantics (no bias correction), constant learning rate so that the
# losses of the three frameworks can be compared step by step.
OPTIM = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
INIT_STD = 0.02
RMS_EPS = 1e-5


# Real pretrained models (issue #19): the shape is the HF directory's config.json (listed here for
# the FLOP counts and the reports); ``hf_dir`` is resolved by :func:`hf_dir` and the training data is
# the bundled Alpaca records tokenized with the model's own tokenizer and chat template.
REAL_SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, n_kv_heads=3,
                    intermediate_size=1536, seq_length=256, batch_size=2, tied_embeddings=True,
                    real_model="SmolLM2-135M-Instruct", data_tag="smollm2"),
}


def build_cached(source: str, output: str, compile_cmd: list[str]) -> str:
    """``benchmarks/<source>`` compiled by ``compile_cmd + [source, "-o", tmp]`` into
    ``benchmarks/.cache/<output>`` (temp name, then rename), again only when the source is newer; the
    output's path. For the benchmarks' small C/C++ helpers."""
    src = os.path.join(HERE, source)
    os.makedirs(CACHE, exist_ok=True)
    out = os.path.join(CACHE, output)
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(src):
        subprocess.run(list(compile_cmd) + [src, "-o", out + ".tmp"], check=True)
        os.replace(out + ".tmp", out)
    return out


def shape(name: str) -> dict:
    return dict(SHAPES[name] if name in SHAPES else REAL_SHAPES[name])


def hf_dir(shape_name: str) -> str | None:
    """The HF directory of a real-model shape (``msllm.convert.real_model.ensure_smollm2``), else None."""
    if shape_name not in REAL_SHAPES:
        return None
    use_repo()
    from msllm.convert.real_model import ensure_smollm2

    return ensure_smollm2()


def use_repo() -> None:
    """Make the repository importable (``import msllm``); called by the scripts that use it, so
    that the modules which do not (the PyTorch workers) see no repository directories."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


def model_overrides(s: dict) -> list[str]:
    """``run_msllm.py`` / ``load_config`` overrides giving configs/llama/run_llama_tiny.yaml the
    model of benchmark shape ``s`` (multi-head attention: ``n_kv_heads`` unset)."""
    family = {"qwen2": ["--model.model_config.model_type=qwen2", "--model.model_config.qkv_has_bias=True"],
              "mistral": ["--model.model_config.model_type=mistral",
                          f"--model.model_config.sliding_window={s.get('sliding_window')}"]}.get(s.get("family"), [])
    return family + [f"--model.model_config.hidden_size={s['hidden_size']}",
            f"--model.model_config.num_layers={s['num_layers']}",
            f"--model.model_config.num_heads={s['num_heads']}",
            "--model.model_config.n_kv_heads=null",
            f"--model.model_config.intermediate_size={s['intermediate_size']}",
            f"--model.model_config.vocab_size={s['vocab_size']}",
            f"--model.model_config.seq_length={s['seq_length']}"]


def matmul_params(s: dict) -> int:
    """N of 6N: every weight that takes part in a matmul (not the embedding lookup, not norms);
    with experts the k active ones and the router (PaLM's N counts what a token runs)."""
    c, f, l_ = s["hidden_size"], s["intermediate_size"], s["num_layers"]
    mlp = 3 * c * f * s.get("top_k", 1) + c * s.get("experts", 0)
    return l_ * (4 * c * c + mlp) + s["vocab_size"] * c


def num_params(s: dict) -> int:
    c = s["hidden_size"]
    idle = s["num_layers"] * 3 * c * s["intermediate_size"] * (s.get("experts", 0) - s.get("top_k", 0))
    return matmul_params(s) + idle + s["vocab_size"] * c + (2 * s["num_layers"] + 1) * c


def flops_per_token(s: dict) -> float:
    """6N + 12 L H D T (PaLM, Chowdhery et al. 2022, appendix B); H*D = hidden; with a sliding
    window W, T -> min(W, T) (msllm's ``LlamaConfig.train_flops_per_token``)."""
    keys = min(s.get("sliding_window") or s["seq_length"], s["seq_length"])
    return 6.0 * matmul_params(s) + 12.0 * s["num_layers"] * s["hidden_size"] * keys


# ---------------------------------------------------------------------------------------------
# Data: examples/data/alpaca_en_demo.json -> conversation -> msllm preprocess (real tokenizer)


def alpaca_conversation() -> str:
    """The bundled Alpaca records (examples/data/alpaca_en_demo.json, 999) converted by
    ``data_preprocess/alpaca_converter.py`` into ``benchmarks/.cache/alpaca-conversation.json``
    (once); returns its path."""
    out = os.path.join(CACHE, "alpaca-conversation.json")
    if not os.path.exists(out):
        os.makedirs(CACHE, exist_ok=True)
        subprocess.run([MAIN_PY, os.path.join(ROOT, "data_preprocess", "alpaca_converter.py"),
                        "--data_path", os.path.join(EXAMPLES, "alpaca_en_demo.json"), "--output_path", out],
                       check=True, capture_output=True)
    return out


def data_file(seq_length: int, tag: str | None = None) -> str:
    """The .npz of the Alpaca batches: LLaMA's SentencePiece tokenizer, or with ``tag`` (a real
    shape's name) that model's own tokenizer (:func:`prepare_hf_data`)."""
    return os.path.join(CACHE, f"alpaca_{tag + '_' if tag else ''}seq{seq_length}.npz")


def prepare_hf_data(tag: str, model_dir: str, seq_length: int) -> str:
    """Alpaca batches for a real model, built by the documented commands:
    ``data_preprocess/alpaca_converter.py`` then ``data_preprocess/llama_preprocess.py --dataset_type qa
    --model_file HF_DIR`` (the model's tokenizer.json and chat template), input order; the MindRecord's
    rows saved as .npz. Returns the path; the commands are in ``{path}.commands.json``."""
    out = data_file(seq_length, tag)
    if os.path.exists(out):
        return out
    os.makedirs(CACHE, exist_ok=True)
    conv = alpaca_conversation()
    mr = os.path.join(CACHE, f"alpaca_{tag}_seq{seq_length}.mindrecord")
    cmd = [MAIN_PY, os.path.join(ROOT, "data_preprocess", "llama_preprocess.py"), "--input_glob", conv,
           "--dataset_type", "qa", "--model_file", model_dir, "--seq_length", str(seq_length), "--shuffle", "0",
           "--output_file", mr, "--no_progress"]
    env = dict(os.environ, GLOG_v="3")
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    code = (f"import sys, numpy as np; sys.path.insert(0, {ROOT!r}); "
            "from msllm.data.mindrecord import read_mindrecord_arrays; "
            f"a = read_mindrecord_arrays({mr!r}); "
            f"np.savez({out!r}, input_ids=a['input_ids'], labels=a['labels'])")
    subprocess.run([MAIN_PY, "-c", code], check=True, env=env)
    conv_cmd = [MAIN_PY, os.path.join(ROOT, "data_preprocess", "alpaca_converter.py"), "--data_path",
                os.path.join(EXAMPLES, "alpaca_en_demo.json"), "--output_path", conv]
    with open(out + ".commands.json", "w") as fh:
        json.dump([" ".join(conv_cmd), " ".join(cmd)], fh, indent=1)
    return out


def prepare_data(seq_length: int) -> str:
    """Tokenize the bundled Alpaca records with msllm's preprocessing into (N, seq+1) int32
    ``input_ids``/``labels`` (no shuffle) and save them as .npz; returns the path. Runs in the
    msllm venv (it imports msllm)."""
    out = data_file(seq_length)
    if os.path.exists(out):
        return out
    os.makedirs(CACHE, exist_ok=True)
    code = f"""
import os, sys, tempfile, numpy as np
sys.path.insert(0, {ROOT!r})
from msllm.data.conversation import convert_alpaca_file
from msllm.data.preprocess import preprocess_to_mindrecord
from msllm.data.mindrecord import read_mindrecord_arrays
d = tempfile.mkdtemp(dir={CACHE!r})
conv = os.path.join(d, "conv.json")
convert_alpaca_file(os.path.join({EXAMPLES!r}, "alpaca_en_demo.json"), conv)
mr = os.path.join(d, "alpaca.mindrecord")
preprocess_to_mindrecord(conv, "qa", os.path.join({EXAMPLES!r}, "tokenizer.model"), {seq_length}, mr,
                         shuffle=False, progress=False)
a = read_mindrecord_arrays(mr)
np.savez({out!r}, input_ids=a["input_ids"], labels=a["labels"])
import shutil; shutil.rmtree(d)
"""
    env = dict(os.environ, GLOG_v="3")
    subprocess.run([MAIN_PY, "-c", code], check=True, env=env)
    return out


def batches(path: str, batch_size: int, steps: int):
    """``steps`` batches (input_ids, labels), each (batch_size, seq+1) int32, taken in file order
    and wrapping around."""
    d = np.load(path)
    ids, lab = d["input_ids"], d["labels"]
    n = ids.shape[0]
    out = []
    for s in range(steps):
        idx = [(s * batch_size + i) % n for i in range(batch_size)]
        out.append((ids[idx], lab[idx]))
    return out


# ---------------------------------------------------------------------------------------------
# Initial weights (msllm / Hugging Face names; MindFormers names via msllm.convert table)


def weights_file(name: str) -> str:
    return os.path.join(CACHE, f"init_{name}.npz")


def prepare_weights(name: str, seed: int = 0) -> str:
    """Normal(0, 0.02) matrices and embedding, ones for norms, under msllm parameter names."""
    out = weights_file(name)
    if os.path.exists(out):
        return out
    os.makedirs(CACHE, exist_ok=True)
    s = shape(name)
    c, f, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    rng = np.random.default_rng(seed)

    def normal(*shp):
        return (rng.standard_normal(shp, dtype=np.float32) * INIT_STD).astype(np.float32)

    w = {"model.embed_tokens.embedding_table": normal(v, c)}
    for i in range(s["num_layers"]):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            w[p + f"self_attn.{n}_proj.weight"] = normal(c, c)
            if s.get("family") == "qwen2" and n != "o":
                w[p + f"self_attn.{n}_proj.bias"] = normal(c)
        w[p + "mlp.gate_proj.weight"] = normal(f, c)
        w[p + "mlp.up_proj.weight"] = normal(f, c)
        w[p + "mlp.down_proj.weight"] = normal(c, f)
        w[p + "input_layernorm.weight"] = np.ones(c, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(c, np.float32)
    w["model.norm.weight"] = np.ones(c, np.float32)
    w["lm_head.weight"] = normal(v, c)
    np.savez(out, **w)
    return out


# ---------------------------------------------------------------------------------------------
# Measurement helpers used inside workers


def peak_rss_mib() -> float:
    """Peak resident set size of this process (VmHWM), MiB."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mib() -> float:
    """Current resident set size of this process (VmRSS), MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def emit(result: dict) -> None:
    """Print the worker's result as the one line the parent parses."""
    sys.stdout.write("BENCH_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict | None:
    for line in stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT "):])
    return None


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def machine() -> dict:
    """lscpu model name, cores, RAM, kernel, python."""
    model = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    mem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) / 1024 / 1024
    return {"cpu": model, "cores": os.cpu_count(), "ram_gib": round(mem, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def cpu_fp32_peak() -> dict:
    """This machine's fp32 peak as msllm's trainer computes it (the one definition:
    ``msllm.training.throughput.host_cpu_peak``: cores x FMA units x lanes x 2 x clock, the clock
    measured by the kernels' FMA loop when above the described one), and the same at the clock
    the CPU describes (``gflops_described``)."""
    sys.path.insert(0, ROOT)
    from msllm.training import throughput

    peak = throughput.host_cpu_peak()
    with open("/proc/cpuinfo") as fh:
        text = fh.read()
    described = throughput.cpu_peak(text, os.sched_getaffinity(0))
    return {"cores": peak.cores, "fma_units": peak.fma_units, "lanes": peak.lanes, "clock_ghz": round(peak.ghz, 4),
            "clock_source": peak.clock_source, "gflops": peak.tflops * 1000.0, "fma_assumption": peak.fma_assumption,
            "described_clock_ghz": described.ghz, "gflops_described": described.tflops * 1000.0}


def median(xs):
    return float(np.median(np.asarray(xs, np.float64))) if len(xs) else float("nan")


# ---------------------------------------------------------------------------------------------
# Models and optimiser shared by the MindSpore benchmarks (imported lazily: the MindFormers
# worker runs them under MindSpore 2.9 without msllm's dependencies)


def msllm_model_config(s: dict):
    """msllm ``LlamaConfig`` of benchmark shape ``s`` (every other field its default)."""
    use_repo()
    from msllm.models.llama.config import LlamaConfig

    return LlamaConfig(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_layers=s["num_layers"],
                       num_heads=s["num_heads"], intermediate_size=s["intermediate_size"],
                       seq_length=s["seq_length"])


def set_ms_weights(params, init, key_of=lambda name: name) -> None:
    """Copy the common initial weights ``init`` (an ``np.load`` of :func:`prepare_weights`) into
    MindSpore Parameters; ``key_of(param.name)`` is the parameter's name in ``init``. Every
    parameter must have a key and every key a parameter (else AssertionError naming a few)."""
    from mindspore import Tensor

    by_key = {key_of(p.name): p for p in params}
    assert set(by_key) == set(init.files), sorted(set(by_key) ^ set(init.files))[:6]
    for key, p in by_key.items():
        p.set_data(Tensor(init[key]))


def ms_adamw(params, lr_steps: int):
    """``nn.AdamWeightDecay`` with :data:`OPTIM`, weight decay on matrices only (two parameter
    groups, the empty one dropped: MindSpore refuses it) and a constant learning rate given as a
    ``lr_steps``-long tensor."""
    from mindspore import Tensor, nn

    o = OPTIM
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return nn.AdamWeightDecay([g for g in groups if g["params"]],
                              learning_rate=Tensor(np.full(lr_steps, o["lr"], np.float32)),
                              beta1=o["beta1"], beta2=o["beta2"], eps=o["eps"])


def moe_hf_dir(name: str, seed: int = 0) -> str:
    """A seeded random transformers Mixtral of MoE shape ``name`` saved under the cache (made once):
    both frameworks start from it (msllm through its HF-directory loading)."""
    s = shape(name)
    out = os.path.join(CACHE, f"hf_{name}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    use_repo()
    from msllm.convert.verify import make_random_hf_model

    make_random_hf_model(out, seed=seed, model_type="mixtral", vocab_size=s["vocab_size"],
                         hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                         num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                         num_key_value_heads=s["num_heads"], num_local_experts=s["experts"],
                         num_experts_per_tok=s["top_k"], max_position_embeddings=s["seq_length"],
                         rms_norm_eps=RMS_EPS, rope_theta=10000.0, tie_word_embeddings=False,
                         router_aux_loss_coef=s["aux_loss_coef"], output_router_logits=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return out
