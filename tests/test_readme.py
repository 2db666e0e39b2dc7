"""The README's results section is generated from reports/ (scripts/results_table.py): it must
equal what the generator prints, so a re-measured report cannot leave stale numbers behind."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "scripts" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_results_section_matches_the_reports():
    table = _generator()
    readme = (ROOT / "README.md").read_text()
    assert table.BEGIN in readme and table.END in readme, "README.md lost its generated results section"
    start, stop = readme.index(table.BEGIN), readme.index(table.END) + len(table.END)
    assert readme[start:stop] == table.section(), "run: python scripts/results_table.py --write"


def test_readme_links_point_at_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to a missing file: {target}"


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
    code = _python_block_after((ROOT / "README.md").read_text(), "## Use in an app")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["outputs"] and namespace["outputs"][0].size > 0
