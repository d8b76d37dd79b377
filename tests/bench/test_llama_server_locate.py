"""Where `kiln bench` finds llama-server's binary in the build script's cache."""

from __future__ import annotations

from pathlib import Path

from kiln.bench import llama_server


def _binary(root: Path, build: str) -> Path:
    path = root / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / f"build-{build}" / "bin" / "llama-server"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def _isolated(monkeypatch, root: Path) -> None:
    monkeypatch.setenv("LLAMA_SERVER_CACHE", str(root))
    for var in (*llama_server.ENV.values(), llama_server.BUILD_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(root / "no-bin"))   # no llama-server on PATH


def test_the_native_slot_takes_an_avx512_build_before_the_native_one(tmp_path, monkeypatch):
    _isolated(monkeypatch, tmp_path)
    _binary(tmp_path, "native")
    avx512 = _binary(tmp_path, "avx512")
    found = llama_server.locate("native")
    assert found.path == str(avx512) and "ISA=avx512" in found.how


def test_the_native_slot_falls_back_to_the_native_build(tmp_path, monkeypatch):
    _isolated(monkeypatch, tmp_path)
    native = _binary(tmp_path, "native")
    assert llama_server.locate("native").path == str(native)


def test_the_avx2_slot_never_takes_the_avx512_build(tmp_path, monkeypatch):
    _isolated(monkeypatch, tmp_path)
    _binary(tmp_path, "avx512")
    avx2 = _binary(tmp_path, "avx2")
    assert llama_server.locate("avx2").path == str(avx2)


def test_on_an_avx2_only_cpu_the_native_slot_takes_the_avx2_build(tmp_path, monkeypatch):
    _isolated(monkeypatch, tmp_path)
    avx2 = _binary(tmp_path, "avx2")
    found = llama_server.locate("native", best="avx2")
    assert found.path == str(avx2) and "ISA=avx2" in found.how


def test_on_an_avx2_only_cpu_the_native_slot_never_takes_an_avx512_build(tmp_path, monkeypatch):
    _isolated(monkeypatch, tmp_path)
    _binary(tmp_path, "avx512")
    native = _binary(tmp_path, "native")
    assert llama_server.locate("native", best="avx2").path == str(native)
