"""The bench reads the model's parameter count from its tensor table, to pick its targets."""

from __future__ import annotations

import json
import struct

from kiln.bench.model_size import describe_parameters, parameter_count
from kiln.bench.synthetic_gguf import write_synthetic_gguf


def test_a_gguf_counts_every_tensors_elements(tmp_path):
    from kiln.model.gguf_file import read_gguf_tensor_infos
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "tiny", "f16")
    infos = read_gguf_tensor_infos(path)
    want = 0
    for t in infos:
        n = 1
        for d in t.shape:
            n *= d
        want += n
    assert parameter_count(path) == want > 0


def test_a_safetensors_directory_counts_its_headers_shapes(tmp_path):
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(68))
    assert parameter_count(tmp_path) == 17


def test_anything_else_has_no_count(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    assert parameter_count(tmp_path / "broken.gguf") is None
    assert parameter_count(tmp_path / "missing.gguf") is None
    assert parameter_count(tmp_path) is None


def test_counts_read_as_people_write_them():
    assert describe_parameters(1_235_814_400) == "1.24B"
    assert describe_parameters(134_515_008) == "135M"
