"""Grammars that can never finish are refused at compile time (400), not run to max_tokens."""

from __future__ import annotations

import pytest

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import StructuredOutputError, validate_structured_outputs
from tokenmill.structured_output.backend import unproductive_rules


@pytest.mark.parametrize("text, bad", [
    ("root ::= root", ["root"]),
    ('root ::= "a" root', ["root"]),
    ('root ::= "a" root | "b"', []),
    ('root ::= "x" | "a" b\nb ::= b', ["b"]),                  # a dead branch: entering it is a trap
    ('root ::= "a"* b?\nb ::= "q" b', ["b"]),
    ('root ::= ("a" | "b")+ c\nc ::= "c"{0,} [x-z]{2,3}', []),
    ("root ::= a\na ::= b\nb ::= a", ["root", "a", "b"]),
    ('root ::= (= "a") "a"{1,} "\\"" [^\\]]', []),
    ('root ::= "a" | b\nunused ::= unused\nb ::= "b"', []),    # unreachable rules do not count
])
def test_unproductive_rules(text, bad):
    assert unproductive_rules(text) == bad


def test_unknown_syntax_skips_the_check():
    assert unproductive_rules("root ::= %weird") is None
    assert unproductive_rules('start ::= "a"') is None          # no root
    assert unproductive_rules("root ::= missing") is None       # a reference to no rule


def test_xgrammar_normalised_forms_parse():
    """What xgrammar prints for request grammars (EBNF and Lark) and regexes parses; the check runs only on
    the ``grammar`` constraint (a JSON schema's printed grammar uses escapes this parser skips: None)."""
    xgr = pytest.importorskip("xgrammar")
    for g in (xgr.Grammar.from_regex(r"[A-Z][a-z]{2,8} \d{4}"), xgr.Grammar.from_ebnf('root ::= "x" root | "y"'),
              xgr.Grammar.from_ebnf('root ::= "a"+ b? [x-z]* "q"{2,3}\nb ::= "z"'),
              xgr.Grammar.from_lark('start: "a" b\nb: "x"+')):
        assert unproductive_rules(str(g)) == [], str(g)


@pytest.mark.parametrize("text, needle", [
    ("root ::= root", "the grammar matches no string"),
    ('root ::= "a" root', "the grammar matches no string"),
    ('root ::= "x" | "a" b\nb ::= "c" b', "rule 'b' can never finish"),
])
def test_never_finishing_grammar_is_a_400(text, needle):
    pytest.importorskip("xgrammar")
    with pytest.raises(StructuredOutputError) as ei:
        validate_structured_outputs(StructuredOutputsParams(grammar=text))
    assert ei.value.field == "grammar" and ei.value.status_code == 400 and needle in str(ei.value)
    assert str(ei.value).startswith("structured_outputs.grammar")
