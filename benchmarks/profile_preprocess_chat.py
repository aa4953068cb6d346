"""Where msllm's qa preprocessing with an HF tokenizer and its chat template spends its tokenize
time (issue #19): the bundled 999 Alpaca conversations, SmolLM2-135M-Instruct's tokenizer.json and
chat template, one process: per-phase seconds (Jinja renders of ``ChatTemplate.segments``, the
Rust encode with offsets one by one and in batches, the labels) and the top cProfile entries of
``build_qa_samples`` (chunks of 64, as preprocessing runs it), beside transformers' batched ``apply_chat_template`` on the same conversations
(render once + ``encode_batch``).

    .venv/bin/python benchmarks/profile_preprocess_chat.py [--out benchmarks/results/profile_preprocess_smollm2.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

common.use_repo()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "profile_preprocess_smollm2.json"))
    a = ap.parse_args()
    from msllm.convert.real_model import ensure_smollm2
    from msllm.data.samples import build_qa_sample, build_qa_samples
    from msllm.data.templates import encode_segments, resolve_template
    from msllm.data.tokenizer import load_tokenizer

    hf = ensure_smollm2()
    with open(common.alpaca_conversation(), encoding="utf-8") as fh:
        convs = [[(t["from"], t["value"]) for t in r["conversations"]] for r in json.load(fh)]
    tok = load_tokenizer(hf, 0)
    tmpl = resolve_template("chat_template", tok)
    load0 = common.loadavg()
    ph = {}
    t = time.perf_counter()
    full = [tmpl.render(c, add_generation_prompt=False) for c in convs]
    ph["render_full_once_s"] = time.perf_counter() - t
    t = time.perf_counter()
    segs = [tmpl.segments(c) for c in convs]
    ph["segments_s (3 renders per 1-turn conversation + checks)"] = time.perf_counter() - t
    t = time.perf_counter()
    enc = [tok.encode_with_offsets("".join(x for x, _ in s)) for s in segs]
    ph["encode_with_offsets_one_by_one_s"] = time.perf_counter() - t
    t = time.perf_counter()
    tok.encode_batch(full)
    ph["encode_batch_s (Rust batch, for comparison)"] = time.perf_counter() - t
    t = time.perf_counter()
    for s in segs:
        encode_segments(tok, s)
    ph["encode_segments_s (encode + Python label loop)"] = time.perf_counter() - t
    t = time.perf_counter()
    for c in convs:
        build_qa_sample(tok, c, 256, tmpl)
    ph["build_qa_sample_total_s (one by one)"] = time.perf_counter() - t
    texts = ["".join(x for x, _ in s) for s in segs]
    t = time.perf_counter()
    for i in range(0, len(texts), 64):
        tok.encode_batch_with_offsets(texts[i:i + 64])
    ph["encode_batch_with_offsets_s (chunks of 64, what preprocessing runs)"] = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(0, len(texts), 64):
        tok._tok.encode_batch_fast(texts[i:i + 64], add_special_tokens=False)
    ph["rust_encode_batch_fast_s (ids only, no offsets: what transformers runs)"] = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(0, len(convs), 64):
        build_qa_samples(tok, convs[i:i + 64], 256, tmpl)
    ph["build_qa_samples_total_s (chunks of 64, what preprocessing runs)"] = time.perf_counter() - t
    prof = cProfile.Profile()
    prof.enable()
    for i in range(0, len(convs), 64):
        build_qa_samples(tok, convs[i:i + 64], 256, tmpl)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
    from transformers import AutoTokenizer

    hft = AutoTokenizer.from_pretrained(hf)
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    chats = [[{"role": role[r], "content": v} for r, v in c] for c in convs]
    t = time.perf_counter()
    for i in range(0, len(chats), 64):
        hft.apply_chat_template(chats[i:i + 64], tokenize=True)
    ph["transformers_apply_chat_template_batch64_s"] = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(0, len(chats), 64):
        hft.apply_chat_template(chats[i:i + 64], tokenize=False)
    ph["transformers_render_only_batch64_s"] = time.perf_counter() - t
    res = {"machine": common.machine(), "load_before": load0, "load_after": common.loadavg(), "records": len(convs),
           "tokens": sum(len(e[0]) for e in enc), "phases": ph, "cprofile_build_qa_sample": buf.getvalue(),
           "command": " ".join([os.path.relpath(sys.executable, common.ROOT)] + sys.argv)}
    for k, v in ph.items():
        print(f"{k:60s} {v:7.2f} s")
    print(buf.getvalue()[:4000])
    import harness

    harness.write_json(a.out, res)
    print("results in", a.out)


if __name__ == "__main__":
    main()
