"""Quality at the point of use (measure.answer_quality): windows spread over the text, only answer
steps scored, pooled dppl with a t-interval over windows."""
import math
from pathlib import Path

import numpy as np
import pytest

from ortsparse.measure import answer_quality as aq
from ortsparse.measure.decode import open_stepper

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
GENAI = TINY / "llama_tiny_genai"


def test_windows_spread_from_the_start_to_the_end_of_the_text():
    plan = aq.plan_answer_windows(1000, prefix=100, answer=20, windows=5)
    assert plan.offsets[0] == 0 and plan.offsets[-1] == 1000 - plan.span
    assert not plan.overlapping and all(b - a >= plan.span for a, b in zip(plan.offsets, plan.offsets[1:]))
    assert aq.plan_answer_windows(300, prefix=100, answer=20, windows=5).overlapping


@pytest.mark.parametrize("kwargs, message", [
    ({"prefix": 900, "answer": 200, "windows": 2}, "needs 1101"),
    ({"prefix": 100, "answer": 20, "windows": 2, "max_positions": 64}, "the model holds 64"),
    ({"prefix": 0, "answer": 20, "windows": 2}, "--prefix >= 1"),
])
def test_windows_that_do_not_fit_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        aq.plan_answer_windows(1000, **kwargs)
    assert "\n" not in str(error.value)


def test_summary_pools_answer_steps_and_gives_a_t_interval():
    rows = [{"nll_reference": 2.0, "nll_candidate": 2.0 + d, "top1": t} for d, t in ((0.01, 0.9), (0.03, 0.8), (0.02, 1.0))]
    out = aq.summarize(rows)
    assert out["dppl"] == pytest.approx(math.expm1(0.02))
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t(0.975, 2) x sd / sqrt(n)
    assert out["dppl_low"] == pytest.approx(math.expm1(0.02 - half))
    assert out["dppl_high"] == pytest.approx(math.expm1(0.02 + half))
    assert out["top1_agreement"] == pytest.approx(0.9) and out["top1_worst_window"] == 0.8
    assert aq.summarize(rows[:1])["dppl_low"] is None


def test_a_model_against_itself_is_exact_at_the_point_of_use():
    tokens = np.random.default_rng(3).integers(0, 256, size=200)
    plan = aq.plan_answer_windows(tokens.size, prefix=40, answer=8, windows=3)
    result = aq.answer_quality(open_stepper(GENAI, "og", 1), open_stepper(GENAI, "og", 1), tokens, plan)
    assert result["dppl"] == 0.0 and result["top1_agreement"] == 1.0
    assert [w["offset"] for w in result["per_window"]] == list(plan.offsets)
    assert "no prompt position" in result["scored"]
    assert "3 x 8 answer tokens" in aq.describe(result)


def test_a_changed_model_shows_at_the_point_of_use(tmp_path):
    from ortsparse.graph_rewrite import KwtaSettings, RewriteConfig, TechniqueChoice
    from ortsparse.graph_rewrite.genai import rewrite_genai_folder

    config = RewriteConfig(techniques={"kwta": TechniqueChoice(KwtaSettings(k_frac=0.3), enabled=True, target="all")})
    gated = rewrite_genai_folder(GENAI, tmp_path / "gated", config).folder
    tokens = np.random.default_rng(4).integers(0, 256, size=200)
    plan = aq.plan_answer_windows(tokens.size, prefix=40, answer=8, windows=2)
    result = aq.answer_quality(open_stepper(GENAI, "og", 1), open_stepper(gated, "og", 1), tokens, plan)
    assert result["dppl"] != 0.0
    assert all(w["nll_candidate"] != w["nll_reference"] for w in result["per_window"])


def test_quality_command_scores_answers_after_prompts(tmp_path, capsys):
    import json

    from ortsparse.cli import main

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(3000)))
    report = tmp_path / "answer.json"
    code = main(["quality", str(GENAI), "--text", str(text), "--prefix", "40", "--answer", "8", "--windows", "2",
                 "--kwta-k", "0.3", "--kwta-target", "all", "--json", str(report)])
    assert code == 0
    result = json.loads(report.read_text())["result"]
    assert result["kind"] == "answer" and result["runner"] == "og" and len(result["per_window"]) == 2
    assert result["prefix"] == 40 and result["answer"] == 8 and result["dppl"] != 0.0
    assert "answer quality after 40-token prompts" in capsys.readouterr().out
    assert main(["quality", str(GENAI), "--text", str(text), "--prefix", "40", "--answer", "8", "--windows", "2",
                 "--kwta-k", "0.3", "--max-dppl", "-1"]) == 1


