"""Multi-turn chat over a loaded model: the session behind ``tools/chat.py``.

Each turn formats the whole conversation with the prompt template (:func:`encode_turns`), so the
model sees the format it was trained on, and generates one answer, streaming its text as tokens
arrive. History is kept within the context window: when the conversation plus the new tokens
(``max_new_tokens``) would not fit, the oldest turn pairs are dropped (the session reports how
many). A reply ends at EOS, at a template stop string (never printed: text that could be the
start of a stop string is held back until it cannot), or after ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from msllm.data.conversation import GPT, HUMAN
from msllm.errors import MsllmError
from msllm.generation.passes import pow2_at_least, round_up

CHAT_MIN_BUFFER = 512   # cache slots of a chat turn: at least this, else the next power of two
from msllm.generation.prompts import encode_turns, stop_strings
from msllm.generation.stepping import StopText


@dataclass
class Reply:
    """One answer: text, finish reason (``eos`` / ``length`` / ``stop``), turn pairs dropped from
    the history before it, prompt and new token counts, seconds to first token and in total."""

    text: str
    finish_reason: str
    dropped: int
    prompt_tokens: int
    new_tokens: int
    first_token_s: float
    seconds: float


class ChatSession:
    """A conversation with one model.

    Args:
        gen: :class:`~msllm.generation.decode.Generator` of the model.
        tokenizer: :class:`~msllm.data.tokenizer.LlamaTokenizer`.
        template: prompt template (``msllm.data.templates``) or None for plain text.
        settings: resolved :class:`~msllm.config_generation.DecodeSettings` (beam search is not
            streamed: ``num_beams`` must be 1).
    """

    def __init__(self, gen, tokenizer, template, settings):
        if settings.num_beams > 1:
            raise MsllmError("chat streams one answer at a time: use num_beams: 1 (greedy or sampling)")
        if settings.max_new_tokens is None:
            raise MsllmError("chat needs generation_config.max_new_tokens (a total max_length grows with the history)")
        self.gen, self.tokenizer, self.template, self.settings = gen, tokenizer, template, settings
        self.context = gen.context
        self.stops = stop_strings(template)
        self.history: list[tuple[str, str]] = []   # completed (user, answer) pairs

    def reset(self) -> None:
        self.history = []

    def prompt_ids(self, user: str) -> tuple[list[int], int]:
        """(token ids of history + ``user``, oldest pairs dropped to fit the window).
        Raises MsllmError if ``user`` alone does not fit."""
        budget = self.context - self.settings.max_new_tokens
        dropped = 0
        while True:
            turns = [t for pair in self.history[dropped:] for t in ((HUMAN, pair[0]), (GPT, pair[1]))]
            ids = encode_turns(self.tokenizer, self.template, turns + [(HUMAN, user)])
            if len(ids) <= budget or dropped == len(self.history):
                break
            dropped += 1
        if len(ids) >= self.context:
            raise MsllmError(f"the message is {len(ids)} tokens long; the model's context window is "
                             f"{self.context} tokens: send a shorter one")
        return ids, dropped

    def reply(self, user: str, on_text: Optional[Callable[[str], None]] = None) -> Reply:
        """Answer ``user`` (streaming text pieces to ``on_text``), then add the pair to history."""
        import time

        ids, dropped = self.prompt_ids(user)
        if dropped:
            self.history = self.history[dropped:]
        answer = StopText(self.tokenizer, self.settings.eos_token_id, self.stops)
        t0 = time.perf_counter()
        first = [None]

        def on_step(_k, tokens, _finished):
            if first[0] is None:
                first[0] = time.perf_counter() - t0
            piece, stopped = answer.push(int(tokens[0]))
            if on_text is not None and piece:
                on_text(piece)
            return stopped

        # the cache: prompt + new tokens in power-of-two buckets of slots (few decode graphs as the
        # history grows), never the whole context window (131,072 positions for Llama 3.1)
        buffer = min(pow2_at_least(len(ids) + self.settings.max_new_tokens, CHAT_MIN_BUFFER), round_up(self.context))
        out = self.gen.generate([ids], self.settings, stream=on_step, buffer=buffer)
        rest = answer.finish()
        if on_text is not None and rest:
            on_text(rest)
        text = answer.text
        self.history.append((user, text))
        return Reply(text, out.finish_reasons[0], dropped, len(ids), len(out.tokens[0]), first[0] or 0.0,
                     time.perf_counter() - t0)


def load_session(cfg, template: Optional[str] = None, adapter: Optional[str] = None,
                 tokenizer: Optional[str] = None):
    """What a conversation front needs (``tools/chat.py``, ``tools/serve.py``): set up MindSpore
    (one process, a layout predict can run), load the model of ``cfg.load_checkpoint`` and its
    tokenizer; returns ``(net, model_config, info, tokenizer, template, settings)`` with
    ``template`` the one to prompt with (``template`` overrides the checkpoint's, else the
    tokenizer's chat template, else None) and ``settings`` the resolved decoding settings (every
    end-of-turn id). ``info``: :class:`~msllm.generation.loading.InferenceInfo`.

    Raises MsllmError like :func:`msllm.generation.predict.run_predict`."""
    from msllm.cluster.context import setup_runtime
    from msllm.config_generation import resolve_settings
    from msllm.generation.loading import load_for_inference, open_tokenizer
    from msllm.generation.predict import eos_settings, predict_config
    from msllm.generation.prompts import check_template, template_for
    from msllm.settings import log_settings

    log_settings(cfg, "predict")  # refuses a layout a single-process front cannot run
    cfg = predict_config(cfg, 1)
    setup_runtime(cfg, inference=True)
    check_template(template)  # an unknown name fails before the model is loaded
    net, mc, info = load_for_inference(cfg, adapter=adapter)
    tok = open_tokenizer(info, mc, tokenizer)
    tmpl = template_for(template or info.template, tok)
    settings = resolve_settings(eos_settings(cfg.generation_config, tok, mc), mc, cfg.seed, 1)
    info.template = tmpl.name if tmpl is not None else None
    return net, mc, info, tok, tmpl, settings


def open_chat(cfg, template: Optional[str] = None, adapter: Optional[str] = None,
              tokenizer: Optional[str] = None) -> tuple[ChatSession, object]:
    """Set up MindSpore (one process), load the model of ``cfg.load_checkpoint`` and return
    ``(session, info)`` (:class:`~msllm.generation.loading.InferenceInfo`). ``template``
    overrides the checkpoint's; ``tokenizer`` the one found with the weights.

    Raises MsllmError like :func:`msllm.generation.predict.run_predict`."""
    import logging

    from msllm.generation.decode import generator_for

    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    net, mc, info, tok, tmpl, settings = load_session(cfg, template, adapter, tokenizer)
    return ChatSession(generator_for(net, mc), tok, tmpl, settings), info
