"""scripts/demo.sh builds only what it uses and leaves its tuned model where the README says (issue 23)."""
from pathlib import Path

from ortsparse.zoo import builds, models

ROOT = Path(__file__).resolve().parents[2]


def test_the_genai_entry_needs_no_smollm2_exports():
    # the smollm2 entry is ~2.3 GB of full/KV exports the demo never reads
    assert builds.build_order(["genai"], models.MODELS) == ["genai"]


def test_the_demo_writes_a_named_folder_the_readme_names():
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "ortsparse models genai\n" in demo
    assert "-o smollm2-int8-tuned" in demo and "mktemp" in demo  # only the text is temporary
    assert "./smollm2-int8-tuned" in (ROOT / "README.md").read_text()
