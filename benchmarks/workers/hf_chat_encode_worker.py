"""transformers' batch chat encoding for benchmarks/preprocess_speed.py ``--hf_dir``: the
conversation file (``[{"id", "conversations": [{"from": "human"|"gpt", "value"}...]}]``, the
input of ``data_preprocess/llama_preprocess.py --dataset_type qa``) as chat messages (human ->
user, gpt -> assistant), ``AutoTokenizer.from_pretrained(HF_DIR).apply_chat_template(all
conversations, tokenize=True)`` in batches of ``BATCH`` conversations (the fast Rust tokenizer;
``TOKENIZERS_PARALLELISM`` as the environment has it).

    python hf_chat_encode_worker.py HF_DIR CONVERSATIONS.json [BATCH]

Prints one ``BENCH_RESULT {json}`` line: records, tokens, seconds of import / tokenizer load /
reading the JSON / encoding, and the in-process total.
"""

import json
import sys
import time

T0 = time.perf_counter()


def main():
    hf_dir, src = sys.argv[1], sys.argv[2]
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    t = time.perf_counter()
    import transformers
    from transformers import AutoTokenizer

    import_s = time.perf_counter() - t
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    with open(src, encoding="utf-8") as fh:
        records = json.load(fh)
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    chats = [[{"role": role[m["from"]], "content": m["value"]} for m in r["conversations"]] for r in records]
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    tokens = 0
    for i in range(0, len(chats), batch):
        ids = tok.apply_chat_template(chats[i:i + batch], tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        tokens += sum(len(x) for x in ids)
    encode_s = time.perf_counter() - t
    sys.stdout.write("BENCH_RESULT " + json.dumps({
        "records": len(records), "tokens": tokens, "batch": batch, "import_s": import_s, "load_s": load_s,
        "read_s": read_s, "encode_s": encode_s, "in_process_s": time.perf_counter() - T0,
        "transformers": transformers.__version__}) + "\n")


if __name__ == "__main__":
    main()
