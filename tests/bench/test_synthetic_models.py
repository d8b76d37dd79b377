"""`kiln bench --synthetic SIZE[:TYPE]` (kiln/bench/synthetic_models.py): the spec's parsing, the cache
(each file written once, under a temp name then renamed), where llama-quantize is found, and, where
llama.cpp is built, a real llama-quantize run on the tiny body. The plumbing tests run a FAKE quantizer
(tests/bench/fake_llama_quantize.py) that only copies its input."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from kiln.bench import synthetic_models
from kiln.bench.synthetic_models import SyntheticSpec, file_name, locate_quantize, prepare
from kiln.errors import KilnError

FAKE = Path(__file__).with_name("fake_llama_quantize.py")


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory) -> Path:
    """The tiny body's F16 file, written once for the module by `prepare` into an empty cache (each test
    copies it into its own cache)."""
    return prepare(SyntheticSpec("tiny", "f16"), lambda: pytest.fail("f16 needs no quantizer"),
                   tmp_path_factory.mktemp("f16"), log=lambda _m: None)


@pytest.fixture
def fake_quantize(tmp_path, monkeypatch) -> Path:
    """A runnable fake llama-quantize (this interpreter, then the script) logging to calls.log."""
    wrapper = tmp_path / "bin" / "llama-quantize"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("FAKE_QUANTIZE_LOG", str(tmp_path / "calls.log"))
    return wrapper


def _cache_with_f16(tmp_path: Path, tiny_f16: Path) -> Path:
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(tiny_f16, cache / file_name("tiny", "f16"))
    return cache


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_a_spec_is_a_size_and_a_type_that_defaults_to_q4_k_m() -> None:
    assert SyntheticSpec.parse("1b") == SyntheticSpec("1b", "q4_k_m")
    assert SyntheticSpec.parse("3B:Q6_K") == SyntheticSpec("3b", "q6_k")
    assert SyntheticSpec.parse("8b:f16") == SyntheticSpec("8b", "f16")


@pytest.mark.parametrize("text", ["70b", "1b:q3_k", "1b:", ":q4_k_m", ""])
def test_a_bad_spec_is_a_400_naming_the_option_and_the_choices(text: str) -> None:
    with pytest.raises(KilnError) as e:
        SyntheticSpec.parse(text)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_synthetic", "synthetic")
    assert "0.5b" in e.value.hint and "q6_k" in e.value.hint


def test_the_cli_rejects_a_bad_spec_before_building_anything(capsys, tmp_path, monkeypatch) -> None:
    from kiln.cli import main

    monkeypatch.setenv(synthetic_models.ENV_DIR, str(tmp_path / "cache"))
    assert main(["bench", "--synthetic", "70b"]) == 2
    assert "--synthetic takes SIZE[:TYPE]" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


def test_synthetic_and_model_are_exclusive(capsys) -> None:
    from kiln.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--synthetic", "1b", "--model", "m.gguf"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_help_explains_synthetic(capsys) -> None:
    from kiln.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--synthetic SIZE[:TYPE]" in out and "llama-quantize" in out and "q4_k_m (default)" in out


def test_the_quantized_file_is_made_once_from_the_f16_file_and_then_reused(tmp_path, tiny_f16, fake_quantize):
    cache = _cache_with_f16(tmp_path, tiny_f16)
    found = []
    out = prepare(SyntheticSpec("tiny", "q6_k"), lambda: found.append(1) or str(fake_quantize), cache, threads=2,
                  log=lambda _m: None)
    assert out == cache / file_name("tiny", "q6_k")
    assert out.read_bytes() == b"Q6_K\n" + (cache / file_name("tiny", "f16")).read_bytes()
    assert _calls(tmp_path) == [f"{cache / file_name('tiny', 'f16')} {_temp_of(tmp_path)} Q6_K 2"]
    again = prepare(SyntheticSpec("tiny", "q6_k"), lambda: pytest.fail("no quantizer is needed"), cache,
                    log=lambda _m: None)
    assert again == out and len(_calls(tmp_path)) == 1 and found == [1]
    assert sorted(p.name for p in cache.iterdir()) == sorted([file_name("tiny", "f16"), file_name("tiny", "q6_k")])


def _temp_of(tmp_path: Path) -> str:
    """The output path the quantizer was given: a dot-named temp file beside the final one."""
    out = _calls(tmp_path)[0].split()[1]
    assert Path(out).name.startswith(f".{file_name('tiny', 'q6_k')}.") and out.endswith(".tmp")
    return out


def test_a_missing_f16_file_is_written_by_the_generator(tiny_f16) -> None:
    assert tiny_f16.name == file_name("tiny", "f16")
    assert GGUFReader(str(tiny_f16)).fields["general.file_type"].contents() == 1
    assert [p.name for p in tiny_f16.parent.iterdir()] == [tiny_f16.name]   # no temp file left


def test_a_failed_quantizer_leaves_no_file_that_looks_finished(tmp_path, tiny_f16, fake_quantize, monkeypatch):
    cache = _cache_with_f16(tmp_path, tiny_f16)
    monkeypatch.setenv("FAKE_QUANTIZE_FAIL", "1")
    with pytest.raises(KilnError) as e:
        prepare(SyntheticSpec("tiny", "q4_k_m"), lambda: str(fake_quantize), cache, log=lambda _m: None)
    assert e.value.code == "llama_quantize_failed" and "failed on purpose" in str(e.value)
    assert [p.name for p in cache.iterdir()] == [file_name("tiny", "f16")]   # half a file was removed


def test_without_llama_quantize_the_error_says_how_to_build_it(tmp_path, tiny_f16) -> None:
    cache = _cache_with_f16(tmp_path, tiny_f16)
    with pytest.raises(KilnError) as e:
        prepare(SyntheticSpec("tiny", "q4_k_m"), lambda: None, cache, log=lambda _m: None)
    assert (e.value.status, e.value.code, e.value.param) == (400, "llama_quantize_not_found", "synthetic")
    assert "tools/build-llama-server" in e.value.hint and "--build-llama-server" in e.value.hint
    assert "tools/build-llamacpp quantize" in e.value.hint


def test_a_changed_generator_replaces_its_stale_files(tmp_path, tiny_f16, fake_quantize) -> None:
    cache = _cache_with_f16(tmp_path, tiny_f16)
    stale = cache / file_name("tiny", "q4_k_m", stamp="00000000")
    stale.write_bytes(b"old")
    sidecar = cache / (stale.name + ".kiln-identity.json")
    sidecar.write_text("{}")
    other = cache / file_name("1b", "q4_k_m", stamp="00000000")
    other.write_bytes(b"another size")
    prepare(SyntheticSpec("tiny", "q4_k_m"), lambda: str(fake_quantize), cache, log=lambda _m: None)
    assert not stale.exists() and not sidecar.exists() and other.exists()


def _isolated(monkeypatch, root: Path) -> None:
    monkeypatch.delenv(synthetic_models.ENV_QUANTIZE, raising=False)
    monkeypatch.setenv("PATH", str(root / "no-bin"))


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_llama_quantize_beside_the_llama_server_comes_first(tmp_path, monkeypatch) -> None:
    _isolated(monkeypatch, tmp_path)
    beside = _exe(tmp_path / "mine" / "llama-quantize")
    _exe(tmp_path / "cache" / "v" / "vendor" / "llama.cpp" / "build-native" / "bin" / "llama-quantize")
    found = locate_quantize(str(tmp_path / "mine" / "llama-server"), root=tmp_path / "cache")
    assert found.path == str(beside) and "beside" in found.how


def test_the_environment_variable_overrides_everything(tmp_path, monkeypatch) -> None:
    _isolated(monkeypatch, tmp_path)
    mine = _exe(tmp_path / "q")
    _exe(tmp_path / "srv" / "llama-quantize")
    monkeypatch.setenv(synthetic_models.ENV_QUANTIZE, str(mine))
    assert locate_quantize(str(tmp_path / "srv" / "llama-server")).path == str(mine)


def test_the_caches_llama_quantize_comes_before_the_libllama_harness(tmp_path, monkeypatch) -> None:
    _isolated(monkeypatch, tmp_path)
    base = tmp_path / "v" / "vendor" / "llama.cpp"
    harness = _exe(base / "build-lib-native" / "bin" / "kiln-llama-quantize")
    assert locate_quantize(None, root=tmp_path).path == str(harness)
    server_build = _exe(base / "build-native" / "bin" / "llama-quantize")
    assert locate_quantize(None, root=tmp_path).path == str(server_build)


def test_nothing_found_says_where_it_looked(tmp_path, monkeypatch) -> None:
    _isolated(monkeypatch, tmp_path)
    found = locate_quantize(None, root=tmp_path)
    assert found.path is None and str(tmp_path) in found.how


REAL = locate_quantize()


@pytest.mark.skipif(REAL.path is None, reason="llama.cpp's llama-quantize is not built (tools/build-llamacpp "
                    "quantize or tools/build-llama-server)")
def test_the_real_llama_quantize_makes_a_q4_k_m_file_kiln_loads(tmp_path, tiny_f16) -> None:
    from kiln.model.loader import load_weights

    cache = _cache_with_f16(tmp_path, tiny_f16)
    out = prepare(SyntheticSpec("tiny", "q4_k_m"), lambda: REAL.path, cache, threads=1, log=lambda _m: None)
    reader = GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == 15   # LLAMA_FTYPE_MOSTLY_Q4_K_M
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"] == "Q4_K" and types["token_embd.weight"] == "Q6_K"
    assert "Q6_K" in {types[f"blk.{i}.ffn_down.weight"] for i in range(2)}   # llama.cpp's "more bits"
    weights = load_weights(out, "float32", keep_quantized=True, blocks_only=True)
    assert weights.packed["model.layers.0.mlp.up_proj.weight"].kind == "q4_k"
