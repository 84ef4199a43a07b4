"""docs/configuration.md is generated from the typed schemas: it must match them, and every field
of every schema must have a meaning to generate from."""

import dataclasses

import pytest

from dropless.config import MODEL_FIELD_DOCS, ModelArgs
from dropless.train import docgen, schema
from dropless.train.config import repo_root


def test_configuration_reference_matches_the_schemas():
    text = (repo_root() / docgen.OUTPUT).read_text()
    assert text == docgen.render(), "docs/configuration.md is out of date: run `python -m dropless.train.docgen`"


def test_check_mode_fails_on_a_stale_reference(tmp_path, monkeypatch, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / docgen.OUTPUT).write_text("# stale\n")
    monkeypatch.setattr(docgen, "repo_root", lambda: tmp_path)
    assert docgen.main(["--check"]) == 1
    assert "python -m dropless.train.docgen" in capsys.readouterr().err
    assert docgen.main([]) == 0
    assert docgen.main(["--check"]) == 0


@pytest.mark.parametrize("cls", [ModelArgs, *schema.FIELD_DOCS])
def test_every_field_has_a_meaning(cls):
    docs = MODEL_FIELD_DOCS if cls is ModelArgs else schema.FIELD_DOCS[cls]
    groups = {g for g, _ in docgen._GROUPS} if cls is schema.RunConfig else set()
    names = {f.name for f in dataclasses.fields(cls)} - groups
    assert names == set(docs), f"{cls.__name__}: fields without a meaning {names - set(docs)}, " \
                               f"meanings without a field {set(docs) - names}"


def test_a_field_without_a_meaning_is_named(monkeypatch):
    docs = dict(schema.FIELD_DOCS[schema.GemmConfig])
    docs.pop("backend")
    monkeypatch.setitem(schema.FIELD_DOCS, schema.GemmConfig, docs)
    with pytest.raises(KeyError, match="GemmConfig.backend"):
        docgen.render()
