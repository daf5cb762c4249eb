"""The docs' generated tables equal their committed data files (scripts/docs_tables.py), and the check
that says so catches a changed cell, in the doc or in the data."""
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_tables)

DATA = sorted((ROOT / "docs" / "data").glob("*.json"))


def test_docs_tables_match_their_data():
    assert docs_tables.run(ROOT, check=True) == []


@pytest.mark.parametrize("path", DATA, ids=[p.name for p in DATA])
def test_data_file_has_its_provenance(path):
    data = docs_tables.load(path)  # raises naming the missing key
    assert data["command"].strip() and data["machine"].strip()


@pytest.mark.parametrize("path", DATA, ids=[p.name for p in DATA])
def test_data_file_commit_is_in_the_history(path):
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    commit = docs_tables.load(path)["commit"]
    found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", commit + "^{commit}"], capture_output=True)
    assert found.returncode == 0, f"{path.name}: commit {commit} is not in this repository's history"


def test_every_data_file_has_a_marker():
    text = "".join(p.read_text() for p in docs_tables.doc_files(ROOT) if p.exists())
    unused = [p.name for p in DATA if f"<!-- table: data/{p.name} -->" not in text]
    assert unused == []


def _copy(tmp_path):
    """A repository of one doc with two blocks: one whose data exists, one whose data is not measured yet."""
    (tmp_path / "docs" / "data").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "data" / "codec_h200.json", tmp_path / "docs" / "data" / "t.json")
    doc = tmp_path / "docs" / "X.md"
    doc.write_text("# X\n\n<!-- table: data/t.json -->\n<!-- /table -->\n\n"
                   "<!-- table: data/later.json -->\n<!-- /table -->\n")
    assert docs_tables.run(tmp_path) == ["docs/X.md: data/t.json", "docs/X.md: data/later.json"]
    assert docs_tables.run(tmp_path, check=True) == []
    return doc


def test_missing_data_renders_as_not_measured(tmp_path):
    doc = _copy(tmp_path)
    assert "Not yet measured: `data/later.json`" in doc.read_text()


def test_check_catches_a_cell_changed_in_the_doc(tmp_path):
    doc = _copy(tmp_path)
    text = doc.read_text()
    assert "0.231 / 0.133 / 0.362" in text
    doc.write_text(text.replace("0.231 / 0.133 / 0.362", "0.231 / 0.133 / 0.300", 1))
    assert docs_tables.run(tmp_path, check=True) == ["docs/X.md: data/t.json"]
    assert docs_tables.main(["--check", "--root", str(tmp_path)]) == 1


def test_check_catches_a_cell_changed_in_the_data(tmp_path):
    _copy(tmp_path)
    path = tmp_path / "docs" / "data" / "t.json"
    data = json.loads(path.read_text())
    data["rows"][1][1] = "9.999 / 0.133 / 0.362"
    path.write_text(json.dumps(data))
    assert docs_tables.run(tmp_path, check=True) == ["docs/X.md: data/t.json"]


def test_data_without_its_provenance_is_refused(tmp_path):
    _copy(tmp_path)
    path = tmp_path / "docs" / "data" / "t.json"
    data = json.loads(path.read_text())
    del data["commit"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="commit"):
        docs_tables.run(tmp_path, check=True)


def test_every_figure_is_drawn_from_a_data_file():
    """Each PNG the docs show is named by a data file (`--figures` redraws it), and docs/figures holds no other."""
    text = "".join(p.read_text() for p in docs_tables.doc_files(ROOT) if p.exists())
    shown = set(re.findall(r"\(((?:docs/)?figures/[^)\s]+\.png)\)", text))
    shown = {s.removeprefix("docs/") for s in shown}
    drawn = {json.loads(p.read_text()).get("figure", {}).get("file") for p in DATA} - {None}
    on_disk = {f"figures/{p.name}" for p in (ROOT / "docs" / "figures").glob("*.png")}
    assert shown <= drawn, sorted(shown - drawn)
    assert on_disk == drawn, (sorted(on_disk - drawn), sorted(drawn - on_disk))


def test_a_named_raw_file_must_exist(tmp_path):
    _copy(tmp_path)
    path = tmp_path / "docs" / "data" / "t.json"
    data = json.loads(path.read_text())
    data["raw_file"] = "t.csv"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="raw_file"):
        docs_tables.run(tmp_path, check=True)
    (tmp_path / "docs" / "data" / "t.csv").write_text("run,ms\n1,0.362\n")
    assert docs_tables.run(tmp_path, check=True) == []
