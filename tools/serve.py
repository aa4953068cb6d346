#!/usr/bin/env python
"""Serve a model over OpenAI's HTTP API (completions, chat completions, models), streaming or not.

    python tools/serve.py --config CONFIG --load_checkpoint CKPT_OR_HF_DIR [--adapter LORA]
        [--tokenizer PATH] [--template NAME] [--host 127.0.0.1] [--port 8000]
        [--api_key KEY | --api_key_file FILE | env MSLLM_API_KEY] [--model_name NAME] [--max_batch 8]
        [--batch_window_ms 20] [--max_queue 64] [--max_tokens_default N] [--max_body_bytes 4194304]
        [--max_prompts 64] [--max_echo_logprobs_tokens 2048] [--enable_prefix_caching] [--prefix_cache_mb 1024]
        [--prefill_chunk_size 512] [--no_warmup] [--warmup_slots 4096] [--section.key=value ...]

Requests decode in one continuous batch on the key/value cache (``--max_batch`` rows): waiting
requests join between two decode steps, a finished row is free at the next; when idle, the first
request waits ``--batch_window_ms`` after each arrival for another (at most 10 windows), so a burst
starts together. Each row has its own settings; a request's greedy output is the same alone and in
a batch. ``--max_queue`` choices (prompts x ``n`` of every request) wait at most, more are answered
429 (a single request asking for more gets a 400). It listens on 127.0.0.1 unless ``--host`` says
otherwise, and any other address needs ``--api_key`` (clients send ``Authorization: Bearer KEY``). SIGTERM (or
Ctrl-C) stops accepting connections, finishes the requests in flight, and exits 0.
The model name clients send is ``--model_name`` (default: the checkpoint's directory or file name).
Chat messages are rendered with ``--template`` (default: the checkpoint's, else the tokenizer's chat
template), as ``tools/chat.py`` renders them. Formats: ``msllm/serving/protocol.py``.

Request defaults: the run YAML's ``generation_config`` (``do_sample``, ``temperature``, ``top_p``,
``top_k``, ``max_new_tokens``) gives the values of fields a request leaves out, as vLLM does with a
model's generation config (``msllm/serving/defaults.py``: keys the server cannot honour are refused
by name, keys without effect named in one log line); ``--max_tokens_default`` (vLLM has no flag of
its own: it takes ``max_new_tokens`` from the generation config, ``--override-generation-config``)
wins over ``max_new_tokens``. Without either, ``max_tokens`` defaults to OpenAI's 16 on completions and
the rest of the context window on chat. Limits of one request (``msllm/serving/validate.py``):
``--max_body_bytes`` (413 beyond), ``--max_prompts`` (prompts x ``n``), ``--max_echo_logprobs_tokens``
(the prompt tokens ``echo`` with ``logprobs`` scores in one pass). The API key comes from
``--api_key``, else the first line of ``--api_key_file``, else the environment variable
``MSLLM_API_KEY`` (vLLM reads ``VLLM_API_KEY`` the same way).

Speed. ``--enable_prefix_caching`` (vLLM's flag; off by default here, as in vLLM before its V1
engine) keeps the keys and values of prompts' whole 32-token blocks, keyed by their token ids, up to
``--prefix_cache_mb`` MiB (least recently used evicted), and a prompt starting with a stored prefix
computes only the rest (``msllm/serving/prefix_cache.py``): greedy outputs are the same token for
token. ``--prefill_chunk_size`` (default 512, a multiple of 32; 0: off): a prompt longer than this is
prefilled in pieces of it between the batch's decode steps, so the rows decoding wait about one
piece per token rather than the whole prompt (``msllm/serving/joining.py``; vLLM's chunked prefill,
whose per-step token budget is ``--max-num-batched-tokens``). At start the engine compiles the
shapes requests meet (short prompts alone and in a burst, the decode step over caches up to
``--warmup_slots`` slots, the prefix cache's and the chunks' pieces; ``--no_warmup``: skip) and
logs them with the time taken.
Errors at start-up: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Optional  # noqa: E402

from msllm.errors import MsllmError, cli_main  # noqa: E402
from msllm.serving.validate import Limits  # noqa: E402

LOOPBACK = ("localhost",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run YAML (model shape, generation_config)")
    p.add_argument("--load_checkpoint", help="checkpoint file/directory or HF model directory")
    p.add_argument("--adapter", help="LoRA adapter checkpoint to apply")
    p.add_argument("--tokenizer", help="tokenizer.model, tokenizer.json or HF directory (default: the checkpoint's)")
    p.add_argument("--template", help="chat template for /v1/chat/completions (default: the checkpoint's, else "
                                      "the tokenizer's chat template)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api_key", help="require 'Authorization: Bearer KEY' (required off loopback)")
    p.add_argument("--model_name", help="the model id clients send (default: the checkpoint's name)")
    p.add_argument("--max_batch", type=int, default=8, help="rows decoded together")
    p.add_argument("--batch_window_ms", type=float, default=20.0, help="when idle, how long a batch being gathered waits for one more request (at most 10 windows in all)")
    p.add_argument("--max_queue", type=int, default=64, help="choices (prompts x n) waiting at most (then 429)")
    p.add_argument("--api_key_file", help="file whose first line is the API key")
    p.add_argument("--max_tokens_default", type=int,
                   help="max_tokens of requests that leave it out (default: generation_config.max_new_tokens, "
                        "else 16 on completions and the rest of the context on chat); always within the context")
    p.add_argument("--max_body_bytes", type=int, default=Limits.max_body_bytes, help="request body size (then 413)")
    p.add_argument("--max_prompts", type=int, default=Limits.max_prompts,
                   help="choices one request may ask for (prompts x n)")
    p.add_argument("--max_echo_logprobs_tokens", type=int, default=Limits.max_echo_logprobs_tokens,
                   help="prompt tokens that 'echo' with 'logprobs' may score (one pass that pauses every other "
                        "request)")
    p.add_argument("--enable_prefix_caching", action="store_true",
                   help="reuse the keys and values of prompt prefixes already computed (default: off)")
    p.add_argument("--prefix_cache_mb", type=int, default=1024,
                   help="the prefix cache's size in MiB (least recently used blocks evicted)")
    p.add_argument("--prefill_chunk_size", type=int, default=512,
                   help="prompts longer than this many tokens are prefilled in pieces of it between decode steps "
                        "(a multiple of 32; 0: every prompt whole)")
    p.add_argument("--no_warmup", action="store_true", help="skip compiling the first requests' shapes at start")
    p.add_argument("--warmup_slots", type=int, default=4096,
                   help="warm up the decode step and prefill chunks over caches up to this many slots (a power "
                        "of two >= 512)")
    return p


def api_key(args) -> Optional[str]:
    """--api_key, else the first line of --api_key_file, else $MSLLM_API_KEY, else None."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise MsllmError(f"--api_key_file {args.api_key_file}: cannot read it ({exc.strerror})") from None
        if not key:
            raise MsllmError(f"--api_key_file {args.api_key_file}: its first line is empty")
        return key
    return os.environ.get("MSLLM_API_KEY") or None


