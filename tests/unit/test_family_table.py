"""docs/exports.md's table of decoder families by format is the families test's expectations
(``tests.fixtures.family_outcomes``), rendered: the two cannot drift."""

from __future__ import annotations

from tests.fixtures.family_outcomes import DOC, doc_table, render_table


def test_the_docs_family_table_is_the_families_tests_expectations() -> None:
    assert doc_table(DOC.read_text(encoding="utf-8")) == render_table(), (
        "docs/exports.md's family table differs from tests/fixtures/family_outcomes.py: "
        "run `python -m tests.fixtures.family_outcomes`"
    )
