#!/usr/bin/env python
"""Chat with a LLaMA checkpoint in the terminal, streaming the answer as it is generated.

    python tools/chat.py --config CONFIG --load_checkpoint CKPT [--template NAME] [--adapter LORA]
        [--tokenizer tokenizer.model] [--prompt "..."] [--section.key=value ...]

CKPT: an msllm or MindFormers checkpoint (file or run directory) or a Hugging Face model
directory. Turns are formatted with the prompt template the model was trained with (recorded in
the checkpoint manifest; ``--template`` overrides; none recorded: plain text). History is kept
within the context window (the oldest turns are dropped, with a notice). Commands: ``/reset``
(forget the history), ``/exit`` (or Ctrl-D). ``--prompt`` answers one message and exits.
Decoding settings: the YAML's ``generation_config`` (and MindFormers' keys in
``model.model_config``), or overrides such as ``--generation_config.do_sample=True``.
Errors: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.errors import MsllmError, cli_main  # noqa: E402

HELP = "commands: /reset clears the history, /exit quits"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chat.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run YAML (model shape, generation_config)")
    p.add_argument("--load_checkpoint", help="checkpoint file/directory or HF model directory "
                                             "(default: the YAML's load_checkpoint)")
    p.add_argument("--template", help="prompt template: vicuna_v1.1, alpaca, none, chat_template (the model's Jinja template), chatml (default: the checkpoint's, else the tokenizer's chat template, else plain text)")
    p.add_argument("--adapter", help="LoRA adapter checkpoint to apply")
    p.add_argument("--tokenizer", help="a SentencePiece tokenizer.model, a tokenizer.json or an HF model directory (default: the checkpoint's; the bundled LLaMA tokenizer only for a 32000-id model)")
    p.add_argument("--prompt", help="answer this one message and exit (no interactive loop)")
    return p


def say(session, text: str) -> None:
    reply = session.reply(text, on_text=lambda piece: print(piece, end="", flush=True))
    print(flush=True)
    if reply.dropped:
        print(f"[history: dropped the {reply.dropped} oldest turn(s) to fit the {session.context}-token "
              "context window]", file=sys.stderr, flush=True)
    return reply


@cli_main
def main(argv=None) -> int:
    from msllm.cli_args import split_overrides
    from msllm.config import load_config
    from msllm.generation.chat import open_chat

    args, rest = build_parser().parse_known_args(argv)
    overrides = split_overrides(rest)
    if args.load_checkpoint:
        overrides.append(f"--load_checkpoint={args.load_checkpoint}")
    cfg = load_config(args.config, overrides)
    session, info = open_chat(cfg, args.template, args.adapter, args.tokenizer)
    if args.prompt is not None:
        if not args.prompt.strip():
            raise MsllmError("--prompt is empty")
        say(session, args.prompt)
        return 0
    print(f"chat with {info.path} (template: {info.template or 'plain text'}); {HELP}", file=sys.stderr, flush=True)
    while True:
        try:
            text = input("user> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        command = text.strip()
        if not command:
            continue
        if command == "/exit":
            return 0
        if command == "/reset":
            session.reset()
            print("[history cleared]", file=sys.stderr, flush=True)
            continue
        if command.startswith("/"):
            print(f"unknown command {command}; {HELP}", file=sys.stderr, flush=True)
            continue
        print("assistant> ", end="", flush=True)
        try:
            say(session, text)
        except MsllmError as exc:  # e.g. a message longer than the context window: keep chatting
            print(f"\nerror: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
