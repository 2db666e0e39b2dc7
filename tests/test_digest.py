"""The file digest has one home (ortsparse.digest): model manifests and the genai folder record use it."""
from __future__ import annotations

import hashlib

from ortsparse import digest
from ortsparse.graph_rewrite import genai
from ortsparse.harness import builds


def test_sha256_reads_the_whole_file_in_chunks(tmp_path):
    path = tmp_path / "blob"
    data = bytes(range(256)) * ((1 << 22) // 256 * 2 + 7)  # more than two 4 MiB chunks, a partial last one
    path.write_bytes(data)
    assert digest.sha256(path) == hashlib.sha256(data).hexdigest()
    assert digest.sha256(str(path)) == hashlib.sha256(data).hexdigest()


def test_manifests_and_genai_folders_use_the_one_digest():
    assert builds.sha256 is digest.sha256
    assert genai.sha256 is digest.sha256
