"""``run_mode: predict``: ``run_msllm.py --run_mode predict --predict_data ...`` and
``run_distribute.sh ... predict N``.

A single prompt prints its continuation on stdout. A prompts file (:mod:`msllm.generation.prompts`)
is split across the data-parallel ranks (record i goes to rank ``i % world``), each rank decodes
its share in batches of ``generation_config.batch_size``, and rank 0 gathers every result
(an all-gather of the JSON bytes, so no shared file system is needed) and writes, atomically,
``output_dir/predict/predictions.jsonl``: one line per input, in input order::

    {"index": 0, "prompt": ..., "output": ..., "output_ids": [...], "finish_reason": "eos" | "length" | "stop",
     "prompt_tokens": 17, "new_tokens": 41, "tokens_per_s": 85.2, "reference": ... (if the record had one)}

``tokens_per_s`` is the row's new tokens over the wall time of its batch (prefill + decode).
Every rank pads its batches to the same prompt length (the longest prompt of the whole file) and
fills its last batch with copies to the full batch size, so each rank compiles one prefill and one
decode graph, and a row's tokens do not depend on which rank or batch decoded it: with greedy
decoding the merged file equals a one-rank run's.

Layouts: predict runs data parallel only. ``model_parallel`` / ``pipeline_stage`` > 1 are refused
(on CPU MindSpore cannot compile them; on Ascend msllm does not shard inference yet);
``parallel_config.data_parallel`` is taken from the number of launched processes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from typing import Optional

import numpy as np

from msllm.errors import MsllmError

log = logging.getLogger("msllm")

OUTPUT_NAME = "predictions.jsonl"


def predict_config(cfg, world: int):
    """``cfg`` for a data-parallel predict over ``world`` processes; settings that only concern
    training and would stop the runtime set-up are neutralised with a log line each."""
    changes = {}
    pc = cfg.parallel_config
    if pc.data_parallel != world:
        changes["parallel_config.data_parallel"] = (pc.data_parallel, world)
        cfg = dataclasses.replace(cfg, parallel_config=dataclasses.replace(pc, data_parallel=world))
    if cfg.parallel.mode_name != "data_parallel":
        changes["parallel.parallel_mode"] = (cfg.parallel.parallel_mode, 0)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, parallel_mode=0))
    if cfg.runner_config.sink_mode:
        changes["runner_config.sink_mode"] = (True, False)
        cfg = dataclasses.replace(cfg, runner_config=dataclasses.replace(cfg.runner_config, sink_mode=False))
    for key, (old, new) in changes.items():
        log.info("predict: %s=%r has no effect (prompts are split across the %d launched process(es)); using %r",
                 key, old, world, new)
    return cfg


class Gather:
    """Rank 0 receives every rank's list of JSON-able results (every rank gets them: an exact
    all-gather of the JSON bytes of any size, :func:`msllm.cluster.gather.all_gather_json`)."""

    def __init__(self, world: int):
        self.world = world

    def __call__(self, items: list) -> list:
        from msllm.cluster.gather import all_gather_json

        return [item for part in all_gather_json(items, self.world) for item in part]


def eos_settings(gc, tokenizer, mc):
    """``gc`` with ``eos_token_id`` set to every end-of-turn id of the tokenizer and weights when
    the run sets none and those are more than the model config's one EOS id."""
    if gc.eos_token_id is None and tuple(tokenizer.eos_ids) != (mc.eos_token_id,):
        return dataclasses.replace(gc, eos_token_id=list(tokenizer.eos_ids))
    return gc


def encode_records(records, tokenizer, template, vocab_size: int) -> list[list[int]]:
    """Token ids per record; MsllmError if the tokenizer makes ids the model does not have."""
    from msllm.generation.prompts import encode_turns

    out = []
    for r in records:
        ids = encode_turns(tokenizer, template, r.turns)
        if ids and max(ids) >= vocab_size:
            raise MsllmError(f"tokenizer {tokenizer.model_file} gives id {max(ids)} for record {r.index}, but the "
                             f"model's vocab_size is {vocab_size}: use the model's own tokenizer (--tokenizer)")
        out.append(ids)
    return out


class StopWatch:
    """Stream callback that stops each row whose text holds one of ``stops``
    (:class:`~msllm.generation.stepping.StopText` per row)."""

    def __init__(self, tokenizer, stops, eos_ids, rows: int):
        from msllm.generation.stepping import StopText

        self.texts = [StopText(tokenizer, eos_ids, stops) for _ in range(rows)]

    def __call__(self, _step, tokens, finished):
        hit = np.zeros(len(self.texts), bool)
        for r, t in enumerate(tokens):
            if not finished[r]:
                hit[r] = self.texts[r].push(int(t))[1]
        return hit


