"""Whether a JSON schema admits any finite value: a ``response_format`` schema that does not is refused.

A schema such as ``{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}`` compiles in
llguidance, and its matcher allows a first token (``{``), but every value must contain itself: a row
following it can never finish and would end by ``max_tokens`` with text that does not parse. This check
finds such schemas before a row starts (msllm/serving/structured.py).

The rule (JSON Schema 2020-12, "Applicators"; draft-07's ``definitions`` and ``items`` alike): a schema
has a finite value unless it is ``false``, or its ``$ref`` (a local ``#...`` JSON pointer), every branch of
its ``anyOf`` / ``oneOf``, some part of its ``allOf``, or every type it allows needs a value without one. An
object needs a finite value for each ``required`` property that ``properties`` describes; an array with
``minItems`` n >= 1 needs one for its first n items (``prefixItems``, then ``items``; draft-07's list form of
``items`` alike). ``enum`` and ``const`` always give one. A value that needs itself, through any chain of
references, has none (the depth-first search below returns False for a schema already on its path: a
finite value never needs a value of the same schema inside itself at every depth). Other keywords
(formats, bounds, patterns) are not judged: the check refuses only what it can prove has no value, and a
schema it cannot judge within its budget of steps is let through.
"""

from __future__ import annotations

from typing import Any

BUDGET = 20000   # schema nodes visited at most (the search is exponential in the worst case)


class _OutOfBudget(Exception):
    pass


def _pointer(root: Any, ref: str):
    """The schema a local reference ``#/a/b`` names in ``root``, or None (not local, or not there)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def has_finite_value(schema: Any) -> bool:
    """Whether some finite JSON value satisfies ``schema`` as far as the rule above can tell (True when it
    cannot tell). ``schema``: a JSON schema (dict or bool) as parsed from the request."""
    steps = [0]

    def finite(node: Any, path: frozenset) -> bool:
        steps[0] += 1
        if steps[0] > BUDGET:
            raise _OutOfBudget
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        if id(node) in path:                                 # needs itself: no finite value down this way
            return False
        path = path | {id(node)}
        if "enum" in node or "const" in node:
            return True
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _pointer(schema, ref)
            if target is not None and not finite(target, path):
                return False
        for key in ("anyOf", "oneOf"):
            options = node.get(key)
            if isinstance(options, list) and options and not any(finite(o, path) for o in options):
                return False
        parts = node.get("allOf")
        if isinstance(parts, list) and not all(finite(p, path) for p in parts):
            return False
        types = node.get("type")
        if types is None:
            return True                                      # any type: a value of another type will do
        types = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)]
        return any(_type_finite(node, t, path, finite) for t in types) if types else True

    try:
        return finite(schema, frozenset())
    except _OutOfBudget:
        return True


def _type_finite(node: dict, kind: str, path: frozenset, finite) -> bool:
    """Whether a value of JSON type ``kind`` can be finite under ``node``'s object / array keywords."""
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(finite(props[r], path) for r in required if isinstance(r, str) and r in props)
    if kind == "array":
        need = node.get("minItems", 0)
        if not isinstance(need, int) or need <= 0:
            return True
        prefix = node.get("prefixItems")
        items = node.get("items", True)
        if isinstance(items, list):                          # draft-07's list form: the items in order
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        if not all(finite(p, path) for p in prefix[:need]):
            return False
        return need <= len(prefix) or finite(items, path)
    return True


__all__ = ["has_finite_value"]
