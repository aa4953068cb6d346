"""msllm/serving/protocol.py, defaults.py, tokenize_routes.py and metrics.py without a model: jobs built
from validated fields (ids equal to the tokenizer's and the chat template's own, ``n`` choices with
vLLM's indices and seeds, ``max_tokens`` defaults within the context window), response objects
parsed by the official ``openai`` client's own types (the independent reference for their shape),
the YAML's generation_config as request defaults (refusals named), vLLM's /tokenize shapes, and
the Prometheus exposition parsed back by ``prometheus_client``'s own parser. Real LLaMA
SentencePiece tokenizer (tests' bundled data)."""

from __future__ import annotations

import os

import pytest

from helpers import REPO, TOKENIZER
from msllm.serving.protocol import (ApiError, Request, RequestDefaults, chat_chunk, chat_logprobs, chat_request,
                                    chat_response, completion_chunk, completion_request, completion_response,
                                    logprobs_object, usage_chunk)
from msllm.serving.validate import Limits, check_request

MODEL = "m"
CONTEXT = 64


@pytest.fixture(scope="module")
def tok():
    from msllm.data.tokenizer import load_tokenizer

    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def template(tok):
    from msllm.generation.prompts import template_for

    return template_for("vicuna_v1.1", tok)


def fields(body, chat=False):
    return check_request(dict({"model": MODEL}, **body), chat, MODEL, Limits(), 32000)


def test_completion_jobs_tokenize_as_the_tokenizer_and_make_n_choices(tok):
    req = completion_request(fields({"prompt": ["Hello world", "Good"], "n": 2, "seed": 7, "temperature": 0.5,
                                     "top_k": -1, "stop": "\n"}), tok, CONTEXT)
    assert [j.index for j in req.jobs] == [0, 1, 2, 3] and req.n == 2
    assert req.jobs[0].prompt == req.jobs[1].prompt == tok.encode_with_special("Hello world")
    assert req.jobs[2].prompt == tok.encode_with_special("Good")
    assert [j.seed for j in req.jobs] == [7, 8, 7, 8]          # choice j samples with seed + j (vLLM)
    assert all(not j.greedy and j.temperature == 0.5 and j.top_k == 0 and j.stop == ("\n",) for j in req.jobs)
    assert all(j.max_tokens == 16 for j in req.jobs)             # OpenAI's default


def test_max_tokens_defaults_stay_inside_the_context(tok):
    ids = list(range(1, 61))                                      # 60 of 64 positions
    assert completion_request(fields({"prompt": ids}), tok, CONTEXT).jobs[0].max_tokens == 4
    d = RequestDefaults(max_tokens=3)
    assert completion_request(fields({"prompt": [1, 2]}), tok, CONTEXT, d).jobs[0].max_tokens == 3
    with pytest.raises(ApiError) as e:                            # an explicit value beyond it is refused
        completion_request(fields({"prompt": ids, "max_tokens": 5}), tok, CONTEXT)
    assert e.value.body()["error"]["code"] == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(ApiError) as e:
        completion_request(fields({"prompt": list(range(1, 65))}), tok, CONTEXT)
    assert e.value.param == "prompt"


def test_defaults_apply_only_to_fields_left_out(tok):
    d = RequestDefaults(temperature=0.0, top_p=0.9, top_k=5)
    j = completion_request(fields({"prompt": "x"}), tok, CONTEXT, d).jobs[0]
    assert j.greedy and j.top_p == 0.9 and j.top_k == 5
    j = completion_request(fields({"prompt": "x", "temperature": 0.7, "top_k": 2}), tok, CONTEXT, d).jobs[0]
    assert not j.greedy and j.temperature == 0.7 and j.top_k == 2


def test_temperatures_below_vllms_epsilon_are_greedy(tok):
    """vLLM's sampling_params.py: temperature < _SAMPLING_EPS (1e-5) is greedy. Dividing float32 logits
    by 1e-300 (0 in float32) would make every score inf or NaN, and sampling from them noise."""
    import numpy as np

    from msllm.serving.protocol import SAMPLING_EPS

    with np.errstate(divide="ignore", invalid="ignore"):
        assert not np.isfinite(np.float32([1.5, -2.0]) / np.float32(1e-300)).any()
    for t, greedy in [(0, True), (1e-300, True), (9.9e-6, True), (SAMPLING_EPS, False), (0.5, False)]:
        j = completion_request(fields({"prompt": "x", "temperature": t}), tok, CONTEXT).jobs[0]
        assert j.greedy == greedy, t