def decode_records(gen, settings, records, ids, tokenizer, stops, batch_size: int, pad_to: int,
                   progress=None) -> list[dict]:
    """Generate for ``records`` (token ids ``ids``) in batches; one result dict per record."""
    from msllm.generation.stepping import decode_new
    from msllm.generation.prompts import cut_at_stop

    results = []
    for start in range(0, len(records), batch_size):
        chunk = list(range(start, min(start + batch_size, len(records))))
        batch = [ids[i] for i in chunk]
        batch += [batch[0]] * (batch_size - len(batch))          # same graph for the last batch
        stream = StopWatch(tokenizer, stops, settings.eos_token_id, len(batch)) if stops else None
        t0 = time.perf_counter()
        out = gen.generate(batch, settings, stream=stream, pad_to=pad_to)
        seconds = time.perf_counter() - t0
        for row, i in enumerate(chunk):
            toks = out.tokens[row]
            text, cut = cut_at_stop(decode_new(tokenizer, toks, settings.eos_token_id), stops)
            rec = records[i]
            item = {"index": rec.index, "prompt": rec.text, "output": text, "output_ids": toks,
                    "finish_reason": "stop" if cut else out.finish_reasons[row], "prompt_tokens": len(ids[i]),
                    "new_tokens": len(toks), "tokens_per_s": round(len(toks) / seconds, 2) if seconds > 0 else None}
            if out.scores is not None:
                item["score"] = out.scores[row]
            if rec.reference is not None:
                item["reference"] = rec.reference
            results.append(item)
        if progress is not None:
            progress.update(len(chunk))
    return results


def run_predict(cfg, predict_data: Optional[str], template: Optional[str] = None, adapter: Optional[str] = None,
                tokenizer: Optional[str] = None) -> Optional[str]:
    """Run predict per the module doc; returns the JSONL path written (rank 0, file input) or None.

    Args:
        cfg: :class:`~msllm.config.RunConfig` (``load_checkpoint``, ``generation_config``,
            ``model.model_config``, ``output_dir``, ``seed``).
        predict_data: a prompt, or a ``.txt`` / ``.json`` / ``.jsonl`` file.
        template: prompt template name (``--template``); default the checkpoint's, else the
            tokenizer's own chat template, else plain.
        adapter: LoRA adapter checkpoint (``--adapter``).
        tokenizer: a ``.model``, ``tokenizer.json`` or HF directory (default: the checkpoint's, else
            the bundled LLaMA one for a 32000-id model; :func:`~msllm.generation.loading.find_tokenizer`).

    Raises:
        MsllmError: no/empty/malformed prompts, an unknown template, a missing/mismatched
            checkpoint, bad settings, an unsupported layout. Nothing is written then.
    """
    from tqdm import tqdm

    from msllm.cluster.context import env_world_size, setup_logging, setup_runtime
    from msllm.config_generation import resolve_settings
    from msllm.generation.decode import generator_for, round_up
    from msllm.generation.loading import load_for_inference, open_tokenizer
    from msllm.generation.prompts import check_template, read_predict_data, stop_strings, template_for
    from msllm.settings import check_settings, log_notes

    notes = check_settings(cfg, "predict")  # refuses a layout predict cannot run
    setup_logging(int(os.environ.get("RANK_ID", "0") or 0))
    cfg = predict_config(cfg, env_world_size())
    rt = setup_runtime(cfg, inference=True)  # a CPU scheduler process never gets past this line
    setup_logging(rt.rank)
    log_notes(notes)
    records, from_file = read_predict_data(predict_data)
    check_template(template)           # an unknown name fails before the model is loaded
    net, mc, info = load_for_inference(cfg, adapter=adapter, rank=rt.rank)
    tok = open_tokenizer(info, mc, tokenizer)
    tmpl = template_for(template or info.template, tok)
    settings = resolve_settings(eos_settings(cfg.generation_config, tok, mc), mc, cfg.seed,
                                cfg.runner_config.batch_size)
    ids = encode_records(records, tok, tmpl, mc.vocab_size)
    log.info("predict: %d prompt(s), template %s, %s; %s", len(records), tmpl.name if tmpl else "none (plain)",
             "greedy" if not settings.do_sample and settings.num_beams == 1 else
             (f"beam search x{settings.num_beams}" if settings.num_beams > 1 else "sampling"),
             "KV cache (use_past)" if settings.use_past else "no KV cache (use_past: False)")
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    try:
        settings.new_tokens(len(ids[longest]), mc.max_positions)   # every prompt fits, before any work
    except MsllmError as exc:
        where = f"record {records[longest].index} of {predict_data}: " if from_file else ""
        raise MsllmError(where + str(exc)) from None
    gen = generator_for(net, mc)
    mine = [i for i in range(len(records)) if i % rt.world_size == rt.rank]
    batch_size = min(settings.batch_size, max(1, -(-len(records) // rt.world_size)))
    pad_to = round_up(len(ids[longest]))
    log.info("predict: this rank decodes %d of the %d prompt(s) (rank %d of %d), batches of %d padded to %d tokens",
             len(mine), len(records), rt.rank, rt.world_size, batch_size, pad_to)
    with tqdm(total=len(mine), desc=f"predict (rank {rt.rank})", unit="prompt", file=sys.stderr,
              disable=not from_file or not rt.is_main) as progress:
        results = decode_records(gen, settings, [records[i] for i in mine], [ids[i] for i in mine], tok,
                                 stop_strings(tmpl), batch_size, pad_to, progress)
    merged = sorted(Gather(rt.world_size)(results), key=lambda r: r["index"])
    if not rt.is_main:
        return None
    if not from_file:
        print(merged[0]["output"], flush=True)
        return None
    from msllm.fileio import atomic_open

    out = os.path.join(os.path.abspath(cfg.output_dir), "predict", OUTPUT_NAME)
    with atomic_open(out) as fh:
        for item in merged:
            fh.write(json.dumps(item, ensure_ascii=False) + "\n")
    new = sum(r["new_tokens"] for r in merged)
    log.info("predict: %d outputs (%d new tokens) written to %s", len(merged), new, out)
    print(f"predict: {len(merged)} outputs written to {out}", flush=True)
    return out
