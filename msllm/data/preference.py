"""Pairwise preference data for DPO: records -> chosen / rejected rows -> a MindRecord.

Input records (``.json`` list or ``.jsonl``, one object per record; ``llama_preprocess.py
--dataset_type dpo``), in the formats MindSpeed-LLM's and TRL's preference datasets use:

* MindSpeed-LLM ``AlpacaStylePairwise`` / LLaMA-Factory ``ranking`` records:
  ``{"prompt" | "instruction" | "question": str, ["input": str], ["system": str], "chosen": str,
  "rejected": str}`` (a non-empty ``input`` is appended to the instruction after a newline, as
  LLaMA-Factory's alpaca converter does);
* TRL's conversational preference records: ``{"prompt": [messages], "chosen": [messages],
  "rejected": [messages]}`` with ``{"role": "system"|"user"|"assistant", "content": str}``
  messages; the completions are one assistant message each;
* TRL's implicit-prompt records (no ``prompt``): ``chosen`` / ``rejected`` are whole
  conversations; the prompt is their longest common prefix of messages (TRL's ``extract_prompt``,
  trl 1.16.0 ``trl/data_utils.py``), the rest must be one assistant message each.

Rendering and labels (TRL 1.16.0 ``trl/trainer/dpo_trainer.py`` ``DPOTrainer._prepare_dataset``
``tokenize_fn``, the reference the parity tests check): ``prompt_ids`` = the prompt rendered with
the generation prompt (the chat template's ``add_generation_prompt=True``; a named template's
:meth:`~msllm.data.templates.Template.prompt`), ``full_ids`` = prompt + completion rendered as a
conversation, both tokenised as SFT data is (special-token strings are single tokens). The
completion starts where the prompt's ids and *both* full sequences stop agreeing (TRL's
``common_prefix_length`` taken over chosen and rejected), so chosen and rejected share their prompt
ids exactly; every token after it is a target (with ChatML that is the answer, ``<|im_end|>`` and
the newline after it, as TRL counts them). Rows are ``seq_length + 1`` long like SFT rows
(``tokens = ids[:-1]``, ``targets = labels[1:]``), cut at the end when longer (TRL's
``truncation_mode="keep_start"``); a pair whose prompt alone fills the row is skipped (TRL drops it
too), as is one where either completion is empty.

MindRecord columns (the names of MindRLHF's DPO preprocessing, ``dpo_preprocess.py``, which
MindFormers' DPO documentation uses): ``chosen_input_ids``, ``chosen_labels``,
``rejected_input_ids``, ``rejected_labels`` (int32, ``seq_length + 1``; labels ``-100`` outside the
completion, msllm's SFT convention, where MindRLHF keeps a separate ``*_loss_mask``).
:data:`REF_COLUMNS` (``chosen_ref_logps`` / ``rejected_ref_logps``, float32 (1,), MindRLHF's names for
the reference's summed completion log-probs) are recognised by :func:`read_preference_arrays` but
no msllm tool writes them and training does not read them: ``dpo.precompute_ref`` computes the
reference values at the start of the run instead (TRL's semantics, :mod:`msllm.training.dpo_values`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Sequence

import numpy as np

from msllm.data.conversation import json_lines, load_json_file
from msllm.data.templates import IGNORE_INDEX
from msllm.errors import MsllmError

PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
REF_COLUMNS = ("chosen_ref_logps", "rejected_ref_logps")
PAIR_SCHEMA = {name: {"type": "int32", "shape": [-1]} for name in PAIR_COLUMNS}
REF_SCHEMA = {name: {"type": "float32", "shape": [-1]} for name in REF_COLUMNS}
PROMPT_KEYS = ("prompt", "instruction", "question")
ROLE_OF = {"user": "human", "assistant": "gpt", "system": "system", "human": "human", "gpt": "gpt"}

SKIP_PROMPT_FILLS_ROW = "prompt fills seq_length + 1 (no completion token left)"
SKIP_EMPTY_COMPLETION = "chosen or rejected completion is empty"


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One record: ``prompt`` turns ``(role, text)`` (roles ``system``/``human``/``gpt``, ending with
    ``human``), and the two answers' texts."""

    prompt: tuple
    chosen: str
    rejected: str


