"""msllm/serving/schema_finite.py: which ``response_format`` schemas admit a finite value. Each schema the
check lets through comes with a hand-written finite value that ``jsonschema`` (the independent reference)
validates against it; each it refuses is one whose every value would have to contain itself. Through the
server's grammar step a refused schema is a 400 naming ``response_format`` (test_serving_structured.py)."""

import jsonschema
import pytest

from msllm.serving.schema_finite import has_finite_value

NODE = {"type": "object", "properties": {"v": {"type": "integer"},
                                         "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"]}

# (schema, a finite value that validates against it)
FINITE = [
    ({}, 1),
    (True, None),
    ({"type": "object"}, {}),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, {}),                            # a is optional
    ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}, {"v": 1, "next": {"v": 2, "next": None}}),
    ({"type": "array", "items": {"$ref": "#"}}, []),                                          # minItems 0
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, None),
    ({"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]}, [["x"], "y"]),
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
     {"kids": []}),                                                                           # a tree
    ({"enum": [1, 2]}, 2),
    ({"$schema": "http://json-schema.org/draft-07/schema#",
      "definitions": {"t": {"type": "array", "items": [{"type": "integer"}], "minItems": 1}},
      "$ref": "#/definitions/t"}, [3]),                                                       # draft-07 items list
    ({"type": "object", "properties": {"a/b": {"type": "integer"}}, "required": ["a/b"],
      "$defs": {"x": {"$ref": "#/properties/a~1b"}}}, {"a/b": 1}),
]

INFINITE = [
    False,
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 2},
    {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                 "required": ["x"]}}, "$ref": "#/$defs/a"},   # through two refs
    {"anyOf": [{"$ref": "#"}, False]},
    {"allOf": [{"type": "object"}, {"properties": {"a": {"$ref": "#"}}, "required": ["a"], "type": "object"}]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"$ref": "#"}},
                                            "required": ["b"]}}, "required": ["a"]},
]


@pytest.mark.parametrize("schema,value", FINITE, ids=range(len(FINITE)))
def test_a_schema_with_a_finite_value_is_let_through(schema, value):
    jsonschema.validate(value, schema)          # the witness: the schema does admit this finite value
    assert has_finite_value(schema)


@pytest.mark.parametrize("schema", INFINITE, ids=range(len(INFINITE)))
def test_a_schema_whose_values_contain_themselves_is_refused(schema):
    assert not has_finite_value(schema)


def test_a_schema_beyond_the_budget_is_let_through():
    # 2^40 paths through nested anyOf pairs whose last step needs itself: the search stops and lets it pass
    schema = {"$ref": "#/$defs/d0", "$defs": {}}
    for i in range(40):
        step = {"$ref": f"#/$defs/d{i + 1}"} if i < 39 else {"$ref": "#"}
        schema["$defs"][f"d{i}"] = {"anyOf": [step, dict(step)]}
    assert has_finite_value(schema)

