"""Generation with a real pretrained model: SmolLM2-135M-Instruct (the ``smollm2_dir`` fixture, a
Hugging Face directory) equals transformers' greedy ``generate`` token for token.

* ``run_msllm.py --run_mode predict`` on the directory itself, with the model's own Jinja chat
  template: six prompts (English and Chinese, 32 to 53 tokens, one with a system message) decoded
  in ONE batch of 6, 32 new tokens each, on the CPU fast path with msllm's kernels and with
  ``cpu_kernels=False`` (MindSpore's composed operators);
* the layout path (the model built with ``fast_paths=False``, the shapes of the Ascend layouts)
  through the Python API (``load_for_inference`` + ``msllm.generation.api.generate``);
* a ``{"messages": [system, user]}`` record renders to the ids of ``apply_chat_template``.

Reference: ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`` and
``AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True)``; transformers'
greedy ``generate`` (``do_sample=False``, 32 new tokens) on the left-padded batch; both sides'
new tokens are cut after the first EOS (id 2, ``<|im_end|>``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gentest_helpers import ROOT, hf_generate, hf_new_tokens

pytestmark = [pytest.mark.slow,   # minutes on 2 CPU cores; still run in CI
              pytest.mark.usefixtures("one_torch_thread")]

CONFIG = os.path.join(ROOT, "configs", "smollm2", "run_smollm2_135m.yaml")
SEQ_LENGTH = 1024
NEW = 32
EOS = 2
SEED = 0  # greedy decoding is deterministic; the seed is fixed (and printed) anyway
SYSTEM = "You are a geography teacher. Answer in one short sentence."
# five user prompts and one system + user conversation: English and Chinese, 32 to 53 tokens
# with the template (SmolLM2's template adds its default system prompt when none is given)
RECORDS = ["What is the capital of France?",
           "Write a short poem about the sea.",
           "中国的首都是哪里？",
           "请用一句话介绍一下长城。",
           "Explain, in two or three sentences, why the sky appears blue during the day but red and orange "
           "at sunset.",
           {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Which river flows through Cairo?"}]}]


def messages_of(record) -> list[dict]:
    return record["messages"] if isinstance(record, dict) else [{"role": "user", "content": record}]


def cut_at_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    """(transformers model in float32, AutoTokenizer) of the SmolLM2 directory (the session's)."""
    import torch

    print("seed", SEED)
    torch.manual_seed(SEED)
    return smollm2_hf


def template_ids(hf_tok, messages) -> list[int]:
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(i) for i in ids]


@pytest.fixture(scope="module")
def reference(hf):
    """(prompt ids per record, HF's greedy new tokens per record cut after EOS)."""
    model, hf_tok = hf
    prompts = [template_ids(hf_tok, messages_of(r)) for r in RECORDS]
    assert sorted(set(map(len, prompts))) == sorted(map(len, prompts)), "prompt lengths should all differ"
    out, length = hf_generate(model, prompts, pad_id=hf_tok.pad_token_id, max_new_tokens=NEW, do_sample=False)
    new = [cut_at_eos(t) for t in hf_new_tokens(out, length)]
    for p, t in zip(prompts, new):
        print(len(p), t, repr(hf_tok.decode(t)))
    assert any(t[-1] == EOS for t in new) and any(len(t) == NEW and EOS not in t for t in new)
    return prompts, new


