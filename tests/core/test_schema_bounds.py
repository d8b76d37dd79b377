"""The schema the grammar enforces: strings and numbers bounded unless the schema bounds them itself, and
keywords with an exact equivalent rewritten to it; every output of the rewritten schema validates against
the schema as written."""

from __future__ import annotations

import jsonschema
import pytest

from kiln.core.output_grammar import enforced_schema
from kiln.core.schema_bounds import (
    DEFAULT_MAX_ITEMS,
    DEFAULT_MAX_LENGTH,
    MAX_SAFE_INTEGER,
    bounded,
    bounded_json_object,
    enforceable,
)


def test_a_string_without_max_length_gets_the_default():
    assert bounded({"type": "string", "format": "email"})["maxLength"] == DEFAULT_MAX_LENGTH


def test_a_schemas_own_string_and_number_bounds_win():
    assert bounded({"type": "string", "maxLength": 8})["maxLength"] == 8
    assert bounded({"type": "string", "minLength": 900})["maxLength"] == 900
    own = bounded({"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.5})
    assert own == {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.5}


def test_integers_get_the_interoperable_range_and_numbers_bounded_fraction_digits():
    assert bounded({"type": "integer", "multipleOf": 5}) == {
        "type": "integer", "multipleOf": 5, "minimum": -MAX_SAFE_INTEGER, "maximum": MAX_SAFE_INTEGER}
    number = bounded({"type": "number"})
    assert number["multipleOf"] == 1e-9 and number["maximum"] == MAX_SAFE_INTEGER


def test_arrays_and_objects_open_to_any_key_get_at_most_the_default_count():
    assert bounded({"type": "array", "items": {"enum": [1]}})["maxItems"] == DEFAULT_MAX_ITEMS
    assert bounded({"type": "array", "maxItems": 3})["maxItems"] == 3
    assert bounded({"type": "object", "additionalProperties": {"enum": [1]}})["maxProperties"] == DEFAULT_MAX_ITEMS
    # llguidance bounds the key count only where every listed key is required
    assert "maxProperties" not in bounded({"type": "object", "properties": {"a": {"enum": [1]}}})
    assert "maxProperties" not in bounded({"type": "object", "additionalProperties": False})


def test_bounds_reach_nested_properties_items_refs_and_type_lists():
    schema = bounded({"type": "object", "properties": {"a": {"type": ["string", "null"]},
                                                       "b": {"type": "array", "items": {"type": "integer"}},
                                                       "c": {"$ref": "#/$defs/s"}},
                      "$defs": {"s": {"type": "string"}}})
    assert schema["properties"]["a"]["maxLength"] == DEFAULT_MAX_LENGTH
    assert schema["properties"]["b"]["items"]["maximum"] == MAX_SAFE_INTEGER
    assert schema["$defs"]["s"]["maxLength"] == DEFAULT_MAX_LENGTH
    assert schema["properties"]["c"] == {"$ref": "#/$defs/s"}


def test_tests_inside_not_and_if_are_not_bounded():
    schema = bounded({"not": {"type": "string"}, "if": {"type": "string"}, "then": {"type": "string"}})
    assert schema["not"] == {"type": "string"} and schema["if"] == {"type": "string"}
    assert schema["then"]["maxLength"] == DEFAULT_MAX_LENGTH


def test_enums_consts_and_refs_are_left_alone():
    for schema in ({"enum": ["a", 1]}, {"const": "x"}, {"$ref": "#/$defs/x"}, {"anyOf": [{"type": "null"}]}):
        assert bounded(schema) == schema


def test_json_object_is_any_object_with_bounded_values():
    schema = bounded_json_object()
    # numbers are left out here: jsonschema divides floats for multipleOf (1 / 1e-9 is not whole in
    # binary); llguidance checks it in decimal (the engine tests feed numbers through the matcher)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"a": ["x", {"b": "y", "c": None, "d": []}], "e": True})
    assert not validator.is_valid(["x"]) and not validator.is_valid({"a": "x" * (DEFAULT_MAX_LENGTH + 1)})
    number = next(s for s in schema["$defs"]["kiln_value"]["anyOf"] if s.get("type") == "number")
    assert number["maximum"] == MAX_SAFE_INTEGER and number["multipleOf"] == 1e-9


def test_dependent_required_becomes_absent_or_all_present():
    schema = enforceable({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}})
    assert "dependentRequired" not in schema
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({}) and validator.is_valid({"b": 1}) and validator.is_valid({"a": 1, "b": 2})
    assert not validator.is_valid({"a": 1})


def test_draft7_dependencies_with_name_lists_are_rewritten_and_schema_dependencies_kept():
    assert "dependencies" not in enforceable({"type": "object", "dependencies": {"a": ["b"]}})
    kept = {"type": "object", "dependencies": {"a": {"required": ["b"]}}}
    assert enforceable(kept) == kept


@pytest.mark.parametrize(("schema", "dropped"), [
    ({"type": "array", "uniqueItems": False}, True),
    ({"type": "array", "uniqueItems": True, "maxItems": 1}, True),
    ({"type": "array", "uniqueItems": True, "maxItems": 3}, False),
])
def test_unique_items_is_dropped_only_where_it_constrains_nothing(schema, dropped):
    assert ("uniqueItems" not in enforceable(schema)) is dropped


@pytest.mark.parametrize(("schema", "types"), [
    ({"not": {"type": "string"}}, ["number", "integer", "boolean", "null", "array", "object"]),
    ({"not": {"type": ["number", "null"]}}, ["string", "boolean", "array", "object"]),
    ({"type": ["string", "integer"], "not": {"type": "string"}}, "integer"),
])
def test_not_a_type_becomes_the_other_types(schema, types):
    out = enforceable(schema)
    assert "not" not in out and out["type"] == types


def test_not_integer_and_not_of_other_keywords_stay_to_be_refused():
    for schema in ({"not": {"type": "integer"}}, {"not": {"enum": ["a"]}}, {"type": "string", "not": {"type": "string"}}):
        assert enforceable(schema) == schema


def test_the_enforced_schema_closes_objects_then_rewrites_then_bounds():
    schema = enforced_schema({"type": "object", "properties": {"mail": {"type": "string", "format": "email"},
                                                               "to": {"type": "string"}},
                              "dependentRequired": {"mail": ["to"]}})
    assert schema["additionalProperties"] is False and "dependentRequired" not in schema
    assert schema["properties"]["mail"]["maxLength"] == DEFAULT_MAX_LENGTH


IF_CONST = {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "n": {"type": "integer"}},
            "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]},
            "else": {"properties": {"n": {"maximum": 0}}}}