def test_chat_jobs_are_the_template_s_ids(tok, template):
    from msllm.data.templates import encode_prompt
    from msllm.generation.prompts import GPT, HUMAN

    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    req = chat_request(fields({"messages": msgs, "n": 3, "logprobs": True, "top_logprobs": 2}, True), tok,
                       template, 512)
    want = encode_prompt(tok, template, [(HUMAN, "Hi"), (GPT, "Hello."), (HUMAN, "Bye")])
    assert all(j.prompt == want for j in req.jobs) and len(req.jobs) == 3 and req.logprobs
    assert all(j.logprobs == 2 for j in req.jobs)
    assert req.jobs[0].max_tokens == 512 - len(want)              # chat default: the rest of the window
    with pytest.raises(ApiError) as e:
        chat_request(fields({"messages": msgs[:2]}, True), tok, template, 512)
    assert e.value.param == "messages" and "last message" in e.value.message


def test_responses_parse_as_the_openai_client_types():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    req = Request([], MODEL, chat=True)
    lp = chat_logprobs([("Hé", -0.5, [("Hé", -0.5), ("Ho", -1.5)]), ("!", float("-inf"), [])])
    c = ChatCompletion.model_validate(chat_response(req, [(0, "Hé!", "stop", lp), (1, "x", "length", None)], 5, 3))
    assert c.choices[0].logprobs.content[0].bytes == list("Hé".encode())
    assert c.choices[0].logprobs.content[1].logprob == -9999.0
    assert [t.token for t in c.choices[0].logprobs.content[0].top_logprobs] == ["Hé", "Ho"]
    assert c.usage.total_tokens == 8 and c.choices[1].finish_reason == "length"
    ch = ChatCompletionChunk.model_validate(chat_chunk(req, {"content": "a"}, None, 2))
    assert ch.choices[0].index == 2
    ChatCompletionChunk.model_validate(usage_chunk(req, 1, 2))
    creq = Request([], MODEL, chat=False)
    # (an echoed prompt's first token has null entries, as OpenAI's API answers, though the
    # client's pydantic types say float: the client itself builds responses without validating)
    lo = logprobs_object(["a", "bc"], [-0.1, -0.25], [{"a": -0.1}, {"bc": -0.25}])
    comp = Completion.model_validate(completion_response(
        creq, [{"index": 0, "text": "abc", "logprobs": lo, "finish_reason": "stop"}], 2, 1))
    assert comp.choices[0].logprobs.text_offset == [0, 1]
    Completion.model_validate(completion_chunk(creq, 0, "", "length"))   # (mid-stream chunks: finish null)


def test_generation_config_becomes_request_defaults_or_is_refused_by_name(tmp_path):
    from msllm.errors import MsllmError
    from msllm.config_generation import GenerationConfig
    from msllm.serving.defaults import request_defaults

    d, notes = request_defaults(GenerationConfig(do_sample=False, max_new_tokens=64, use_past=True))
    assert d == RequestDefaults(temperature=0.0, max_tokens=64) and len(notes) == 1 and "use_past" in notes[0]
    d, _ = request_defaults(GenerationConfig(do_sample=True, temperature=0.6, top_k=40, top_p=0.9), 100)
    assert d == RequestDefaults(0.6, 0.9, 40, 100)
    assert request_defaults(None) == (RequestDefaults(), [])
    for gen, key in [(GenerationConfig(repetition_penalty=1.2), "repetition_penalty"),
                     (GenerationConfig(num_beams=4), "num_beams"), (GenerationConfig(max_length=30), "max_length")]:
        with pytest.raises(MsllmError, match=key):
            request_defaults(gen)
    with pytest.raises(MsllmError, match="max_tokens_default"):
        request_defaults(None, 0)
    # MindFormers' keys in model.model_config fill what generation_config leaves unset (as predict):
    # moved into generation_config when the YAML is read
    from msllm.config import load_config

    tiny = os.path.join(REPO, "configs", "llama", "run_llama_tiny.yaml")
    mf = ["--model.model_config.do_sample=True", "--model.model_config.top_k=7"]
    d, _ = request_defaults(load_config(tiny, mf + ["--generation_config.top_k=3"]).generation_config)
    assert d == RequestDefaults(1.0, 1.0, 3, None)
    d, _ = request_defaults(load_config(tiny, ["--model.model_config.do_sample=False",
                                               "--model.model_config.top_k=7"]).generation_config)
    assert d == RequestDefaults(0.0, 1.0, 7, None)
    with pytest.raises(MsllmError, match="repetition_penalty"):
        request_defaults(load_config(tiny, ["--model.model_config.repetition_penalty=1.1"]).generation_config)
    # a command-line value in MindFormers' place beats the YAML's generation_config section
    yaml_path = tmp_path / "gen.yaml"
    yaml_path.write_text(open(tiny, encoding="utf-8").read() + "\ngeneration_config:\n  top_k: 3\n  do_sample: true\n")
    assert load_config(str(yaml_path)).generation_config.top_k == 3
    assert load_config(str(yaml_path), ["--model.model_config.top_k=5"]).generation_config.top_k == 5


