"""The evaluation commands: ``run_msllm.py --run_mode eval`` (:func:`run_eval`) and
``tools/evaluate.py`` (:func:`evaluate`).

``run_eval`` without a task: perplexity of ``load_checkpoint`` over the ``eval_dataset``
MindRecord (MindFormers' ``run_mode: eval`` with ``PerplexityMetric``; token-weighted here, see
:mod:`msllm.eval.perplexity`). With a task (``tools/evaluate.py --task ...``): one of
:data:`TASKS`. Under ``scripts/run_distribute.sh ... eval N`` every rank scores its share of the
requests and all ranks end with the same complete results (:mod:`msllm.eval.dist`); rank 0
prints and writes them.

Output: one summary line per task, a per-subject table for MMLU / C-Eval, and
``output_dir/eval/results_{task}_{time}.json`` with every request's scores.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from msllm.errors import MsllmError
from msllm.eval import results as res
from msllm.eval.requests import bos_rule
from msllm.eval.tasks import boolq, ceval, gsm8k, mc_jsonl, mmlu, ppl

log = logging.getLogger("msllm")

TASKS = {"mmlu": mmlu.load, "ceval": ceval.load, "boolq": boolq.load, "gsm8k": gsm8k.load,
         "mc": mc_jsonl.load, "ppl": ppl.load}


def _setup(cfg):
    """Join the process group (data parallel = the processes started) and set the context."""
    from msllm.cluster.context import env_world_size, setup_logging, setup_runtime
    from msllm.settings import check_settings, log_notes

    notes = check_settings(cfg, "eval")  # names model_parallel / pipeline_stage before they are replaced
    pc = cfg.parallel_config
    pc.model_parallel, pc.pipeline_stage = 1, 1
    pc.data_parallel = env_world_size()  # evaluation splits requests over whatever ranks were started
    rt = setup_runtime(cfg, inference=True)
    setup_logging(rt.rank)
    log_notes(notes)
    return rt.rank, rt.world_size


def _load(cfg, adapter, tokenizer, rank):
    from msllm.generation.loading import load_for_inference, open_tokenizer

    net, mc, info = load_for_inference(cfg, adapter=adapter, rank=rank)
    return net, mc, open_tokenizer(info, mc, tokenizer, pad_id=0), info.path



def _progress(total: int, rank: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, disable=rank != 0, mininterval=1.0)
    return bar, bar.update


def context_length(checkpoint: Optional[str], mc, max_length: Optional[int] = None) -> tuple[int, str]:
    """(the context in tokens a request is truncated to, where it came from).

    ``max_length`` when given (lm-eval's ``--max_length``). For a Hugging Face directory,
    lm-evaluation-harness's ``HFLM`` rule (``lm_eval/models/utils.py`` ``resolve_max_length``,
    v0.4.13): config.json's ``n_positions``, ``max_position_embeddings`` or ``n_ctx`` (first found,
    a nested ``text_config`` first), else tokenizer_config.json's ``model_max_length`` unless it is
    transformers' "unset" value, else 2048; so scores equal the harness's on the same directory.
    Otherwise (an msllm or MindFormers checkpoint, trained at ``seq_length``): ``seq_length``.

    Raises:
        MsllmError: a context longer than the model's positions, or below 2.
    """
    from msllm.convert.starting import is_hf_dir

    origin = "--max_length"
    if max_length is None and checkpoint and is_hf_dir(checkpoint):
        max_length, origin = _hf_max_length(checkpoint)
    elif max_length is None:
        max_length, origin = mc.seq_length, "the model's seq_length"
    if not 2 <= max_length <= mc.max_positions:
        raise MsllmError(f"max_length {max_length} ({origin}): expected 2..{mc.max_positions}, the model's positions")
    return int(max_length), origin


def _hf_max_length(directory: str) -> tuple[int, str]:
    import json

    def read(name):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)

    config = read("config.json")
    for section, where in ((config.get("text_config") or {}, "config.json text_config"), (config, "config.json")):
        for key in ("n_positions", "max_position_embeddings", "n_ctx"):
            if isinstance(section.get(key), int):
                return section[key], f"{where} {key}, as lm-eval's HFLM"
    limit = read("tokenizer_config.json").get("model_max_length")
    if isinstance(limit, int) and limit < 1e29:       # transformers' VERY_LARGE_INTEGER = "unset"
        return limit, "tokenizer_config.json model_max_length, as lm-eval's HFLM"
    return 2048, "lm-eval's HFLM default"


def evaluate(cfg, task: str, data: str, num_fewshot: Optional[int] = None, limit: Optional[int] = None,
             batch_size: Optional[int] = 8, stride: Optional[int] = None, tokenizer: Optional[str] = None,
             adapter: Optional[str] = None, max_gen_toks: Optional[int] = 256, model=None,
             reuse_prefix: bool = False, max_length: Optional[int] = None, dense_head: bool = False) -> dict:
    """Run one task and report it; returns the results payload (also written on rank 0).

    Args:
        cfg: the run config (``load_checkpoint``, model shape, ``output_dir``, context).
        task: a key of :data:`TASKS`; data: its data directory or file.
        num_fewshot: None = the harness's default for the task (gsm8k 5, others 0).
        limit: first N questions (per subject for MMLU / C-Eval), as the harness's ``--limit``.
        stride: ppl window stride (default seq_length // 2).
        model: ``(net, model_config, tokenizer, rank, world_size)`` to use instead of loading
            (tests); the MindSpore context must then be set already.
        reuse_prefix: score questions that share a few-shot prefix through the key/value cache
            (:mod:`msllm.eval.scoring`); off by default: on CPU each cached-path graph holds
            gigabytes (1.4-2.3 GB per compiled shape measured at hidden 256) and the plain path,
            with the head only at scored positions, was as fast on the benchmark.
        max_length: the context in tokens (lm-eval's ``--max_length``); None:
            :func:`context_length`'s rule.
        dense_head: multiple-choice scoring runs the output head at every position, as lm-eval's
            ``HFLM`` (same numbers, more work: for like-for-like benchmarks; :mod:`msllm.eval.scoring`).

    Raises:
        MsllmError: unknown task, bad data (file:line), nothing to load.
    """
    if task not in TASKS:
        raise MsllmError(f"--task {task!r}: expected one of {', '.join(TASKS)}")
    if not data:
        raise MsllmError(f"--task {task} needs --data_dir (the benchmark's files, see docs/evaluation.md)")
    batch_size, max_gen_toks = batch_size or 8, max_gen_toks or 256
    spec = TASKS[task](data, num_fewshot, limit)
    if model is None:
        rank, world = _setup(cfg)
        net, mc, tok, source = _load(cfg, adapter, tokenizer, rank)
    else:
        net, mc, tok, rank, world = model
        source = cfg.load_checkpoint
    max_length, origin = context_length(cfg.load_checkpoint, mc, max_length)
    if rank == 0:
        print(f"eval: {task}, context max_length {max_length} tokens ({origin})", flush=True)
    payload = {"task": task, "data": os.path.abspath(data), "checkpoint": source, "num_fewshot": spec.num_fewshot,
               "limit": limit, "max_length": max_length, "world_size": world, "add_bos_token": bos_rule(tok)[0] is not None,
               "files": spec.files, "dense_head": bool(dense_head)}
    if spec.kind == "mc":
        payload.update(_run_mc(spec, net, tok, max_length, batch_size, rank, world, 32 if reuse_prefix else 0,
                               dense_head))
    elif spec.kind == "gen":
        payload.update(_run_gen(spec, net, tok, max_length, batch_size, max_gen_toks, rank, world))
    else:
        payload.update(_run_ppl(spec, net, tok, max_length, batch_size, stride or max(1, max_length // 2),
                                rank, world))
    if rank == 0:
        _report(task, spec, payload)
        payload["results_file"] = res.write_results(res.results_path(cfg.output_dir, task), payload)
        print(f"results: {payload['results_file']}", flush=True)
    return payload


def _run_mc(spec, net, tok, max_length, batch_size, rank, world, min_prefix, dense_head=False) -> dict:
    from msllm.eval.requests import build_rows, encode_pair
    from msllm.eval.scoring import score_rows, scorer_for

    pairs = [(d, c, doc.context, cont) for d, doc in enumerate(spec.docs) for c, cont in enumerate(doc.continuations)]
    bos, prefix = bos_rule(tok)
    encoded = [encode_pair(tok.encode, bos, ctx, cont, prefix) for _, _, ctx, cont in pairs]
    rows = build_rows(encoded, max_length)
    bar, update = _progress(len(encoded), rank, spec.name)
    scores = score_rows(scorer_for(net, batch_size, tok.pad_id, min_prefix, dense_head=dense_head), rows, rank,
                        world, update)
    bar.close()
    records = res.mc_records(spec, scores, [(d, c) for d, c, _, _ in pairs])
    out = {"results": res.aggregate(records, spec.metrics), "docs": records}
    if spec.per_subject:
        out["subjects"] = res.by_subject(records, spec.metrics)
    return out


def _run_gen(spec, net, tok, max_length, batch_size, max_gen_toks, rank, world) -> dict:
    from msllm.eval.generate import decode_and_cut, generate_until

    until = list(spec.until) + ([tok.decode([tok.eos_id])] if tok.decode([tok.eos_id]) else ["</s>"])
    bar, update = _progress(len(spec.docs), rank, spec.name)
    tokens = generate_until(net, tok, [d.context for d in spec.docs], until, max_length, max_gen_toks,
                            batch_size, rank, world, update)
    bar.close()
    records = []
    for i, (doc, toks) in enumerate(zip(spec.docs, tokens)):
        text = decode_and_cut(tok, toks, until)
        records.append({"doc": i, "where": doc.where, "generation": text, "tokens": toks,
                        **gsm8k.score(text, doc.target)})
    return {"results": res.aggregate(records, spec.metrics), "docs": records}


def _run_ppl(spec, net, tok, max_length, batch_size, stride, rank, world) -> dict:
    from msllm.eval.perplexity import summarise, text_rows
    from msllm.eval.scoring import score_rows, scorer_for

    bos, prefix = bos_rule(tok)   # the first token is scored given the prefix (lm-eval's rolling windows)
    documents = [[prefix] + ([bos] if bos is not None and bos != prefix else []) + tok.encode(d.text)
                 for d in spec.docs]
    rows, owner = text_rows(documents, max_length, stride)
    bar, update = _progress(len(rows), rank, "ppl")
    scores = score_rows(scorer_for(net, batch_size, tok.pad_id, 0), rows, rank, world,
                        update)
    bar.close()
    docs = []
    for d, doc in enumerate(spec.docs):
        s = summarise(scores, [k for k, o in enumerate(owner) if o == d])
        docs.append({"doc": d, "where": doc.where, **s})
    return {"results": summarise(scores), "stride": stride, "docs": docs}


def _report(task, spec, payload) -> None:
    r = payload["results"]
    if task == "eval_loss" or spec.kind == "ppl":
        print(f"{task}: tokens {r['tokens']}, loss (mean nll) {r['mean_nll']:.6f}, perplexity {r['ppl']:.4f}"
              + (f", stride {payload['stride']}" if "stride" in payload else ""), flush=True)
        return
    if payload.get("subjects"):
        print(res.table(payload["subjects"], spec.metrics), flush=True)
    print(res.summary_line(task, r, spec.metrics, f"{spec.num_fewshot}-shot"), flush=True)


def run_eval(cfg, template: Optional[str] = None, adapter: Optional[str] = None, task: Optional[str] = None,
             data: Optional[str] = None, **task_args) -> dict:
    """``run_mode: eval``. With ``task``: :func:`evaluate` (``task_args``: its keyword arguments;
    batch size default ``eval_dataset.batch_size`` or ``runner_config.batch_size``). Without: perplexity over the
    ``eval_dataset`` MindRecord (``eval_dataset.dataset_dir``, batches of ``eval_dataset.batch_size``
    or ``runner_config.batch_size``); prints tokens, loss and perplexity and writes the results
    JSON (every sample's NLL sum and token count)."""
    if template:
        log.warning("--template %s has no effect on evaluation: benchmarks score raw prompts, as "
                    "lm-evaluation-harness does without a chat template", template)
    if task:
        if not task_args.get("batch_size"):
            task_args["batch_size"] = cfg.eval_dataset.batch_size or cfg.runner_config.batch_size
        return evaluate(cfg, task, data, adapter=adapter, **task_args)
    from msllm.eval.perplexity import read_eval_records, record_rows, summarise
    from msllm.eval.scoring import score_rows, scorer_for

    rank, world = _setup(cfg)
    net, mc, tok, source = _load(cfg, adapter, task_args.get("tokenizer"), rank)
    ids, labels = read_eval_records(cfg.eval_dataset.dataset_dir, mc.seq_length, cfg.eval_dataset.input_columns,
                                    mc.pad_token_id)
    rows = record_rows(ids, labels, mc.ignore_token_id)
    if not rows:
        raise MsllmError(f"{cfg.eval_dataset.dataset_dir}: no label tokens to evaluate")
    batch = cfg.eval_dataset.batch_size or cfg.runner_config.batch_size
    bar, update = _progress(len(rows), rank, "eval")
    scores = score_rows(scorer_for(net, batch, mc.pad_token_id, 0), rows, rank, world,
                        update)
    bar.close()
    samples = [{"sample": int(k), "nll_sum": -float(v[0]), "tokens": int(v[2])} for k, v in sorted(scores.items())]
    payload = {"task": "eval_loss", "data": os.path.abspath(cfg.eval_dataset.dataset_dir), "checkpoint": source,
               "samples_total": int(ids.shape[0]), "world_size": world, "results": summarise(scores),
               "docs": samples}
    if rank == 0:
        _report("eval_loss", None, payload)
        payload["results_file"] = res.write_results(res.results_path(cfg.output_dir, "eval_loss"), payload)
        print(f"results: {payload['results_file']}", flush=True)
    return payload