INSTANCES = [{}, {"kind": "a"}, {"kind": "a", "n": 5}, {"kind": "b", "n": 5}, {"kind": "b", "n": -1}, {"n": 3},
             {"n": -1}, {"kind": "c"}]


@pytest.mark.parametrize("required", [False, True])
def test_if_testing_a_const_of_the_propertys_enum_becomes_an_equivalent_any_of(required):
    schema = {**IF_CONST, "if": {**IF_CONST["if"], **({"required": ["kind"]} if required else {})}}
    out = enforceable(schema)
    assert not {"if", "then", "else"} & set(out)
    before, after = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(out)
    assert [before.is_valid(i) for i in INSTANCES] == [after.is_valid(i) for i in INSTANCES]


def test_other_if_tests_stay_to_be_refused():
    for test in ({"properties": {"kind": {"const": "z"}}}, {"properties": {"kind": {"pattern": "a"}}},
                 {"required": ["kind"]}):
        schema = {**IF_CONST, "if": test}
        assert enforceable(schema) == schema


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": "long"},
    {"type": "object", "properties": ["a"], "if": {"properties": {"a": {"const": 1}}}},
    {"type": "object", "allOf": 3, "dependentRequired": {"a": ["b"]}},
])
def test_a_schema_too_malformed_to_rewrite_goes_on_as_written(schema):
    assert enforced_schema(schema) == schema
