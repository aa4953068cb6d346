"""``run_mode: predict`` end to end: a text prompt through ``run_msllm.py`` (HF directory loaded
in memory) prints HF's greedy continuation; a prompts file (every record kind) gives one JSONL line
per input in input order whose tokens equal HF's greedy tokens for the prompt the checkpoint's
template makes; MindFormers-named checkpoints load to the same weights; bad input is one clear
error, exit 2, and no output file."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gentest_helpers import ROOT, converted_model, hf_generate, hf_new_tokens
from msllm.convert import hf as hfconv
from msllm.data.templates import encode_prompt, get_template

SEED = 41
HF_KW = dict(vocab_size=32000, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=128)
NEW = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("predict_model")
    m = converted_model(d, SEED, HF_KW, {"max_new_tokens": NEW, "batch_size": 2})
    # the same weights under MindFormers' names, without a manifest (as MindFormers writes them)
    from msllm.models.llama.names import msllm_to_mindformers_name

    m["mf"] = str(d / "mindformers.ckpt")
    with hfconv.CkptWriter(m["mf"]) as w:
        for name, (data, dtype) in hfconv.read_msllm_tensors(m["ckpt"]).items():
            w.write(msllm_to_mindformers_name(name) or name, data, dtype)
    return m


def reference(hf_model, ids):
    out, length = hf_generate(hf_model, [ids], max_new_tokens=NEW, do_sample=False)
    toks = hf_new_tokens(out, length)[0]
    return toks[:toks.index(2) + 1] if 2 in toks else toks


def test_text_prompt_from_an_hf_directory_prints_hf_greedy_continuation(model, tokenizer, tmp_path):
    prompt = "I love Beijing, because"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", model["yaml"],
                        "--run_mode", "predict", "--load_checkpoint", model["hf_dir"], "--predict_data", prompt,
                        f"--output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, GLOG_v="3"))
    assert r.returncode == 0, r.stderr[-3000:]
    ref = reference(model["hf"], [tokenizer.bos_id] + tokenizer.encode(prompt))   # no template: plain text
    expected = tokenizer.decode([t for t in ref if t != 2])
    assert r.stdout.rstrip("\n").split("\n")[-1] == expected
    assert "loaded hf weights" in r.stderr and not (tmp_path / "out" / "predict").exists()


def run_cli(argv):
    from msllm.cli import main

    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_prompts_file_gives_jsonl_in_input_order_equal_to_hf(model, tokenizer, tmp_path):
    data = tmp_path / "prompts.jsonl"
    records = [{"prompt": "I love Beijing, because"},
               {"instruction": "Give three tips for staying healthy.", "input": ""},
               "Hello",
               {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                                  {"from": "human", "value": "What is the capital of France?"},
                                  {"from": "gpt", "value": "Paris."}]},
               {"instruction": "Translate to French", "input": "good morning", "output": "bonjour"}]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    out = tmp_path / "out"
    assert run_cli(["--config", model["yaml"], "--run_mode", "predict", "--load_checkpoint", model["ckpt"],
                    "--predict_data", str(data), f"--output_dir={out}"]) == 0
    lines = [json.loads(x) for x in (out / "predict" / "predictions.jsonl").read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(5))
    from msllm.data.conversation import alpaca_prompt

    turns = [[("human", "I love Beijing, because")],
             [("human", alpaca_prompt("Give three tips for staying healthy."))],
             [("human", "Hello")],
             [("human", "Hi"), ("gpt", "Hello!"), ("human", "What is the capital of France?")],
             [("human", alpaca_prompt("Translate to French", "good morning"))]]
    vicuna = get_template("vicuna_v1.1")                       # from the checkpoint's manifest
    for line, t in zip(lines, turns):
        ids = encode_prompt(tokenizer, vicuna, t)
        ref = reference(model["hf"], ids)
        assert line["output_ids"] == ref, line
        assert line["prompt"] == t[-1][1] and line["prompt_tokens"] == len(ids)
        assert line["output"] == tokenizer.decode([x for x in ref if x != 2])
        assert line["finish_reason"] == ("eos" if ref[-1] == 2 else "length")
        assert line["new_tokens"] == len(ref) and line["tokens_per_s"] > 0
    assert lines[3]["reference"] == "Paris." and lines[4]["reference"] == "bonjour"
    assert "reference" not in lines[0]


def test_mindformers_named_checkpoint_loads_the_same_weights(model):
    from msllm.config import load_config
    from msllm.generation.loading import load_for_inference

    cfg = load_config(model["yaml"])
    a, _, info_a = load_for_inference(cfg, model["ckpt"])
    b, _, info_b = load_for_inference(cfg, model["mf"])
    pa = {p.name: p.asnumpy() for p in a.get_parameters()}
    pb = {p.name: p.asnumpy() for p in b.get_parameters()}
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    assert info_a.template == "vicuna_v1.1" and info_b.template is None


BAD = {
    "empty_txt": ("prompts.txt", "\n \n", [], "no prompts in the file"),
    "malformed_jsonl": ("prompts.jsonl", '{"prompt": "a"}\n{"prompt": \n', [], "prompts.jsonl: invalid JSON at line 2"),
    "json_not_a_list": ("prompts.json", '{"prompt": "a"}', [], "expected a JSON list of records"),
    "unknown_record": ("prompts.json", '[{"prompt": "a"}, {"question": "b"}]', [], "record 1: unknown record"),
    "missing_file": (None, None, ["--predict_data", "nope.jsonl"], "nope.jsonl: file not found"),
    "no_predict_data": (None, None, [], "needs --predict_data"),
    "unknown_template": ("prompts.txt", "hello\n", ["--template", "chatml2"], "unknown prompt template 'chatml2'"),
    "chatml_without_its_tokens": ("prompts.txt", "hello\n", ["--template", "chatml"],
                                  "'chatml' writes <\\|im_start\\|> and <\\|im_end\\|>, which tokenizer .*tokenizer.model "
                                  "does not have"),
    "shape_mismatch": ("prompts.txt", "hello\n", ["--model.model_config.hidden_size=64"],
                       "hidden_size=32 \\(config: 64\\)"),
    "prompt_too_long": ("prompts.txt", "hi\n" + "word " * 200 + "\n", [], "record 1 of .*context window"),
    "model_parallel_on_cpu": ("prompts.txt", "hello\n", ["--parallel_config.model_parallel=2",
                                                         "--parallel.parallel_mode=1", "--parallel.full_batch=True"],
                              "Predict on CPU is data parallel only"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_error_and_no_output(model, tmp_path, capsys, case):
    name, content, extra, message = BAD[case]
    argv = ["--config", model["yaml"], "--run_mode", "predict", "--load_checkpoint", model["ckpt"],
            f"--output_dir={tmp_path / 'out'}"]
    if name is not None:
        (tmp_path / name).write_text(content)
        argv += ["--predict_data", str(tmp_path / name)]
    if case == "missing_file":
        extra = ["--predict_data", str(tmp_path / "nope.jsonl")]
    assert run_cli(argv + extra) == 2
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, err
    import re

    assert re.search(message, errors[0]), errors[0]
    assert not (tmp_path / "out" / "predict").exists()


def test_adapter_is_applied_on_top_of_the_base(model, tmp_path, monkeypatch):
    """``--adapter``: a LoRA adapter checkpoint (as LoRA training writes it) changes the logits
    exactly as the adapted network computes them; an adapter of another base is refused."""
    import mindspore as ms

    from msllm.config import load_config
    from msllm.errors import MsllmError
    from msllm.generation.loading import load_for_inference
    from msllm.lora.adapter import lora_record, save_adapter_checkpoint
    from msllm.lora.apply import apply_lora
    from msllm.convert.starting import base_identity
    from msllm.config_lora import PetConfig

    cfg = load_config(model["yaml"])
    pet = PetConfig(lora_rank=4, lora_alpha=8.0, target_modules=".*q_proj|.*v_proj")
    stacked, _, _ = load_for_inference(cfg, model["ckpt"])   # layers' weights stacked: LoRA comes at loading
    with pytest.raises(MsllmError, match="stacked over the decoder layers"):
        apply_lora(stacked, pet, seed=SEED, dropout=0.0)
    monkeypatch.setenv("MSLLM_STACK_WEIGHTS", "0")            # the reference: each layer's own weights
    ref, _, _ = load_for_inference(cfg, model["ckpt"])
    monkeypatch.delenv("MSLLM_STACK_WEIGHTS")
    info = apply_lora(ref, pet, seed=SEED, dropout=0.0)
    rng = np.random.default_rng(SEED)
    for p in ref.get_parameters():
        if p.name.endswith("lora_B.weight"):
            p.set_data(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.5))
    adapter = str(tmp_path / "adapter.ckpt")
    save_adapter_checkpoint(ref, ref, adapter, lora_record(pet, info.modules, base_identity(model["ckpt"])))

    base, _, _ = load_for_inference(cfg, model["ckpt"])
    net, _, got = load_for_inference(cfg, model["ckpt"], adapter=adapter)
    assert got.adapter == adapter
    ids = ms.Tensor(np.array([[1, 306, 5360, 1522, 29892]], np.int32))
    with_adapter, plain, expected = net(ids).asnumpy(), base(ids).asnumpy(), ref(ids).asnumpy()
    np.testing.assert_allclose(with_adapter, expected, atol=1e-5)
    assert np.abs(with_adapter - plain).max() > 1e-2
    with pytest.raises(MsllmError, match="adapter"):
        load_for_inference(cfg, model["hf_dir"], adapter=adapter)          # another base (an HF dir)


def test_python_api_text_and_streaming(model, tokenizer):
    """``msllm.generation.generate`` / ``generate_text`` (the documented API) give HF's greedy
    tokens and text; :class:`TextStream` pieces add up to the decoded answer."""
    import msllm.generation as mg
    from msllm.config import load_config
    from msllm.generation.api import TextStream

    net, _, _ = mg.load_for_inference(load_config(model["yaml"]), model["hf_dir"])
    prompt = "Once upon a time"
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    ref = reference(model["hf"], ids)
    pieces = []
    stream = TextStream(tokenizer, (2,))
    out = mg.generate(net, ids, mg.GenerationConfig(max_new_tokens=NEW),
                      stream=lambda k, toks, fin: pieces.append(stream.push(int(toks[0]))))
    assert out.tokens == [ref]
    text = mg.generate_text(net, tokenizer, prompt, mg.GenerationConfig(max_new_tokens=NEW))
    assert text == [tokenizer.decode([t for t in ref if t != 2])]
    assert "".join(pieces) == text[0]


def test_a_run_yaml_that_names_no_model_takes_the_checkpoints_own(model):
    """configs/smollm2/run_smollm2_135m.yaml leaves the model to the weights (an HF directory's
    config.json): an msllm checkpoint fine-tuned from it loads with the same YAML, its shape read
    from the checkpoint's manifest (a YAML that names a different model is still refused)."""
    from msllm.config import load_config
    from msllm.errors import MsllmError
    from msllm.generation.loading import load_for_inference

    cfg = load_config(os.path.join(ROOT, "configs", "smollm2", "run_smollm2_135m.yaml"),
                      [f"--load_checkpoint={model['ckpt']}", "--model.model_config.seq_length=64"])
    net, mc, info = load_for_inference(cfg)
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers, mc.ffn_size) == (32000, 32, 2, 37)
    assert mc.seq_length == 64 and info.kind == "msllm"
    wrong = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"),
                        [f"--load_checkpoint={model['ckpt']}"])
    with pytest.raises(MsllmError, match="was saved for a different model"):
        load_for_inference(wrong)
