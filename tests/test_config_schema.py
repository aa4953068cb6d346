"""No silent keys: every field of the run-config schema is read by some code, or is named by
msllm.settings as having no effect (issue #13). A field that nothing reads would be a key a user
sets and msllm silently ignores."""

from __future__ import annotations

import dataclasses
import os
import re
import typing

from msllm.config import RunConfig
from msllm.settings import NO_EFFECT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the schema's own definitions (their validate() methods read every field, which proves nothing);
# msllm/generation/config.py defines GenerationConfig but also resolves the settings, so it counts
SCHEMA_FILES = {os.path.join("msllm", "config.py")}


def schema_fields(cls, prefix=""):
    """(dotted path, field name) for every leaf field of dataclass ``cls``, recursively."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        sub = tp if dataclasses.is_dataclass(tp) else (inner[0] if inner else None)
        path = f"{prefix}{f.name}"
        if sub is not None:
            yield from schema_fields(sub, path + ".")
        else:
            yield path, f.name


def code_outside_schema() -> str:
    texts = []
    for top in ("msllm", "tools", "data_preprocess"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
                if name.endswith(".py") and rel not in SCHEMA_FILES:
                    with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
                        texts.append(fh.read())
    return "\n".join(texts)


def test_every_config_field_is_read_by_code_or_named_as_without_effect():
    code = code_outside_schema()
    unread = []
    for path, name in schema_fields(RunConfig):
        if path in NO_EFFECT:
            continue
        # an attribute read (not a method call of the same name), getattr(..., "name") or x["name"]
        if (re.search(rf"\.{name}\b(?!\s*\()", code) or re.search(rf"getattr\([^)]*[\"']{name}[\"']", code)
                or re.search(rf"\[[\"']{name}[\"']\]", code)):
            continue
        unread.append(path)
    assert not unread, f"config keys no code reads (silently ignored): {unread}"


def test_schema_walk_finds_nested_sections():
    paths = {p for p, _ in schema_fields(RunConfig)}
    # a sample from each level, so a broken walk cannot pass the test above vacuously
    for p in ("runner_config.batch_size", "model.model_config.hidden_size",
              "model.model_config.pet_config.lora_rank", "generation_config.top_p",
              "callbacks.checkpoint.keep_checkpoint_max", "tensorboard.tensorboard_dir"):
        assert p in paths, p