@pytest.mark.parametrize("kernels", ["msllm_cpu_kernels", "mindspore_composed"])
def test_predict_cli_batch_equals_transformers_greedy(smollm2_dir, hf, reference, tmp_path, kernels):
    prompts, ref = reference
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps(RECORDS, ensure_ascii=False), encoding="utf-8")
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", CONFIG, "--run_mode", "predict",
           "--load_checkpoint", smollm2_dir, "--predict_data", str(data), f"--output_dir={out}",
           f"--model.model_config.seq_length={SEQ_LENGTH}", f"--generation_config.max_new_tokens={NEW}",
           "--generation_config.do_sample=False", f"--generation_config.batch_size={len(RECORDS)}",
           f"--seed={SEED}"]
    if kernels == "mindspore_composed":
        cmd.append("--model.model_config.cpu_kernels=False")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, GLOG_v="3"))
    assert r.returncode == 0, r.stderr[-3000:]
    # the kernels asked for, the model's chat template, and one batch of all six prompts
    want = "msllm CPU kernels" if kernels == "msllm_cpu_kernels" else "MindSpore MatMul"
    assert f"model kernels: linear/SwiGLU/rotary: {want}" in r.stderr, r.stderr[-3000:]
    assert "template chat_template:" in r.stderr
    assert f"batches of {len(RECORDS)} padded to" in r.stderr
    lines = [json.loads(x) for x in (out / "predict" / "predictions.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [x["index"] for x in lines] == list(range(len(RECORDS)))
    hf_tok = hf[1]
    for line, ids, toks in zip(lines, prompts, ref):
        assert line["prompt_tokens"] == len(ids)
        assert line["output_ids"] == toks, (line, toks)
        assert line["finish_reason"] == ("eos" if toks[-1] == EOS else "length")
        assert line["output"] == hf_tok.decode([t for t in toks if t != EOS])
    assert lines[5]["prompt"] == "Which river flows through Cairo?"


def test_layout_path_api_generate_equals_transformers_greedy(smollm2_dir, reference, tmp_path):
    """``fast_paths=False`` (no CPU kernels, the (B, H, T, T) shapes the parallel layouts are
    written for), the same six prompts in one batch through the Python API."""
    from msllm.config import load_config
    from msllm.generation import GenerationConfig
    from msllm.generation.api import generate
    from msllm.generation.loading import load_for_inference, open_tokenizer
    from msllm.generation.predict import encode_records
    from msllm.generation.prompts import template_for

    prompts, ref = reference
    cfg = load_config(CONFIG, [f"--model.model_config.seq_length={SEQ_LENGTH}", f"--load_checkpoint={smollm2_dir}",
                               f"--seed={SEED}"])
    net, mc, info = load_for_inference(cfg, fast_paths=False)
    assert info.kind == "hf" and mc.vocab_size == 49152 and mc.num_layers == 30
    assert net.model.layers[0].self_attn.flat_softmax is False   # the layout path was built
    tok = open_tokenizer(info, mc)
    records = read_prompt_file_from(tmp_path, RECORDS)
    assert encode_records(records, tok, template_for(None, tok), mc.vocab_size) == prompts
    out = generate(net, prompts, GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=EOS))
    assert [list(map(int, t)) for t in out.tokens] == ref
    assert out.finish_reasons == ["eos" if t[-1] == EOS else "length" for t in ref]


def test_messages_record_renders_the_system_prompt(smollm2_dir, hf, tmp_path):
    """A ``{"messages": [system, user]}`` record of a prompts file gives apply_chat_template's ids:
    the given system prompt, not the template's default one."""
    from msllm.data.tokenizer import load_tokenizer
    from msllm.generation.predict import encode_records
    from msllm.generation.prompts import read_prompt_file, template_for

    _, hf_tok = hf
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(RECORDS[5], ensure_ascii=False) + "\n", encoding="utf-8")
    records = read_prompt_file(str(path))
    assert records[0].turns == [("system", SYSTEM), ("human", "Which river flows through Cairo?")]
    tok = load_tokenizer(smollm2_dir)
    tmpl = template_for(None, tok)
    ids = encode_records(records, tok, tmpl, 49152)[0]
    assert ids == template_ids(hf_tok, RECORDS[5]["messages"])
    text = hf_tok.decode(ids)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert "SmolLM" not in text and text.endswith("<|im_start|>assistant\n")
    # the same template without a system message falls back to the template's default one
    plain = encode_records(read_prompt_file_from(tmp_path, RECORDS[:1]), tok, tmpl, 49152)[0]
    assert plain == template_ids(hf_tok, messages_of(RECORDS[0])) and "SmolLM" in hf_tok.decode(plain)


def read_prompt_file_from(tmp_path, records):
    """msllm's records of a .json prompts file holding ``records``."""
    from msllm.generation.prompts import read_prompt_file

    path = tmp_path / "records.json"
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return read_prompt_file(str(path))
