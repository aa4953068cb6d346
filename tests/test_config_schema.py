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
    """(dotted path, field name, the dataclass holding it) for every leaf field of dataclass
    ``cls``, recursively."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        sub = tp if dataclasses.is_dataclass(tp) else (inner[0] if inner else None)
        path = f"{prefix}{f.name}"
        if sub is not None:
            yield from schema_fields(sub, path + ".")
        else:
            yield path, f.name, cls


def shared_sections():
    """Dataclasses that stand at more than one place of the schema (``train_dataset`` and
    ``eval_dataset`` are both a DatasetConfig): a read of ``.shuffle`` proves nothing about
    ``eval_dataset.shuffle``, so their fields must be read through the section's own name."""
    def root(cls):  # EvalDatasetConfig is a DatasetConfig with other defaults: the same fields
        return [c for c in cls.__mro__ if dataclasses.is_dataclass(c)][-1]

    sections: dict = {}
    for path, _, owner in schema_fields(RunConfig):
        sections.setdefault(root(owner), set()).add(path.rsplit(".", 2)[-2] if "." in path else "")
    return {owner for _, _, owner in schema_fields(RunConfig) if len(sections[root(owner)]) > 1}


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
    shared = shared_sections()
    unread = []
    for path, name, owner in schema_fields(RunConfig):
        if path in NO_EFFECT:
            continue
        if owner in shared:  # read through its own section: eval_dataset.input_columns
            section = path.rsplit(".", 2)[-2]
            if re.search(rf"\b{section}\.{name}\b(?!\s*\()", code):
                continue
        # an attribute read (not a method call of the same name), getattr(..., "name") or x["name"]
        elif (re.search(rf"\.{name}\b(?!\s*\()", code) or re.search(rf"getattr\([^)]*[\"']{name}[\"']", code)
                or re.search(rf"\[[\"']{name}[\"']\]", code)):
            continue
        unread.append(path)
    assert not unread, f"config keys no code reads (silently ignored): {unread}"


def test_schema_walk_finds_nested_sections():
    paths = {p for p, _, _ in schema_fields(RunConfig)}
    # a sample from each level, so a broken walk cannot pass the test above vacuously
    for p in ("runner_config.batch_size", "model.model_config.hidden_size",
              "model.model_config.pet_config.lora_rank", "generation_config.top_p",
              "callbacks.checkpoint.keep_checkpoint_max", "tensorboard.tensorboard_dir"):
        assert p in paths, p
    from msllm.config import DatasetConfig

    assert DatasetConfig in shared_sections()  # train_dataset and eval_dataset


def test_a_field_read_only_through_another_section_counts_as_unread():
    """The check the walk makes for shared sections: eval_dataset.input_columns is read only if
    some code says ``eval_dataset.input_columns``, not because train_dataset's is read."""
    code = "data = build(cfg.train_dataset.shuffle)\n"
    assert re.search(r"\btrain_dataset\.shuffle\b(?!\s*\()", code)
    assert not re.search(r"\beval_dataset\.shuffle\b(?!\s*\()", code)
