"""The repository carries its own wire contracts: nothing reads a folder beside the checkout."""

from __future__ import annotations

from pathlib import Path

from kiln.contracts import CONTRACTS_DIR, schemas

REPO = Path(__file__).resolve().parents[1]
CONTRACT_FILES = {"kiln-inference-v1.schema.json", "kiln-evals-v1.schema.json", "thinking-budget-v1.schema.json"}


def test_the_three_contract_schemas_ship_inside_the_package():
    assert CONTRACTS_DIR.is_relative_to(REPO / "kiln")
    assert set(schemas()) >= CONTRACT_FILES
    for page in ("inference-api.txt", "evals-api.txt", "thinking-budget.txt"):
        assert (CONTRACTS_DIR / page).is_file()


# Spelled in pieces so that this file, which names them, is checked like every other.
SIBLING = ".." + "/shared"
SIBLING_SPEC = "shared" + "/spec"


def test_no_source_test_or_doc_reads_the_sibling_shared_folder():
    offenders = []
    for path in [*REPO.glob("kiln/**/*.py"), *REPO.glob("kiln/**/*.md"), *REPO.glob("tests/**/*.py"),
                 REPO / "Makefile", REPO / "README.md", *REPO.glob("*.md"), *REPO.glob("docs/*.md"),
                 *REPO.glob("benchmarks/*.md"), *REPO.glob(".ci/*")]:
        text = path.read_text(encoding="utf-8", errors="replace")
        if SIBLING in text or SIBLING_SPEC in text:
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
