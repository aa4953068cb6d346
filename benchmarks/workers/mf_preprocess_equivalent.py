"""The work MindFormers' ``llama_preprocess.py --dataset_type qa`` does, re-implemented on
MindFormers' installed pieces (runs in benchmarks/.venv-mindformers).

Why a re-implementation: MindFormers 1.9.0's wheel does not ship the script (it lives in the
MindFormers source tree under ``mindformers/tools/dataset_preprocess/llama/`` next to FastChat's
``conversation.py``), and this repository does not copy it. What is reproduced here, written
from its description, is its cost structure:

* the whole input JSON is loaded with ``json.load``;
* every conversation is rendered with FastChat's Vicuna v1.1 template (system prompt, then
  ``USER: {human} ASSISTANT: {gpt}</s>`` per round);
* the rendered prompt is split into rounds at ``</s>`` and each round is tokenized with
  MindFormers' ``LlamaTokenizer`` (a ``PreTrainedTokenizer`` call returning ``input_ids`` and
  ``attention_mask``), the ids are padded with ``tokenizer._pad`` to ``seq_length + 1``;
* to build the labels every round is tokenized again, and its instruction part a third time,
  to find the lengths to mask;
* one process; rows are written with ``FileWriter.write_raw_data([row])`` one at a time.

Usage: python mf_preprocess_equivalent.py INPUT.json TOKENIZER.model SEQ_LENGTH OUT.mindrecord
Prints one ``BENCH_RESULT {json}`` line (records, rows, tokens, seconds).
"""

import json
import os
import sys
import time

T0 = time.perf_counter()

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

IGNORE = -100
SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")
ROLES = {"human": "USER", "gpt": "ASSISTANT"}
SEP, SEP2 = " ", "</s>"


def vicuna_prompt(turns):
    """FastChat ``SeparatorStyle.TWO`` rendering of a list of {"from", "value"} turns."""
    out = SYSTEM + SEP
    for i, t in enumerate(turns):
        out += ROLES[t["from"]] + ": " + t["value"] + (SEP if i % 2 == 0 else SEP2)
    return out


def usable(turns):
    """The conversations msllm keeps: human, gpt, human, gpt ... ending with gpt."""
    if not turns or len(turns) % 2:
        return False
    return all(t.get("from") == ("human" if i % 2 == 0 else "gpt") for i, t in enumerate(turns))


def main():
    src, model_file, seq_length, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    length = seq_length + 1
    np = common.np
    t = time.perf_counter()
    from mindspore.mindrecord import FileWriter
    from mindformers.models.llama.llama_tokenizer import LlamaTokenizer
    import_s = time.perf_counter() - t

    t_start = time.perf_counter()
    with open(src, "r") as fh:
        raw = json.load(fh)
    convs = [r["conversations"] for r in raw if usable(r["conversations"])]
    tok = LlamaTokenizer(vocab_file=model_file)
    tok.add_bos_token = True
    tok.add_eos_token = True
    for p in (out, out + ".db"):
        if os.path.exists(p):
            os.remove(p)
    writer = FileWriter(file_name=out, shard_num=1)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]},
                       "labels": {"type": "int32", "shape": [-1]}}, "qa")
    sep = SEP + ROLES["gpt"] + ": "
    rows = tokens = 0
    for turns in convs:
        rounds = vicuna_prompt(turns).split(SEP2)
        ids = [tok.bos_token_id]
        mask = [1]
        for rou in rounds:
            if rou == "":
                break
            o = tok(rou)
            ids.extend(o["input_ids"][1:])
            mask.extend(o["attention_mask"][1:])
        d = tok._pad({"input_ids": ids, "attention_mask": mask}, max_length=length,
                     padding_strategy="max_length")
        input_ids = d["input_ids"][:length]
        target = np.array(d["input_ids"])
        total = int(np.not_equal(target, tok.pad_token_id).sum())
        cur = 1
        target[:cur] = IGNORE
        for rou in rounds:
            if rou == "":
                break
            parts = rou.split(sep)
            if len(parts) != 2:
                break
            parts[0] += sep
            round_len = len(tok(rou)["input_ids"]) - 1
            instr_len = len(tok(parts[0])["input_ids"]) - 3
            target[cur:cur + instr_len] = IGNORE
            cur += round_len
        target[cur:] = IGNORE
        if cur < length:
            if cur != total:
                target[:] = IGNORE
        else:
            target = target[:length]
        tokens += min(total, length)
        writer.write_raw_data([{"input_ids": np.asarray(input_ids, np.int32),
                                "labels": np.asarray(target, np.int32)}])
        rows += 1
    writer.commit()
    total_s = time.perf_counter() - t_start
    common.emit({"records_in_file": len(raw), "records": len(convs), "rows": rows, "tokens": tokens,
                 "import_s": import_s, "seconds": total_s, "process_seconds": time.perf_counter() - T0,
                 "peak_rss_mib": common.peak_rss_mib()})


if __name__ == "__main__":
    main()