def test_tokenize_and_detokenize_have_vllms_shapes(tok, template):
    from msllm.data.templates import encode_prompt
    from msllm.generation.prompts import HUMAN
    from msllm.serving.tokenize_routes import detokenize_body, tokenize_body

    out = tokenize_body({"prompt": "Hello world", "return_token_strs": True}, MODEL, tok, template, 512, Limits())
    want = tok.encode_with_special("Hello world")
    assert out == {"count": len(want), "max_model_len": 512, "tokens": want,
                   "token_strs": [tok.id_to_token(t) for t in want]}
    assert tokenize_body({"prompt": "Hello", "add_special_tokens": False}, MODEL, tok, template, 512,
                         Limits())["tokens"] == tok.encode("Hello")
    chat = tokenize_body({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, MODEL, tok, template,
                         512, Limits())
    assert chat["tokens"] == encode_prompt(tok, template, [(HUMAN, "Hi")])
    assert detokenize_body({"tokens": want}, MODEL, tok, 32000) == {"prompt": tok.decode(want)}
    for body, status, param in [({"tokens": [32000]}, 400, "tokens"), ({"tokens": "1"}, 400, "tokens"),
                                ({"model": "x", "tokens": [1]}, 404, "model"), ({"model": 5, "tokens": [1]}, 400, "model")]:
        with pytest.raises(ApiError) as e:
            detokenize_body(body, MODEL, tok, 32000)
        assert (e.value.status, e.value.param) == (status, param)
    with pytest.raises(ApiError) as e:
        tokenize_body({"prompt": "a", "messages": []}, MODEL, tok, template, 512, Limits())
    assert e.value.status == 400


def test_metrics_exposition_parses_back():
    """Hooks as the engine calls them; prometheus_client's own parser reads the page back."""
    import time
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from msllm.serving.metrics import ServerMetrics

    m = ServerMetrics()
    row = SimpleNamespace(slot=40, pad=9)
    fake = SimpleNamespace(batch=SimpleNamespace(active=1, rows=[row, None], buffer=512),
                           queue=SimpleNamespace(qsize=lambda: 3))
    m.bind(fake)
    work = SimpleNamespace(job=SimpleNamespace(prompt=[1] * 12), t_submit=time.monotonic(), t_last=None)
    m.on_admit(work)
    for _ in range(3):
        m.on_token(work)
    m.on_done(work, "stop")
    m.on_error(work)
    data, kind = m.render()
    assert kind.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(data.decode()) for s in f.samples}
    assert samples[("msllm:num_requests_running", ())] == 1
    assert samples[("msllm:num_requests_waiting", ())] == 3
    assert samples[("msllm:prompt_tokens_total", ())] == 12
    assert samples[("msllm:generation_tokens_total", ())] == 3
    assert samples[("msllm:time_to_first_token_seconds_count", ())] == 1
    assert samples[("msllm:inter_token_latency_seconds_count", ())] == 2
    assert samples[("msllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert samples[("msllm:request_failure_total", ())] == 1
    assert samples[("msllm:kv_cache_slots_in_use", ())] == 32
    assert samples[("msllm:kv_cache_usage_perc", ())] == pytest.approx(32 / 1024)


def test_a_template_refusal_is_a_400_without_the_servers_file_paths(tok):
    """A chat template's raise_exception reaches the client as a 400 naming ``messages`` in the
    template's own words; the message the CLI prints names the template's file, the client's does not."""
    from msllm.data.chat_template import ChatTemplate, TemplateRefused
    from msllm.serving.tokenize_routes import tokenize_body

    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}", tok)
    assert refusing.where.endswith("tokenizer.model")          # a path on the server's disk
    with pytest.raises(TemplateRefused) as cli:
        refusing.prompt([("human", "hi")])
    assert refusing.where in str(cli.value)
    msgs = [{"role": "user", "content": "hi"}]
    for build in (lambda: chat_request(fields({"messages": msgs}, chat=True), tok, refusing, CONTEXT),
                  lambda: tokenize_body({"messages": msgs}, MODEL, tok, refusing, CONTEXT, Limits())):
        with pytest.raises(ApiError) as e:
            build()
        assert (e.value.status, e.value.param) == (400, "messages")
        assert "roles must alternate" in e.value.message and refusing.where not in e.value.message
