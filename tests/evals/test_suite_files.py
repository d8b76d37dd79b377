import json

import pytest

from kiln.errors import KilnError
from kiln.evals.suite_files import load_suite_file
from kiln.testing.schemas import SPEC_DIR, validate
from tests.evals._helpers import suite_json

SCHEMA = "kiln-evals-v1.schema.json"


def write_split(tmp_path, header, lines):
    (tmp_path / "suite.json").write_text(json.dumps(header))
    (tmp_path / "examples.jsonl").write_text("\n".join(lines) + "\n")


def test_single_json_file(tmp_path):
    path = tmp_path / "math.json"
    path.write_text(json.dumps(suite_json()))
    suite = load_suite_file(path)
    assert [e.id for e in suite.examples] == ["two-plus-two", "three-plus-three"]
    validate(SCHEMA, "EvalSuite", suite.to_json())


def test_header_plus_examples_jsonl_skips_blank_lines(tmp_path):
    data = suite_json()
    examples = data.pop("examples")
    write_split(tmp_path, data, [json.dumps(examples[0]), "", "   ", json.dumps(examples[1])])
    assert len(load_suite_file(tmp_path / "suite.json").examples) == 2
    assert len(load_suite_file(tmp_path).examples) == 2  # a directory means its suite.json


def test_bad_jsonl_line_is_reported_by_number(tmp_path):
    data = suite_json()
    examples = data.pop("examples")
    write_split(tmp_path, data, [json.dumps(examples[0]), "", "{oops"])
    with pytest.raises(KilnError) as e:
        load_suite_file(tmp_path)
    assert "invalid example at line 3" in e.value.message


def test_header_must_not_also_hold_examples(tmp_path):
    write_split(tmp_path, suite_json(), [json.dumps(suite_json()["examples"][0])])
    with pytest.raises(KilnError) as e:
        load_suite_file(tmp_path)
    assert "must not contain examples" in e.value.message


def test_example_errors_from_files_name_the_example(tmp_path):
    data = suite_json()
    examples = data.pop("examples")
    examples[1]["weight"] = -1
    write_split(tmp_path, data, [json.dumps(e) for e in examples])
    with pytest.raises(KilnError) as e:
        load_suite_file(tmp_path)
    assert "example three-plus-three: weight" in e.value.message


def test_missing_and_malformed_files_are_clear_errors(tmp_path):
    with pytest.raises(KilnError, match="does not exist"):
        load_suite_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(KilnError, match="not valid JSON"):
        load_suite_file(tmp_path / "bad.json")


def test_the_contract_example_suite_loads(tmp_path):
    contract = json.loads((SPEC_DIR / SCHEMA).read_text())
    for example in contract["x-kiln-examples"]["EvalSuite"]:
        path = tmp_path / "c.json"
        path.write_text(json.dumps(example))
        assert load_suite_file(path).to_json() == example