def _where(path: str, index: int) -> str:
    return f"{path}: record {index}"


def _messages(value: Any, where: str, key: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise MsllmError(f"{where} key {key!r}: expected a non-empty list of {{'role', 'content'}} messages")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLE_OF:
            raise MsllmError(f"{where} key {key!r} message {k}: expected {{'role': system|user|assistant, "
                             f"'content': str}}, got {m!r:.120}")
        out.append((ROLE_OF[m["role"]], m["content"]))
    return out


def _answer(turns: list[tuple[str, str]], where: str, key: str) -> str:
    if len(turns) != 1 or turns[0][0] != "gpt":
        raise MsllmError(f"{where} key {key!r}: expected exactly one assistant message as the completion, "
                         f"got roles {[r for r, _ in turns]}")
    return turns[0][1]


def parse_record(rec: Any, path: str, index: int) -> PreferencePair:
    """One decoded record -> :class:`PreferencePair` (formats in the module doc).

    Raises:
        MsllmError: naming ``path``, the record index and the key: not an object, no
            ``chosen``/``rejected``, no prompt key, wrong types, completions that are not one
            assistant message.
    """
    where = _where(path, index)
    if not isinstance(rec, dict):
        raise MsllmError(f"{where} is a JSON {type(rec).__name__}, expected an object with prompt/chosen/rejected")
    for key in ("chosen", "rejected"):
        if key not in rec:
            raise MsllmError(f"{where} has no {key!r} key (expected a string or a list of messages)")
    chosen, rejected = rec["chosen"], rec["rejected"]
    if isinstance(chosen, list) or isinstance(rejected, list):   # TRL conversational
        c, r = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
        if "prompt" in rec:
            prompt = _messages(rec["prompt"], where, "prompt")
        else:   # implicit prompt: the longest common prefix of messages
            n = 0
            while n < min(len(c), len(r)) and c[n] == r[n]:
                n += 1
            prompt, c, r = c[:n], c[n:], r[n:]
        if not prompt or prompt[-1][0] != "human":
            raise MsllmError(f"{where}: the prompt must end with a user message (got roles {[p for p, _ in prompt]})")
        return PreferencePair(tuple(prompt), _answer(c, where, "chosen"), _answer(r, where, "rejected"))
    key = next((k for k in PROMPT_KEYS if k in rec), None)
    if key is None:
        raise MsllmError(f"{where} has none of the prompt keys {PROMPT_KEYS} (expected one, a string)")
    fields = {k: rec.get(k) for k in (key, "input", "system", "chosen", "rejected")}
    for k, v in fields.items():
        if v is not None and not isinstance(v, str):
            raise MsllmError(f"{where} key {k!r} is a JSON {type(v).__name__}, expected a string")
    text = fields[key] + ("\n" + fields["input"] if fields["input"] else "")
    turns = ([("system", fields["system"])] if fields["system"] else []) + [("human", text)]
    return PreferencePair(tuple(turns), chosen, rejected)


def read_preference_file(path: str) -> list[PreferencePair]:
    """All records of a ``.json`` (list) or ``.jsonl`` file. Raises MsllmError (file, line/record, key)."""
    if path.endswith(".jsonl"):
        if not os.path.isfile(path):
            raise MsllmError(f"{path}: file not found (expected a JSON-lines file of preference records)")
        with open(path, encoding="utf-8") as fh:
            return [parse_record(v, f"{path} line {n}", i) for i, (n, v) in enumerate(json_lines(fh, path))]
    data = load_json_file(path)
    if not isinstance(data, list):
        raise MsllmError(f"{path}: top level is a JSON {type(data).__name__}, expected a list of preference records")
    return [parse_record(v, path, i) for i, v in enumerate(data)]


# ---- rows ----------------------------------------------------------------------------------------

def _render(template, turns: Sequence[tuple[str, str]], generation_prompt: bool) -> str:
    if hasattr(template, "render"):   # a model's Jinja chat template (ChatTemplate)
        return template.render(turns, add_generation_prompt=generation_prompt)
    if generation_prompt:
        return template.prompt(turns)
    return "".join(t for t, _ in template.segments(turns))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def build_pair(tokenizer, template, pair: PreferencePair, seq_length: int, pad_token_id: int):
    """The four int32 rows ``(chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels)``,
    each (seq_length + 1,), plus ``truncated``; or ``(None, reason)`` for a skipped pair (module doc).

    Raises MsllmError: the template refuses the conversation."""
    prompt = list(pair.prompt)
    prompt_ids = tokenizer.encode_special(_render(template, prompt, True))
    chosen_ids = tokenizer.encode_special(_render(template, prompt + [("gpt", pair.chosen)], False))
    rejected_ids = tokenizer.encode_special(_render(template, prompt + [("gpt", pair.rejected)], False))
    n = min(_common(prompt_ids, chosen_ids), _common(prompt_ids, rejected_ids))
    limit = seq_length + 1
    if n >= limit:
        return None, SKIP_PROMPT_FILLS_ROW
    if len(chosen_ids) <= n or len(rejected_ids) <= n:
        return None, SKIP_EMPTY_COMPLETION
    rows, truncated = [], False
    for ids in (chosen_ids, rejected_ids):
        truncated |= len(ids) > limit
        ids = np.asarray(ids[:limit], np.int32)
        row = np.full(limit, pad_token_id, np.int32)
        lab = np.full(limit, IGNORE_INDEX, np.int32)
        row[:len(ids)] = ids
        lab[n:len(ids)] = ids[n:]
        rows += [row, lab]
    return tuple(rows), truncated


def write_preference_mindrecord(path: str, rows: Iterator[tuple], meta: dict, with_ref: bool = False) -> int:
    """Write pair rows (four int32 arrays, plus two float32 (1,) reference log-probs with
    ``with_ref``) atomically (:func:`msllm.data.mindrecord.write_mindrecord`). Returns rows written."""
    from msllm.data.mindrecord import write_mindrecord

    schema = dict(PAIR_SCHEMA, **(REF_SCHEMA if with_ref else {}))
    return write_mindrecord(path, rows, meta=meta, schema=schema, description="msllm preference pairs")


def read_preference_arrays(path: str) -> dict[str, np.ndarray]:
    """Every column of a preference MindRecord as a stacked array ((N, L) int32 rows, (N, 1) float32
    reference log-probs when present). For tests, inspection and ``precompute``; small files."""
    from mindspore.mindrecord import FileReader

    from msllm.data.mindrecord import read_header

    header = read_header(path)
    fields = header["schema"][0].get("schema", {})
    missing = [c for c in PAIR_COLUMNS if c not in fields]
    if missing:
        raise MsllmError(f"{path}: not a preference MindRecord: no column(s) {missing} (columns: {sorted(fields)}); "
                         "expected llama_preprocess.py --dataset_type dpo output")
    cols = list(PAIR_COLUMNS) + [c for c in REF_COLUMNS if c in fields]
    reader = FileReader(path, num_consumer=1, columns=cols)
    out: dict[str, list] = {c: [] for c in cols}
    try:
        for row in reader.get_next():
            for c in cols:
                out[c].append(np.asarray(row[c]))
    finally:
        reader.close()
    return {c: np.stack(v) for c, v in out.items()}


def is_preference_mindrecord(path: str) -> bool:
    """Whether MindRecord data file ``path`` has the pair columns (reads only its header)."""
    from msllm.data.mindrecord import read_header

    fields = read_header(path)["schema"][0].get("schema", {})
    return all(c in fields for c in PAIR_COLUMNS)


# ---- the whole run (llama_preprocess.py --dataset_type dpo) -----------------------------------------

def preprocess_preference(input_glob: str, model_file: str, seq_length: int, output_file: str,
                          template: str | None = None, shuffle: bool = True, seed: int = 0,
                          pad_token_id: int | None = None, samples_num: int | None = None) -> dict:
    """Read every preference file matching ``input_glob``, build the pair rows and write the
    MindRecord ``output_file`` (+ ``.db`` and the ``.json`` sidecar, ``dataset_type: "dpo"``).

    ``template``: as for ``qa`` (None: the tokenizer's chat template if it has one, else
    ``vicuna_v1.1``); ``pad_token_id`` None: the tokenizer's; ``shuffle`` with
    ``numpy.random.default_rng(seed)``; ``samples_num``: keep the first N pairs built.

    Returns the counts (``records_read``, ``pairs_written``, ``truncated``, ``skipped``
    {reason: n}, ``output_file``, ``template``).

    Raises:
        MsllmError: no file matches; a malformed record (file, record, key); a template that
            refuses a record (file and record named); nothing left to write. Nothing is written on error.
    """
    from msllm.data.mindrecord import SIDECAR_FORMAT
    from msllm.data.preprocess import expand_input_glob
    from msllm.data.templates import DEFAULT_TEMPLATE, resolve_template
    from msllm.data.tokenizer import load_tokenizer

    if seq_length < 2:
        raise MsllmError(f"--seq_length {seq_length}: expected an integer >= 2")
    tokenizer = load_tokenizer(model_file, pad_token_id)
    name = template or ("chat_template" if tokenizer.chat_template else DEFAULT_TEMPLATE)
    tmpl = resolve_template(name, tokenizer)
    pad = tokenizer.pad_id
    files = expand_input_glob(input_glob)
    rows, skipped, truncated, read = [], {}, 0, 0
    for path in files:
        for i, pair in enumerate(read_preference_file(path)):
            read += 1
            try:
                built, flag = build_pair(tokenizer, tmpl, pair, seq_length, pad)
            except MsllmError as exc:
                raise MsllmError(f"{path}: record {i}: {exc}") from None
            if built is None:
                skipped[flag] = skipped.get(flag, 0) + 1
                continue
            truncated += int(flag)
            rows.append(built)
    if not rows:
        raise MsllmError(f"--input_glob {input_glob!r}: no usable preference pair among {read} record(s) "
                         f"(skipped: {skipped})")
    if samples_num is not None:
        rows = rows[:samples_num]
    order = np.random.default_rng(seed).permutation(len(rows)) if shuffle else np.arange(len(rows))
    summary = {"records_read": read, "pairs_written": len(rows), "truncated": truncated,
               "skipped": dict(sorted(skipped.items())), "output_file": os.path.abspath(output_file),
               "template": tmpl.name if tmpl is not None else None}
    meta = {"format": SIDECAR_FORMAT, "seq_length": seq_length, "sample_length": seq_length + 1,
            "dataset_type": "dpo", "pad_token_id": pad, "ignore_index": IGNORE_INDEX,
            "tokenizer_md5": tokenizer.md5(), "tokenizer_file": os.path.abspath(tokenizer.model_file),
            "tokenizer_kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id, "num_samples": len(rows), "columns": {c: "int32" for c in PAIR_COLUMNS},
            "input_files": files, "repeat": 1, "shuffle": bool(shuffle), "seed": seed,
            "counts": {k: summary[k] for k in ("records_read", "pairs_written", "truncated", "skipped")},
            "template": summary["template"], "wikitext_files": None}
    write_preference_mindrecord(output_file, (rows[int(k)] for k in order), meta)
    return summary
