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
