"""No silent keys: every field of the run-config schema is read by some code, or is named by
msllm.settings as having no effect (issue #13). A field that nothing reads would be a key a user
sets and msllm silently ignores."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import typing

from msllm.config import RunConfig
from msllm.settings import NO_EFFECT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the schema's own definitions (their validate() methods read every field, which proves nothing);
# msllm/config_generation.py defines GenerationConfig but also resolves the settings, so it counts
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


# Names code gives each section's object (besides the section's own attribute name and local
# aliases such as ``rc = cfg.runner_config``, which the walk resolves): a read counts only through
# one of them, so a generic field name (type, eps, format, shuffle) read off an unrelated object
# proves nothing.
SECTION_NAMES = {"": {"cfg", "run_config"}, "model_config": {"config", "mc", "cfg", "hf_cfg", "shape_from", "run"},
                 "generation_config": {"gc", "gen", "config", "cfg"}, "lr_schedule": {"cfg", "config", "schedule"},
                 "pet_config": {"pet", "pc", "config"}, "recompute_config": {"rc", "recompute", "cfg"}}
# LlamaConfig's own derived shapes (kv_heads, ffn_size) read its fields through ``self``: there
# ``self`` is the model config
SELF_READS = {os.path.join("msllm", "models", "llama", "config.py")}


class ConfigReads(ast.NodeVisitor):
    """``(base name, field)`` of every attribute read in a module: ``x.section.field`` gives
    (section, field); ``alias.field`` with ``alias = <...>.section`` gives (section, field);
    ``getattr(x, "field")`` and ``getattr(x, k)`` for ``k`` over a module-level tuple of names."""

    def __init__(self, rel: str):
        self.rel, self.reads, self.name_tuples = rel, set(), {}

    def visit_Module(self, node):
        for st in node.body:
            if (isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Name)
                    and isinstance(st.value, (ast.Tuple, ast.List))
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in st.value.elts)):
                self.name_tuples[st.targets[0].id] = [e.value for e in st.value.elts]
        self.generic_visit(node)

    def _base(self, node, aliases):
        if isinstance(node, ast.Attribute):
            return node.attr
        if isinstance(node, ast.Name):
            return aliases.get(node.id, node.id)
        return None

    def visit_FunctionDef(self, node):
        aliases = {}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign):
                t, v = sub.targets[0], sub.value
                pairs = zip(t.elts, v.elts) if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) else [(t, v)]
                for name, value in pairs:
                    if isinstance(name, ast.Name) and isinstance(value, ast.Attribute):
                        aliases[name.id] = value.attr
        looped = [sub.iter.id for sub in ast.walk(node) if isinstance(sub, (ast.comprehension, ast.For))
                  and isinstance(sub.iter, ast.Name) and sub.iter.id in self.name_tuples]
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load):
                base = self._base(sub.value, aliases)
                if base == "self" and self.rel in SELF_READS:
                    base = "model_config"
                self.reads.add((base, sub.attr))
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "getattr" \
                    and len(sub.args) >= 2:
                base, key = self._base(sub.args[0], aliases), sub.args[1]
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    self.reads.add((base, key.value))
                elif isinstance(key, ast.Name):
                    for tup in looped:
                        self.reads.update((base, k) for k in self.name_tuples[tup])
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef


def config_reads() -> set:
    reads = set()
    for top in ("msllm", "tools", "data_preprocess"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
                if name.endswith(".py") and rel not in SCHEMA_FILES:
                    visitor = ConfigReads(rel)
                    with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
                        visitor.visit(ast.parse(fh.read()))
                    reads |= visitor.reads
    return reads


def test_every_config_field_is_read_through_its_config_object_or_named_as_without_effect():
    """Stricter than a text search: a field counts as read only through its own section's object
    (``cfg.runner_config.batch_size``, ``rc.batch_size`` after ``rc = cfg.runner_config``, a
    parameter conventionally named for it: :data:`SECTION_NAMES`)."""
    reads = config_reads()
    unread = []
    for path, name, _ in schema_fields(RunConfig):
        if path in NO_EFFECT:
            continue
        section = path.rsplit(".", 2)[-2] if "." in path else ""
        if not any((base, name) in reads for base in {section} | SECTION_NAMES.get(section, set())):
            unread.append(path)
    assert not unread, f"config keys no code reads through their config object (silently ignored): {unread}"


def test_the_strict_walk_does_not_count_a_read_off_another_object():
    visitor = ConfigReads("x.py")
    visitor.visit(ast.parse("def f(cfg, other):\n    rc = cfg.runner_config\n    a = rc.batch_size\n"
                            "    b = other.shuffle\n"))
    assert ("runner_config", "batch_size") in visitor.reads and ("train_dataset", "shuffle") not in visitor.reads


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
              "pet_config.lora_rank", "generation_config.top_p",
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
