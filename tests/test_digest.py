"""The file digest has one home (ortsparse.digest): model manifests and the genai folder record use it."""
from __future__ import annotations

import hashlib

from ortsparse import digest
from ortsparse.graph_rewrite import genai
from ortsparse.zoo import builds


def test_sha256_reads_the_whole_file_in_chunks(tmp_path):
    path = tmp_path / "blob"
    data = bytes(range(256)) * ((1 << 22) // 256 * 2 + 7)  # more than two 4 MiB chunks, a partial last one
    path.write_bytes(data)
    assert digest.sha256(path) == hashlib.sha256(data).hexdigest()
    assert digest.sha256(str(path)) == hashlib.sha256(data).hexdigest()


def test_a_rewritten_genai_folder_records_its_library_copys_digest(tmp_path):
    """What ortsparse.json records is the sha256 of the library file copied beside the model."""
    import json
    from pathlib import Path

    from ortsparse.graph_rewrite import RewriteConfig

    source = Path(__file__).resolve().parents[1] / "models" / "tiny" / "llama_tiny_genai"
    written = genai.rewrite_genai_folder(source, tmp_path / "out", RewriteConfig())
    record = json.loads((written.folder / "ortsparse.json").read_text())
    library = written.folder / record["library"]
    assert record["library_sha256"] == hashlib.sha256(library.read_bytes()).hexdigest()


def test_build_manifests_record_the_files_digest(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"not really a model, but bytes to digest")
    assert builds.sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
