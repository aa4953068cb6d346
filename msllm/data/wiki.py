"""Documents of ``--dataset_type wiki`` inputs: plain text, JSON(L) records, or WikiText.

* ``*.jsonl``: one JSON object per line with a string ``text`` (blank lines ignored),
* ``*.json``: a JSON list of objects with a string ``text``,
* WikiText (Merity et al. 2016; ``wiki.{train,valid,test}.{tokens,raw}``, or text with
  `` = Heading = `` lines and `` @-@ `` / `` @,@ `` / `` @.@ `` number markup): read as MindFormers'
  ``llama_preprocess.py tokenize_wiki`` reads it -- the whole file through :func:`clean_wikitext`,
  split into paragraphs at blank lines (``"\\n\\n"``), headings (paragraphs starting with ``=``)
  and empty paragraphs dropped (mindformers r1.0, commit 6a4076003f0c2461637b477199844cb92774e4d1,
  ``mindformers/tools/dataset_preprocess/llama/llama_preprocess.py``),
* anything else: UTF-8 text, one document per line (blank lines dropped).
"""

from __future__ import annotations

import os
import re

from msllm.data.conversation import json_lines, load_json_file
from msllm.errors import MsllmError

# clean_wikitext, as a table (MindFormers llama_preprocess.py r1.0, in this order): undoes
# WikiText's tokenisation spacing. ("sub" rows are regular expressions.)
_WIKITEXT_RULES: tuple[tuple[str, str, str], ...] = (
    ("str", "s '", "s'"),
    ("sub", r"/' [0-9]/", r"/'[0-9]/"),
    ("str", " @-@ ", "-"),
    ("str", " @,@ ", ","),
    ("str", " @.@ ", "."),
    ("str", " : ", ": "),
    ("str", " ; ", "; "),
    ("str", " . ", ". "),
    ("str", " ! ", "! "),
    ("str", " ? ", "? "),
    ("str", " , ", ", "),
    ("sub", r"\(\s*([^\)]*?)\s*\)", r"(\1)"),
    ("sub", r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
    ("sub", r"{\s*([^}]*?)\s*}", r"{\1}"),
    ("sub", r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
    ("sub", r"'\s*([^']*?)\s*'", r"'\1'"),
    ("str", "= = = =", "===="),
    ("str", "= = =", "==="),
    ("str", "= =", "=="),
    ("str", " " + chr(176) + " ", chr(176)),
    ("str", " \n", "\n"),
    ("str", "\n ", "\n"),
    ("str", " N ", " 1 "),
    ("str", " 's", "'s"),
)

_WIKITEXT_NAME = re.compile(r"^wiki\.(train|valid|test)\.(tokens|raw)$")
_WIKITEXT_HEADING = re.compile(r"^ = [^=\n].* = $", re.MULTILINE)
_WIKITEXT_MARKUP = (" @-@ ", " @,@ ", " @.@ ")


def clean_wikitext(text: str) -> str:
    """WikiText markup undone as MindFormers' ``clean_wikitext`` does (same rules, same order:
    :data:`_WIKITEXT_RULES`), e.g. ``"1 @,@ 000 km"`` -> ``"1,000 km"``, ``"( a )"`` -> ``"(a)"``."""
    for kind, old, new in _WIKITEXT_RULES:
        text = text.replace(old, new) if kind == "str" else re.sub(old, new, text)
    return text


def is_wikitext(path: str, text: str) -> bool:
    """``True`` for a WikiText file: its name is ``wiki.{train,valid,test}.{tokens,raw}``, or it
    has `` = Heading = `` lines and WikiText's `` @-@ ``/`` @,@ ``/`` @.@ `` markup."""
    if _WIKITEXT_NAME.match(os.path.basename(path)):
        return True
    return bool(_WIKITEXT_HEADING.search(text)) and any(m in text for m in _WIKITEXT_MARKUP)


def wikitext_paragraphs(text: str) -> list[str]:
    """Paragraphs of a WikiText file as MindFormers' ``tokenize_wiki`` takes them: cleaned, split
    at ``"\\n\\n"``, without empty paragraphs and headings (``para.strip().startswith("=")``)."""
    return [p for p in clean_wikitext(text).split("\n\n") if p and not p.strip().startswith("=")]


def _text_of(record: object, where: str) -> str:
    if not isinstance(record, dict):
        raise MsllmError(f"{where} is a JSON {type(record).__name__}, expected an object with a 'text' string")
    if "text" not in record:
        raise MsllmError(f"{where} has no 'text' key (expected a string)")
    if not isinstance(record["text"], str):
        raise MsllmError(f"{where} key 'text' is a JSON {type(record['text']).__name__}, expected a string")
    return record["text"]


def read_wiki_file(path: str) -> tuple[list[str], bool]:
    """Documents of one ``wiki`` input file (see the module doc) and whether it was WikiText.

    Raises:
        MsllmError: unreadable/not UTF-8, bad JSON (file and line), a record without a string
            ``text``.
    """
    lower = path.lower()
    if lower.endswith(".json"):
        data = load_json_file(path)
        if not isinstance(data, list):
            raise MsllmError(
                f"{path}: top level is a JSON {type(data).__name__}, expected a list of objects with 'text'"
            )
        texts = [_text_of(rec, f"{path}: record {i}") for i, rec in enumerate(data)]
        return [t for t in texts if t.strip()], False
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as exc:
        raise MsllmError(f"{path}: not UTF-8 text at byte {exc.start} (expected a UTF-8 text file)") from None
    if not lower.endswith(".jsonl"):
        if is_wikitext(path, text):
            return wikitext_paragraphs(text), True
        return [line for line in text.splitlines() if line.strip()], False
    docs = [_text_of(rec, f"{path}: line {lineno}") for lineno, rec in json_lines(text.splitlines(), path)]
    return [d for d in docs if d.strip()], False


def read_wiki_documents(path: str) -> list[str]:
    """The documents of :func:`read_wiki_file` alone."""
    return read_wiki_file(path)[0]
