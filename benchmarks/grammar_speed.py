"""Which grammar library for ``response_format`` (issue #32: "xgrammar, llguidance or outlines-core: pick by
measurement and say why"): the three on SmolLM2-135M-Instruct's tokenizer (49,152 ids), single process,
one library after another in alternating order per round.

Per library and JSON schema (``SCHEMAS``: any JSON object, a flat record, a nested one with enums, arrays
and ``$ref``):

* ``tokenizer_s``: building the library's view of the tokenizer (once per server);
* ``compile_s``: turning the schema into something a row can follow (once per request with that schema;
  xgrammar's compiler cache is switched off so every round compiles);
* ``mask_us`` median / p99 / max: one step of a row, i.e. filling the (V,) allowed-token bitmask and
  then accepting the next token, over a fixed valid JSON text of that schema tokenized with the model's
  tokenizer (the token sequence a greedy row would follow), so every library walks the same tokens;
* ``accepts``: the library allowed every token of the text and ends in an accepting state (a check
  that the three constrain the same language on this text, not a benchmark figure).

Every library is asked for the same layout as msllm's server (``msllm.serving.structured.JSON_LAYOUT``:
``", "`` and ``": "`` separators, no other whitespace): llguidance through that option, xgrammar
``any_whitespace=False, separators=(", ", ": ")``, outlines-core a whitespace pattern of one optional
space (its regex-based JSON does not fix separators).

The candidates are installed by this script into ``benchmarks/.cache/grammar_libs`` (``pip install
--target``, no dependencies: xgrammar 0.2.8 imports ``apache-tvm-ffi`` and torch/transformers, which
the dev venv has; its other dependencies (triton, CUDA) are GPU-only), so the project's venv keeps
llguidance alone.

    .venv/bin/python benchmarks/grammar_speed.py --rounds 3 --out benchmarks/results/grammar_speed_<machine>.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402

LIBS_DIR = os.path.join(HERE, ".cache", "grammar_libs")
PINS = ["xgrammar==0.2.8", "apache-tvm-ffi==0.1.15.post2", "outlines-core==0.2.14"]
SEPARATORS = (", ", ": ")

SCHEMAS = {
    "json_object": ({"type": "object"},
                    {"answer": "Paris", "confidence": 0.93, "sources": ["atlas", "encyclopedia"], "final": True}),
    "flat_record": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                      "email": {"type": "string"}, "member": {"type": "boolean"}},
                     "required": ["name", "age", "email", "member"], "additionalProperties": False},
                    {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "member": True}),
    "nested_enums_refs": ({
        "type": "object", "$defs": {"armor": {"type": "string", "enum": ["leather", "chainmail", "plate"]},
                                    "item": {"type": "object", "properties": {"name": {"type": "string"},
                                                                              "weight": {"type": "number"}},
                                             "required": ["name", "weight"], "additionalProperties": False}},
        "properties": {"hero": {"type": "string"}, "level": {"type": "integer"}, "armor": {"$ref": "#/$defs/armor"},
                       "items": {"type": "array", "items": {"$ref": "#/$defs/item"}},
                       "stats": {"type": "object", "properties": {"str": {"type": "integer"}, "dex": {"type": "integer"}},
                                 "required": ["str", "dex"], "additionalProperties": False}},
        "required": ["hero", "level", "armor", "items", "stats"], "additionalProperties": False},
        {"hero": "Brienne", "level": 12, "armor": "plate", "items": [{"name": "sword", "weight": 3.5},
                                                                     {"name": "shield", "weight": 6.25}],
         "stats": {"str": 17, "dex": 11}}),
}


def ensure_libs() -> None:
    """Install the candidates into :data:`LIBS_DIR` once (temp dir, then rename)."""
    if os.path.isdir(LIBS_DIR):
        return
    tmp = LIBS_DIR + ".part"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", tmp, *PINS],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"pip install --target {tmp} {' '.join(PINS)} failed:\n{r.stderr[-2000:]}")
    os.replace(tmp, LIBS_DIR)


def byte_decoder() -> dict:
    """GPT-2 byte-level BPE's character -> byte table (the reversible map of every byte to a printable
    character: printable Latin-1 bytes map to themselves, the rest to U+0100 upwards in byte order;
    Radford et al. 2019, the ``bytes_to_unicode`` of openai/gpt-2's encoder.py)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Llguidance:
    name = "llguidance"

    def __init__(self, tok_json: str, vocab: int, eos: list):
        import llguidance

        from msllm.serving.structured import JSON_LAYOUT

        self.ll, self.layout = llguidance, JSON_LAYOUT
        self.tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
        self.vocab = vocab

    def compile(self, schema):
        return self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=self.layout)

    def run(self, grammar, tokens):
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        m = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        bits = allocate_token_bitmask(1, self.vocab)
        times, ok = [], True
        for t in tokens:
            s = time.perf_counter()
            fill_next_token_bitmask(m, bits, 0)
            ok = ok and bool(m.consume_token(int(t)))
            times.append(time.perf_counter() - s)
        return times, ok and m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, model_dir: str, vocab: int, eos: list):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self.x = xgr
        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab,
                                                  stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab, self.eos = vocab, eos

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)

    def run(self, compiled, tokens):
        m = self.x.GrammarMatcher(compiled)
        bits = self.x.allocate_token_bitmask(1, self.vocab)
        times, ok = [], True
        for t in tokens:
            s = time.perf_counter()
            m.fill_next_token_bitmask(bits)
            ok = ok and bool(m.accept_token(int(t)))
            times.append(time.perf_counter() - s)
        # complete: the matcher takes the stop token now
        return times, ok and bool(m.accept_token(int(self.eos[0])))


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok_json: str, vocab: int, eos: list):
        import outlines_core

        self.oc = outlines_core
        table = json.loads(tok_json)["model"]["vocab"]
        dec = byte_decoder()
        words: dict = {}
        for piece, i in table.items():
            if i in eos or i >= vocab:
                continue
            try:
                key = bytes(dec[c] for c in piece)
            except KeyError:      # a special token: not byte-level text
                continue
            words.setdefault(key, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos[0], words)
        self.vocab = vocab

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), self.vocabulary)

    def run(self, index, tokens):
        import numpy as np

        g = self.oc.Guide(index)
        # the (1, ceil(V / 32)) int32 bitmask of outlines_core.kernels.numpy, filled by the Guide's own
        # write_mask_into as that module's fill_next_token_bitmask does (the module itself imports numba)
        bits = np.full((1, (self.vocab + 31) // 32), -1, dtype=np.int32)
        times, ok = [], True
        for t in tokens:
            s = time.perf_counter()
            g.write_mask_into(bits.ctypes.data, bits.size, bits.itemsize)
            try:
                g.advance(int(t))
            except Exception:     # the guide refuses the token
                ok = False
                times.append(time.perf_counter() - s)
                break
            times.append(time.perf_counter() - s)
        return times, ok and bool(g.is_finished())


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "grammar_speed.json"))
    a = p.parse_args(argv)
    ensure_libs()
    sys.path.insert(0, LIBS_DIR)
    sys.path.insert(0, common.ROOT)
    from msllm.convert.real_model import ensure_smollm2

    model_dir = ensure_smollm2()
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as fh:
        tok_json = fh.read()
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    vocab, eos = cfg["vocab_size"], [cfg.get("eos_token_id", 2)]
    from tokenizers import Tokenizer

    enc = Tokenizer.from_str(tok_json)
    texts = {k: json.dumps(v[1], separators=SEPARATORS) for k, v in SCHEMAS.items()}
    tokens = {k: enc.encode(t, add_special_tokens=False).ids for k, t in texts.items()}
    makers = {"llguidance": lambda: Llguidance(tok_json, vocab, eos), "xgrammar": lambda: Xgrammar(model_dir, vocab, eos),
              "outlines-core": lambda: OutlinesCore(tok_json, vocab, eos)}
    import importlib.metadata as md

    versions = {}
    for dist in ("llguidance", "xgrammar", "outlines-core"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = "not found"
    info = common.machine()
    print(f"# {info}\n# {versions}\n# tokens per text: { {k: len(v) for k, v in tokens.items()} }", flush=True)
    t0, runs = time.time(), []
    names = list(makers)
    for rnd in range(a.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            s = time.perf_counter()
            lib = makers[name]()
            tok_s = time.perf_counter() - s
            for key, (schema, _) in SCHEMAS.items():
                s = time.perf_counter()
                try:
                    compiled = lib.compile(schema)
                except Exception as exc:       # a schema the library cannot take: recorded, not fatal
                    runs.append({"round": rnd, "library": name, "schema": key, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    print(f"round {rnd} {name:14s} {key:18s} refused: {exc}"[:200], flush=True)
                    continue
                comp_s = time.perf_counter() - s
                times, ok = lib.run(compiled, tokens[key])
                us = [1e6 * x for x in times]
                row = {"round": rnd, "library": name, "schema": key, "tokenizer_s": tok_s, "compile_s": comp_s,
                       "mask_us_median": common.median(us), "mask_us_p99": pct(us, 0.99), "mask_us_max": max(us),
                       "tokens": len(tokens[key]), "accepts": bool(ok)}
                runs.append(row)
                print(f"round {rnd} {name:14s} {key:18s} tokenizer {tok_s:6.2f} s  compile {1000 * comp_s:8.1f} ms  "
                      f"mask+accept median {row['mask_us_median']:8.1f} us  p99 {row['mask_us_p99']:8.1f} us  "
                      f"accepts {ok}", flush=True)
    summary = {}
    for name in names:
        for key in SCHEMAS:
            rows = [r for r in runs if r["library"] == name and r["schema"] == key and "error" not in r]
            if not rows:
                summary[f"{name}/{key}"] = {"error": next((r["error"] for r in runs if r["library"] == name
                                                           and r["schema"] == key), "no run")}
                continue
            summary[f"{name}/{key}"] = {k: common.median([r[k] for r in rows]) for k in
                                        ("tokenizer_s", "compile_s", "mask_us_median", "mask_us_p99")}
            summary[f"{name}/{key}"]["accepts"] = all(r["accepts"] for r in rows)
    lines = ["| library | schema | tokenizer s | compile ms | mask + accept us, median | p99 | accepts the text |",
             "|---|---|---|---|---|---|---|"]
    for k, v in summary.items():
        name, key = k.split("/")
        if "error" in v:
            lines.append(f"| {name} | {key} | | refused: {v['error'][:80]} | | | |")
        else:
            lines.append(f"| {name} | {key} | {v['tokenizer_s']:.2f} | {1000 * v['compile_s']:.1f} | "
                         f"{v['mask_us_median']:.1f} | {v['mask_us_p99']:.1f} | {v['accepts']} |")
    result = {"machine": info, "command": harness.command_line(), "versions": versions, "texts": texts,
              "total_seconds": time.time() - t0, "summary": summary, "runs": runs}
    harness.finish(a.out, result, "\n".join(lines), t0)


if __name__ == "__main__":
    main()
