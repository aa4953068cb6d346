"""YAML and ``--key.sub=value`` overrides <-> typed dataclasses, with errors that name the key's
full path (``runner_config.batch_size``), what was expected and, for a misspelt key, the closest
valid name. Generic: used for the run config (:mod:`msllm.config`), the model config read from a
checkpoint manifest, and LoRA adapter settings. YAML is read with ``yaml.safe_load`` only.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Union

import yaml

from msllm.errors import MsllmError


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to ``tp`` or raise MsllmError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except MsllmError as exc:
                errors.append(str(exc))
        if len(errors) == 1:  # Optional[X]: X's own message (an Optional section's unknown key, named)
            raise MsllmError(errors[0])
        raise MsllmError(f"{path}: expected {' or '.join(_type_name(a) for a in args)}, "
                         f"got {value!r} ({type(value).__name__})")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise MsllmError(f"{path}: expected a mapping (section), got {value!r}")
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise MsllmError(f"{path}: expected true/false, got {value!r} ({type(value).__name__})")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise MsllmError(f"{path}: expected an integer, got {value!r} ({type(value).__name__})")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise MsllmError(f"{path}: expected a number, got {value!r} ({type(value).__name__})")
    if tp is str:
        if isinstance(value, str):
            return value
        raise MsllmError(f"{path}: expected a string, got {value!r} ({type(value).__name__})")
    if tp in (list, dict) or origin in (list, dict):
        base = origin or tp
        if isinstance(value, base):
            return value
        raise MsllmError(f"{path}: expected a {base.__name__}, got {value!r}")
    raise TypeError(f"config field {path} has an unsupported type {tp!r}")


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping; unknown keys and wrong types raise MsllmError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
            raise MsllmError(f"unknown config key {full!r}{hint}")
        kwargs[key] = _convert(value, hints[key], full)
    try:
        return cls(**kwargs)
    except MsllmError as exc:
        raise MsllmError(str(exc)) from None


def to_dict(obj: Any) -> Any:
    """The inverse of :func:`from_dict`: plain dicts/lists, ready for ``yaml.safe_dump``."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(arg: str) -> tuple[list[str], Any]:
    """``--a.b.c=value`` -> (["a", "b", "c"], value parsed as a YAML scalar/flow value)."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise MsllmError(f"override {arg!r}: expected --section.key=value")
    key, raw = body.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise MsllmError(f"override {arg!r}: value is not valid YAML ({exc.problem})") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each ``--a.b=value`` override into the nested mapping ``data`` (in place)."""
    for arg in overrides:
        keys, value = parse_override(arg)
        node = data
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            elif not isinstance(child, dict):
                raise MsllmError(f"override {arg!r}: {k!r} is not a section")
            node = child
        node[keys[-1]] = value
    return data


def read_yaml(path: str) -> dict:
    """Read a YAML mapping with ``yaml.safe_load``; errors name the file and the line."""
    if not os.path.isfile(path):
        raise MsllmError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise MsllmError(f"config file {path!r} is not valid YAML{where}: "
                         f"{getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MsllmError(f"config file {path!r}: expected a mapping at the top level")
    return data
