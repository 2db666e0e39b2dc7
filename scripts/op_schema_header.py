"""Rewrite ops/ort/op_schema.h from graph_rewrite/op_schema.json (run from the repository root after
editing the schema; tests/graph_rewrite/test_op_schema.py fails while the header is stale)."""
import sys

from ortsparse.graph_rewrite.op_schema import main

if __name__ == "__main__":
    sys.exit(main(["--write", "."]))