def is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_engine(cfg, args):
    """Load model and tokenizer as ``tools/chat.py`` does; returns (engine, tokenizer, template, context, info)."""
    from msllm.generation.chat import load_session
    from msllm.serving.engine import Engine

    net, mc, info, tok, template, s = load_session(cfg, args.template, args.adapter, args.tokenizer)
    engine = Engine(net, mc, tok, s.eos_token_id, s.pad_token_id, args.max_batch, args.batch_window_ms / 1000.0,
                    args.max_queue, prefix_cache_bytes=args.prefix_cache_mb << 20 if args.enable_prefix_caching else 0,
                    prefill_chunk_size=args.prefill_chunk_size)
    return engine, tok, template, mc.max_positions, info


@cli_main
def main(argv=None) -> int:
    from msllm.cli_args import split_overrides
    from msllm.config import load_config

    args, rest = build_parser().parse_known_args(argv)
    args.api_key = api_key(args)
    if not is_loopback(args.host) and not args.api_key:
        raise MsllmError(f"--host {args.host} is not a loopback address: pass --api_key KEY (or --api_key_file, "
                         "or MSLLM_API_KEY) so that only clients with the key are served")
    for key in ("max_batch", "max_queue", "max_body_bytes", "max_prompts", "prefix_cache_mb",
                "max_echo_logprobs_tokens"):
        if getattr(args, key) < 1:
            raise MsllmError(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.prefill_chunk_size < 0 or args.prefill_chunk_size % 32:
        raise MsllmError(f"--prefill_chunk_size must be 0 (off) or a positive multiple of 32, got "
                         f"{args.prefill_chunk_size}")
    if args.warmup_slots < 512 or args.warmup_slots & (args.warmup_slots - 1):
        raise MsllmError(f"--warmup_slots must be a power of two >= 512, got {args.warmup_slots}")
    overrides = split_overrides(rest)
    if args.load_checkpoint:
        overrides.append(f"--load_checkpoint={args.load_checkpoint}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    cfg = load_config(args.config, overrides)
    from msllm.serving.defaults import request_defaults

    defaults, notes = request_defaults(cfg.generation_config, args.max_tokens_default)   # refusals before loading
    engine, tok, template, context, info = open_engine(cfg, args)
    name = args.model_name or os.path.basename(os.path.normpath(info.path))

    import uvicorn

    from msllm.serving.app import build_app

    say = logging.getLogger("msllm").info
    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts,
                    max_echo_logprobs_tokens=args.max_echo_logprobs_tokens)
    app = build_app(engine, name, tok, template, context, args.api_key, limits, defaults)
    say("serve: request defaults %s (from generation_config%s)%s", defaults,
        " and --max_tokens_default" if args.max_tokens_default else "", "; " + "; ".join(notes) if notes else "")
    say("serve: prefix caching %s; prefill chunk %s", f"on ({args.prefix_cache_mb} MiB)"
        if args.enable_prefix_caching else "off", f"{args.prefill_chunk_size} tokens" if args.prefill_chunk_size
        else "off (every prompt whole)")
    if not args.no_warmup:
        import time

        t0 = time.perf_counter()
        shapes = engine.warmup(args.warmup_slots)
        say("serve: warmed up %d graph shapes in %.1f s (kind, rows, tokens, slots: first-call seconds): %s",
            len(shapes), time.perf_counter() - t0, ", ".join(f"{k} {t:.1f} s" for k, t in shapes) or "none new")
    engine.start()
    logging.getLogger("msllm").info(
        "serving %s as %r on http://%s:%d/v1 (continuous batch of up to %d rows, window %.0f ms, queue %d, "
        "chat template %s%s)",
        info.path, name, args.host, args.port, args.max_batch, args.batch_window_ms, args.max_queue,
        getattr(template, "name", None) or "none", ", API key required" if args.api_key else "")
    # uvicorn's SIGTERM / SIGINT handling: stop accepting, wait for the requests in flight (no
    # graceful-shutdown timeout), then return; the engine then finishes anything still queued.
    # uvicorn re-raises the signal to the handler it found once it has shut down
    # (uvicorn/server.py capture_signals): a handler that ignores it lets the drain end in exit 0
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=None)
    engine.stop()
    logging.getLogger("msllm").info("serve: stopped after %d batches", engine.batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
