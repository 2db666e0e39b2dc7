"""The package's import contracts ([tool.importlinter] in pyproject.toml): layers, the rewriter and
builders below the commands, calibration, measurements and zoo, cli imported by nobody, no cycles.
import-linter runs in a subprocess on a copy of the package laid out as the wheel is (python/ortsparse + graph_rewrite/ as
ortsparse.graph_rewrite): the editable install also puts the repository root on ortsparse.__path__,
which would make tests/ and bench/ look like subpackages."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

# Runs import-linter with the view first on sys.path and scikit-build's editable redirect removed,
# so `ortsparse` is the copy.
RUNNER = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
sys.path.insert(0, sys.argv[1])
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True, no_logo=True))
"""


def package_view(dest: Path) -> Path:
    """ortsparse as the wheel lays it out (tool.scikit-build.wheel.packages), Python sources only."""
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.copytree(ROOT / "python" / "ortsparse", dest / "ortsparse", ignore=skip)
    shutil.copytree(ROOT / "graph_rewrite", dest / "ortsparse" / "graph_rewrite", ignore=skip)
    return dest


def lint(view: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, str(view), str(PYPROJECT)], capture_output=True,
                          text=True, timeout=300)


def test_import_contracts_hold(tmp_path):
    done = lint(package_view(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kept, 0 broken" in done.stdout, done.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("tt.py", "from .measure import corpus", "the rewriter and the offline builders never import the commands"),
    ("runtime/sessions.py", "from .. import cli", "nothing but the entry points imports ortsparse.cli"),
    ("runtime/model_files.py", "from . import feeds", "runtime: capture > feeds > kv_cache"),
    ("runtime/feeds.py", "from . import capture", "runtime: capture > feeds"),
    ("zoo/cache.py", "from . import models", "no import cycles"),
    ("graph_rewrite/targets.py", "from .. import verify", "cli > commands > tuning"),
    ("measure/corpus.py", "from . import perplexity", "measure: whole runs > measurements"),
    ("tuning/selection.py", "from . import tune", "tuning: command > tune"),
    ("zoo/cache.py", "from ..measure import corpus", "cli > commands > tuning"),
    ("calibration/head_placement.py", "from . import allocation", "calibration: allocation > head_placement"),
    ("commands/quality.py", "from . import bench", "commands: studies and commands > quality"),
    ("zoo/builds.py", "from . import models", "zoo: registry > shape builder"),
    ("measure/speed.py", "from .. import tuning", "cli > commands > tuning"),
])
def test_a_new_import_against_a_contract_breaks_it(tmp_path, module, line, contract):
    view = package_view(tmp_path)
    path = view / "ortsparse" / module
    path.write_text(path.read_text() + f"\n{line}  # injected by the test\n")
    done = lint(view)
    assert done.returncode == 1, done.stdout + done.stderr
    assert contract in done.stdout and "BROKEN" in done.stdout, done.stdout
