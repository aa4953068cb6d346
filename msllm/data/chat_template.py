"""A model's own Jinja chat template, rendered as transformers' ``apply_chat_template`` renders
it, as a prompt template beside the named ones of :mod:`msllm.data.templates`.

Rendering (transformers v5.24 ``utils/chat_template_utils.py``, ``_cached_compile_jinja_template``
and ``render_jinja_template``; ``tokenization_utils_base.py`` ``apply_chat_template``): jinja2's
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the ``loopcontrols``
extension and a ``{% generation %}`` block tag; filter ``tojson`` (``json.dumps`` with
``ensure_ascii=False``, no HTML escaping); globals ``raise_exception``, ``strftime_now``; the
template gets ``messages``, ``tools=None``, ``documents=None``, ``add_generation_prompt`` and the
tokenizer's special-token strings (``bos_token``, ``eos_token``, ...). Template text is untrusted
(it comes with a downloaded model): the sandbox refuses attribute access to Python internals.
The rendered text is then tokenised with special-token strings as single tokens
(``tokenize=True`` encodes with ``add_special_tokens=False``).

Roles: msllm's turns ``human`` / ``gpt`` / ``system`` are the messages' ``user`` / ``assistant``
/ ``system``.

Training labels (:meth:`ChatTemplate.segments`): the targets are exactly the assistant turns,
their content and the end-of-turn token that closes them (the first of the tokenizer's EOS strings
after the content, e.g. ChatML's ``<|im_end|>``); system and user turns, role headers and text
after the end-of-turn token (ChatML's newline) are not targets. Each assistant turn is found by
rendering the conversation up to it with the generation prompt, which must be a prefix of the whole
rendering (true of ChatML, Llama 3, Mistral, Gemma templates); a template that rewrites earlier
turns when later ones are added (e.g. Qwen3's, which drops earlier reasoning) is refused for
training with one error.

Recorded name: ``chat_template:<first 12 hex digits of the template's SHA-256>``
(:attr:`ChatTemplate.name`), in the MindRecord sidecar and checkpoint manifests.
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

from msllm.errors import MsllmError

NAME_PREFIX = "chat_template"
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}

# ChatML (OpenAI's chat markup as Qwen and SmolLM2 use it), without a default system prompt: the
# named template ``chatml`` for models whose tokenizer has the <|im_start|>/<|im_end|> tokens but no
# template of its own.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def template_digest(source: str) -> str:
    """First 12 hex digits of the SHA-256 of the template's UTF-8 text."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:12]


def _compile(source: str, where: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks assistant
        text with it for ``return_assistant_tokens_mask``; msllm finds turns by prefix instead)."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise MsllmError(f"chat template of {where}: not a valid Jinja template (line {exc.lineno}: {exc.message})") \
            from None


class TemplateRefused(MsllmError):
    """A chat template could not render a conversation: ``what`` happened (the template's own words).
    The message names the template and its file; ``reason`` says the same without them (a server
    answers its clients with that part alone)."""

    def __init__(self, template: "ChatTemplate", what: str):
        super().__init__(f"chat template {template.name} of {template.where} {what}")
        self.reason = f"the chat template {what}"


class ChatTemplate:
    """A Jinja chat template bound to a tokenizer's special-token strings.

    Args:
        source: the Jinja text (``tokenizer.chat_template``).
        tokenizer: gives ``token_strings`` (passed to the template) and ``eos_ids`` (the
            end-of-turn tokens closing an assistant turn) and ``model_file`` (named in errors).
        name: recorded name; default ``chat_template:<digest>``.

    Raises:
        MsllmError: the template does not parse (at construction); a conversation the template
            rejects (``raise_exception``) or fails on, naming the template and the error (at use).
    """

    bos_once_per_sample = True

    def __init__(self, source: str, tokenizer, name: str | None = None):
        self.source = source
        self.where = getattr(tokenizer, "model_file", "the tokenizer")
        self.name = name or f"{NAME_PREFIX}:{template_digest(source)}"
        self.description = f"the model's Jinja chat template ({self.name})"
        self._tmpl = _compile(source, self.where)
        self._tokens = dict(getattr(tokenizer, "token_strings", {}))
        decode = getattr(tokenizer, "id_to_token", None)
        eos = [self._tokens.get("eos_token")]
        if decode is not None:
            eos += [decode(i) for i in getattr(tokenizer, "eos_ids", ())]
        self._end_of_turn = tuple(dict.fromkeys(t for t in eos if t))

    @property
    def stop_strings(self) -> list[str]:
        """None: generation stops at the tokenizer's end-of-turn ids (EOS ids), not at text."""
        return []

    def render(self, turns: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
        """The template's text for ``turns`` (``(role, text)``, roles ``system``/``human``/``gpt``)."""
        import jinja2

        messages = []
        for i, (role, text) in enumerate(turns):
            if role not in ROLES:
                raise MsllmError(f"turn {i} has role {role!r}: expected one of {', '.join(ROLES)}")
            messages.append({"role": ROLES[role], "content": text})
        try:
            return self._tmpl.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateRefused(self, f"refused the conversation: {exc}") from None
        except Exception as exc:  # a template bug (e.g. indexing an empty list) on this conversation
            raise TemplateRefused(self, f"failed to render the conversation: {type(exc).__name__}: {exc}") from None

    def prompt(self, turns: Sequence[tuple[str, str]]) -> str:
        """The text to generate the next assistant turn from (``add_generation_prompt=True``)."""
        return self.render(turns, add_generation_prompt=True)

    def segments(self, turns: Sequence[tuple[str, str]]) -> list[tuple[str, bool]]:
        """The training text of a conversation as ``(text, is_target)`` pieces (module doc):
        the assistant turns' content and end-of-turn token are targets.

        Raises MsllmError: the template rejects the conversation, or is not prefix-stable."""
        full = self.render(turns, add_generation_prompt=False)
        out: list[tuple[str, bool]] = []
        pos = 0
        for i, (role, text) in enumerate(turns):
            if role != "gpt":
                continue
            head = self.render(turns[:i], add_generation_prompt=True)
            upto = self.render(turns[:i + 1], add_generation_prompt=False)
            if not (full.startswith(head) and full.startswith(upto) and len(head) >= pos):
                raise MsllmError(
                    f"chat template {self.name} of {self.where} renders earlier turns differently once later turns "
                    f"are added (turn {i}): the assistant turns cannot be located for training labels; use a "
                    "template without that behaviour (--template NAME)")
            start = len(head)
            found = upto.find(text, start) if text else start
            end = (found + len(text)) if found >= 0 else len(upto)
            for eot in self._end_of_turn:
                if upto.startswith(eot, end):
                    end += len(eot)
                    break
            out += [(full[pos:start], False), (full[start:end], True)]
            pos = end
        out.append((full[pos:], False))
        return [(t, target) for t, target in out if t]

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"
