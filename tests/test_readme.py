"""The README's "what to expect" table and docs/results.md's results section are generated from
reports/ (scripts/results_table.py): they must equal what the generator prints, so a re-measured
report cannot leave stale numbers behind."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "scripts" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generated_part(path: Path, begin: str, end: str) -> str:
    text = path.read_text()
    assert begin in text and end in text, f"{path.name} lost its generated section {begin}"
    return text[text.index(begin):text.index(end) + len(end)]


def test_readme_expect_table_matches_the_reports():
    table = _generator()
    assert _generated_part(ROOT / "README.md", table.EXPECT_BEGIN, table.EXPECT_END) == table.expect_section(), \
        "run: python scripts/results_table.py --write"


def test_results_doc_section_matches_the_reports():
    table = _generator()
    assert _generated_part(ROOT / "docs" / "results.md", table.BEGIN, table.END) == table.section(), \
        "run: python scripts/results_table.py --write"


def test_the_expect_table_has_every_headline_row_and_only_worst_rounds():
    """Every row of the README's table comes from a report that exists, and quotes a worst round: up to
    five rows (four decode settings and the long request) for each CPU kind measured, at least the
    three int8 decode rows."""
    table = _generator()
    rows = [line for line in table.expect_rows() if line.startswith("| ") and not line.startswith("| workload")]
    assert 3 * len(table.headline_runs()) <= len(rows) <= 5 * len(table.headline_runs()) and rows, rows
    for row in rows:
        assert "—" not in row.split("|")[4], f"a headline row lost its report: {row}"
        assert "rounds)" in row and "median" in row


def test_the_newest_headline_run_of_each_cpu_kind_is_shown(tmp_path, monkeypatch):
    """Two runs on one CPU kind: only the newer is shown; the first measurement (another CPU kind) stays."""
    import json
    import shutil

    table = _generator()
    monkeypatch.setattr(table, "REPORTS", tmp_path)
    for name in table.FIRST_HEADLINE.values():
        if (ROOT / "reports" / name).exists():
            shutil.copy(ROOT / "reports" / name, tmp_path / name)
    first = json.loads((tmp_path / table.FIRST_HEADLINE["int8"]).read_text())
    for day in ("2026-01-01-other", "2026-02-01-other"):
        (tmp_path / "headline" / day).mkdir(parents=True)
        run = dict(first, machine=dict(first["machine"], cpu="Other CPU", date=day[:10]))
        (tmp_path / "headline" / day / table.HEADLINE_FILES["int8"]).write_text(json.dumps(run))
    runs = table.headline_runs()
    assert [run["int8"] for run in runs] == ["headline/2026-02-01-other/bench_int8.json", table.FIRST_HEADLINE["int8"]]


def test_the_generator_refuses_a_file_without_its_markers(tmp_path, monkeypatch):
    table = _generator()
    monkeypatch.setattr(table, "README", tmp_path / "README.md")
    monkeypatch.setattr(table, "RESULTS_DOC", tmp_path / "results.md")
    (tmp_path / "README.md").write_text("no markers\n")
    (tmp_path / "results.md").write_text(f"{table.BEGIN}\n{table.END}\n")
    monkeypatch.setattr("sys.argv", ["results_table.py", "--write"])
    assert table.main() == 2
    assert (tmp_path / "results.md").read_text() == f"{table.BEGIN}\n{table.END}\n"  # nothing half-written


def test_readme_and_results_links_point_at_files_that_exist():
    for doc in (ROOT / "README.md", ROOT / "docs" / "results.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to a missing file: {target}"


def _python_block_after(readme: str, marker: str) -> str:
    start = readme.index("```python\n", readme.index(marker)) + len("```python\n")
    return readme[start:readme.index("```", start)]


def test_readme_onnxruntime_snippet_runs_as_written(tmp_path, monkeypatch):
    """The app snippet is complete: it builds its own feeds (issue 23: `feeds` was never defined)."""
    import sys

    import onnx

    from ortsparse.cli import rewrite_onnx_main

    sys.path.insert(0, str(ROOT / "tests" / "graph_rewrite"))
    import tiny_graphs

    onnx.save(tiny_graphs.llama_like(), tmp_path / "model.onnx")
    monkeypatch.chdir(tmp_path)
    assert rewrite_onnx_main(["model.onnx", "-o", "model.gated.onnx", "-q"]) == 0
    code = _python_block_after((ROOT / "README.md").read_text(), "ONNX Runtime directly")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["outputs"] and namespace["outputs"][0].size > 0
