import pytest

from kiln.errors import KilnError
from kiln.evals.suite import parse_suite
from kiln.evals.suite_store import SuiteStore, suite_root
from tests.evals._helpers import suite_json


@pytest.fixture
def store(tmp_path):
    return SuiteStore(suite_root(tmp_path))


def test_suites_live_under_data_dir_eval_suites(tmp_path, store):
    path, status = store.save(parse_suite(suite_json()))
    assert status == "created"
    assert path == tmp_path / "eval" / "suites" / "math-smoke" / "suite.json"
    assert store.get("math-smoke").to_json() == parse_suite(suite_json()).to_json()


def test_saving_an_existing_name_needs_force(store):
    store.save(parse_suite(suite_json()))
    with pytest.raises(KilnError) as e:
        store.save(parse_suite(suite_json()))
    assert (e.value.status, e.value.code) == (409, "eval_suite_exists")
    _, status = store.save(parse_suite(suite_json(description="v2")), force=True)
    assert status == "overwritten"
    assert store.get("math-smoke").description == "v2"


def test_no_temporary_files_are_left_behind(store):
    path, _ = store.save(parse_suite(suite_json()))
    assert sorted(p.name for p in path.parent.iterdir()) == ["suite.json"]


def test_list_is_sorted_and_skips_unreadable_suites(store):
    store.save(parse_suite(suite_json(name="b")))
    store.save(parse_suite(suite_json(name="a")))
    (store.root / "broken").mkdir()
    (store.root / "broken" / "suite.json").write_text("{not json")
    assert [s["name"] for s in store.list_summaries()] == ["a", "b"]


def test_delete_removes_the_suite(store):
    store.save(parse_suite(suite_json()))
    store.delete("math-smoke")
    assert store.names() == []
    assert not any(store.root.iterdir())
    with pytest.raises(KilnError) as e:
        store.delete("math-smoke")
    assert (e.value.status, e.value.code) == (404, "eval_suite_not_found")


def test_unknown_suite_is_404(store):
    with pytest.raises(KilnError) as e:
        store.get("ghost")
    assert (e.value.status, e.value.code) == (404, "eval_suite_not_found")


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden"])
def test_names_cannot_escape_the_store(store, name):
    with pytest.raises(KilnError) as e:
        store.get(name)
    assert e.value.code == "invalid_suite_name"
