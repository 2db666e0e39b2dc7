"""--event-driven on --event-axis call --event-target attn|both|all with --attn: the 4-D
PopcountAttention ops get the re-encoding mode (reuse_rows=1, reuse_tol = --event-delta-theta);
any other event setting leaves them as they were. The rewritten model still equals the original."""
from __future__ import annotations

import argparse

import attention_graphs as ag
import numpy as np
import onnx
import pytest
from ort_run import run_ortsparse, run_reference


def config(argv):
    from ortsparse.cli import add_rewrite_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_rewrite_arguments(parser)
    return config_from_args(parser.parse_args(["in.onnx", *argv]))


def attention_attributes(argv):
    from ortsparse.graph_rewrite import rewrite_model

    out, report = rewrite_model(ag.onnx_attention(mask="bool"), config(argv))
    nodes = [n for n in out.graph.node if n.op_type == "PopcountAttention"]
    assert len(nodes) == 1
    return out, report, {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}


EVENT_CALL = ["--event-driven", "on", "--event-axis", "call"]


@pytest.mark.parametrize("target", ["attn", "both", "all"])
def test_event_axis_call_on_attention_turns_reencoding_on(target):
    out, report, attrs = attention_attributes(["--attn", "none", *EVENT_CALL, "--event-target", target,
                                               "--event-delta-theta", "0"])
    assert attrs["reuse_rows"] == 1 and attrs["reuse_tol"] == 0.0
    assert report.attention[0].settings.exact  # tolerance 0: still exact attention
    feeds = ag.feeds(ag.onnx_attention(mask="bool"))
    for want, got in zip(run_reference(ag.onnx_attention(mask="bool"), feeds), run_ortsparse(out, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_the_tolerance_is_the_event_delta_theta():
    _, report, attrs = attention_attributes(["--attn", "none", *EVENT_CALL, "--event-target", "attn",
                                             "--event-delta-theta", "0.002"])
    assert attrs["reuse_tol"] == pytest.approx(0.002)
    assert not report.attention[0].settings.exact


@pytest.mark.parametrize("argv", [
    ["--attn", "none"],
    ["--attn", "none", "--event-driven", "on", "--event-axis", "sequence", "--event-target", "attn"],
    ["--attn", "none", *EVENT_CALL, "--event-target", "mlp"],
])
def test_other_settings_leave_the_attention_op_alone(argv):
    _, _, attrs = attention_attributes(argv)
    assert "reuse_rows" not in attrs and "reuse_tol" not in attrs