def test_quality_command_refuses_windows_past_the_text_in_one_line(tmp_path, capsys):
    from ortsparse.cli import main

    text = tmp_path / "text.txt"
    text.write_text("a few words only")
    assert main(["quality", str(GENAI), "--text", str(text), "--prefix", "40", "--answer", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 49" in err[0]


def test_the_frontier_script_reports_every_setting_at_every_prefix(tmp_path):
    import importlib.util
    import json

    script = Path(__file__).resolve().parents[2] / "bench" / "answer_quality_frontier.py"
    spec = importlib.util.spec_from_file_location("answer_quality_frontier", script)
    frontier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(frontier)
    stem = tmp_path / "frontier"
    assert frontier.main([str(GENAI), "--settings", "exact=--attn=none", "gated=--kwta-k 0.3 --kwta-target all",
                          "--prefixes", "30", "40", "--windows", "2", "--answer", "6", "-o", str(stem)]) == 0
    rows = json.loads(stem.with_suffix(".json").read_text())["rows"]
    assert [(r["prefix"], r["setting"]) for r in rows] == [(30, "exact"), (30, "gated"), (40, "exact"), (40, "gated")]
    exact = [r for r in rows if r["setting"] == "exact"]
    assert all(r["top1_agreement"] == 1.0 and abs(r["dppl"]) < 1e-3 for r in exact)  # exact attention in our op
    assert any(r["dppl"] != 0.0 for r in rows if r["setting"] == "gated")


def test_selection_counters_of_the_answer_steps_are_read_with_one_candidate():
    """The op's counters of the answer steps (the cost proxy) come with the figures of a lone
    candidate; several candidates share node names, so none are read then."""
    total = {"keys_total": 1000.0, "pack.keys_exact_ratio": 0.25, "pages.visited_ratio": 0.2,
             "pages.certified_ratio": 0.5, "event.heads_ranked": 3.0, "event.reused_certified": 1.0,
             "event.reused_budget": 0.0}
    got = aq.decode_selection({aq.SELECTION_OP: total, "total/KwtaBlockMatMul": {"keys_total": 0}})
    assert got["keys_read"] == 0.25 and got["pages_certified"] == 0.5 and got["event_ranked"] == 3.0
    assert aq.decode_selection({}) == {} and aq.decode_selection({aq.SELECTION_OP: {"keys_total": 0}}) == {}


def test_a_lone_frontier_setting_reports_what_its_selector_read(tmp_path):
    """One setting: the Generator loads the very library this process reads counters from
    (share_library), so the report carries the keys each head read per answer step."""
    import importlib.util
    import json

    script = Path(__file__).resolve().parents[2] / "bench" / "answer_quality_frontier.py"
    spec = importlib.util.spec_from_file_location("answer_quality_frontier", script)
    frontier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(frontier)
    stem = tmp_path / "frontier"
    flags = ("--attn=pages --attn-topk 4 --attn-candidates 4 --attn-keep-first 1 --attn-keep-recent 4 "
             "--attn-min-keys 0 --attn-mass-eps 0.05")
    assert frontier.main([str(GENAI), "--settings", f"mass={flags}", "--prefixes", "60", "--windows", "2",
                          "--answer", "6", "-o", str(stem)]) == 0
    (row,) = json.loads(stem.with_suffix(".json").read_text())["rows"]
    assert 0.0 < row["selection_keys_read"] < 1.0  # selection ran on the answer steps and skipped keys
    assert all(0.0 <= w["pages_certified"] <= 1.0 for w in row["per_window"])
    assert "of the cached keys per head and step" in aq.describe(row)


def test_the_frontier_names_the_certificates_that_were_on():
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "bench" / "answer_quality_frontier.py"
    spec = importlib.util.spec_from_file_location("answer_quality_frontier", script)
    frontier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(frontier)
    row = {"selection_event_ranked": 10.0, "selection_event_reused_certified": 3.0,
           "selection_event_reused_budget": 0.0, "selection_prefill_skipped": 0.25}
    assert frontier.certificates(row) == "event: 3 certified, 0 budget, 10 ranked; prefill skipped 25.0% of tiles"
    assert frontier.certificates({"selection_event_ranked": 0.0, "selection_event_reused_certified": 0.0,
                                  "selection_event_reused_budget": 0.0}) == ""
