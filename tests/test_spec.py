"""The one grammar of verifier and engine names: every name the README and the docs show parses, and `str(spec)`
writes it back in a form that parses to the same spec; malformed names get one clear line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quasar.spec import EngineSpec, VerifierSpec

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PEERS = ("hf:", "llamacpp:")


def names_shown() -> tuple[set[str], set[str]]:
    """(verifier names, engine names) in the README's and docs' commands and Python examples."""
    verifiers, engines = set(), set()
    for doc in DOCS:
        text = doc.read_text()
        for listed in re.findall(r"--(?:verifier|scheme) ([\w:.+,]+)", text) + re.findall(r'verifier="([^"]+)"', text):
            verifiers.update(v for v in listed.split(",") if v and v.upper() != v)
        for listed in re.findall(r"--methods ([\w:.+,\-]+)", text):
            engines.update(m for m in listed.split(",") if m and not m.startswith(PEERS) and m.upper() != m)
    return verifiers, engines


VERIFIERS, ENGINES = names_shown()


def test_the_docs_show_names_of_every_form():
    assert {"w8a8", "w8a8:pc", "w8a16", "fp32", "w8a8+bf16", "w4a8"} <= VERIFIERS
    assert {"ar:w8a8", "ngram+w8a8", "ngram+w8a8+bf16", "ngram+w4a8"} <= ENGINES


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_every_verifier_name_shown_round_trips(name):
    levels = EngineSpec.parse(f"ar:{name}").levels  # one level or a cascade MIDDLE+TOP
    assert "+".join(map(str, levels)) == name or all(VerifierSpec.parse(str(v)) == v for v in levels)
    for level in levels:
        assert VerifierSpec.parse(str(level)) == level


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_name_shown_round_trips(name):
    spec = EngineSpec.parse(name)
    assert EngineSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("name,spec", [
    ("w8a8:g64:0.5:lmbf16", VerifierSpec("w8a8", group=64, alpha=0.5, lm_head="lmbf16")),
    ("w8a8:pc:none", VerifierSpec("w8a8", group=0, alpha="none")),
    ("w4a8", VerifierSpec("w4a8")),
    ("w4a8:g64:rtn", VerifierSpec("w4a8", group=64, method="rtn")),
    ("w4a8:g32:gptq", VerifierSpec("w4a8", group=32, method="gptq")),
    ("pruned:8", VerifierSpec("pruned", layers=8)),
])
def test_parts_land_in_their_fields(name, spec):
    assert VerifierSpec.parse(name) == spec and str(spec) == name


def test_engine_parts():
    spec = EngineSpec.parse("model:/a+b/c.gguf+w4a8+bf16")
    assert spec.drafter == "model:/a+b/c.gguf" and [str(v) for v in spec.levels] == ["w4a8", "bf16"]
    assert str(EngineSpec.parse("ngram+w4a8").exact()) == "ngram+w4a8+bf16"


@pytest.mark.parametrize("name,message", [
    ("w9a9", "unknown verifier"),
    ("w4a8:pc", "per channel"),
    ("w4a8:0.5", "only w8a8 takes an alpha"),
    ("w8a8:awq", "only w4a8 takes a fitting method"),
    ("w8a8:g48", "multiple of 32"),
    ("w8a8:g64:g32", "names its group twice"),
    ("w8a8:fast", "neither pc, gN"),
    ("pruned:x", "pruned:N"),
    ("fp32:1", "takes no argument"),
])
def test_malformed_verifier_names_say_what_is_wrong(name, message):
    with pytest.raises(ValueError, match=message):
        VerifierSpec.parse(name)


def test_the_guard_names_what_it_takes():
    with pytest.raises(ValueError, match="w8a8 or w8a16 verifier with bf16; --verifier w4a8 is not one"):
        EngineSpec.parse("ngram+w4a8", guard=1.0)
    with pytest.raises(ValueError, match="is a cascade"):
        EngineSpec.parse("ngram+w8a8+bf16", guard=1.0)
