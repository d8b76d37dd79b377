"""Upload/download archives: hostile tar.gz files are refused and leave nothing behind."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from kiln.adapters.archive import ArchiveLimits
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError
from tests.adapters.helpers import save_random


@pytest.fixture
def store(tmp_path):
    s = AdapterStore(tmp_path / "adapters")
    save_random(s, "src", r=2, alpha=4, modules=["q_proj"])
    return s


def serving_files(store, name="src") -> dict[str, bytes]:
    d = store.root / name
    return {f: (d / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}


def make_tgz(entries) -> io.BytesIO:
    """entries: (TarInfo, bytes | None) pairs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def file_entry(name: str, data: bytes):
    return tarfile.TarInfo(name), data


def special(name: str, kind: bytes, linkname: str = ""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def valid_entries(store, prefix=""):
    return [file_entry(prefix + k, v) for k, v in serving_files(store).items()]


def assert_rejected(store, fileobj, what=None):
    before = sorted(os.listdir(store.root))
    with pytest.raises(KilnError) as e:
        store.extract_adapter_archive(fileobj, "new")
    assert (e.value.status, e.value.code) == (400, "adapter_import_invalid"), e.value.message
    if what:
        assert what in e.value.message
    assert sorted(os.listdir(store.root)) == before  # no staging dir, no partial adapter


def test_flat_archive_imports(store):
    info = store.extract_adapter_archive(make_tgz(valid_entries(store)), "new")
    assert info.name == "new" and info.has_config and info.has_weights
    assert info.content_sha256 == store.content_hash("src")


def test_archive_with_one_top_level_folder_imports(store):
    store.extract_adapter_archive(make_tgz(valid_entries(store, "whatever/")), "new")
    assert serving_files(store, "new") == serving_files(store)


def test_import_writes_a_fresh_manifest_for_the_new_name(store):
    import json

    store.extract_adapter_archive(make_tgz(valid_entries(store)), "new")
    manifest = json.loads((store.root / "new" / "adapter_manifest.json").read_text())
    assert manifest["adapter_name"] == "new"


def test_download_then_upload_round_trips(store):
    blob = io.BytesIO(b"".join(store.adapter_archive_bytes("src")))
    with tarfile.open(fileobj=blob, mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["src", "src/adapter_config.json", "src/adapter_manifest.json",
                                          "src/adapter_model.safetensors"]
    blob.seek(0)
    store.extract_adapter_archive(blob, "copy")
    assert serving_files(store, "copy") == serving_files(store)
    assert store.content_hash("copy") == store.content_hash("src")


def test_download_skips_symlinks_and_fifos(store, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not leak")
    os.symlink(secret, store.root / "src" / "link.txt")
    os.mkfifo(store.root / "src" / "pipe")
    blob = io.BytesIO(b"".join(store.adapter_archive_bytes("src")))
    with tarfile.open(fileobj=blob, mode="r:gz") as tar:
        names = tar.getnames()
        assert all(m.isreg() or m.isdir() for m in tar.getmembers())
    assert "src/link.txt" not in names and "src/pipe" not in names


@pytest.mark.parametrize("bad", ["../evil", "a/../../evil", "..", "/abs/evil", "\\evil", "C:evil"])
def test_paths_that_escape_are_rejected(store, tmp_path, bad):
    assert_rejected(store, make_tgz([*valid_entries(store), file_entry(bad, b"x")]))
    assert not (tmp_path / "evil").exists() and not (store.root / "evil").exists()


def test_symlinks_are_rejected(store):
    assert_rejected(store, make_tgz([*valid_entries(store), special("link", tarfile.SYMTYPE, "/etc/passwd")]),
                    "symlink")


def test_hard_links_are_rejected(store):
    assert_rejected(store, make_tgz([*valid_entries(store), special("hard", tarfile.LNKTYPE, "adapter_config.json")]),
                    "hard link")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_devices_and_fifos_are_rejected(store, kind):
    assert_rejected(store, make_tgz([*valid_entries(store), special("dev", kind)]))


def test_extracted_size_is_bounded(store):
    store.limits = ArchiveLimits(max_extracted_bytes=1000)
    assert_rejected(store, make_tgz([*valid_entries(store), file_entry("big.bin", b"\0" * 5000)]), "extracted size")


def test_highly_compressible_bomb_is_bounded(store):
    store.limits = ArchiveLimits(max_extracted_bytes=100_000, max_entries=10)
    assert_rejected(store, make_tgz([file_entry("bomb", b"\0" * 2_000_000)]))


def test_compressed_body_is_bounded(store):
    store.limits = ArchiveLimits(max_body_bytes=200)
    assert_rejected(store, make_tgz(valid_entries(store)), "archive exceeds")


def test_entry_count_is_bounded(store):
    store.limits = ArchiveLimits(max_entries=3)
    assert_rejected(store, make_tgz([*valid_entries(store), *(file_entry(f"f{i}", b"") for i in range(3))]),
                    "entries")


def test_duplicate_entries_are_rejected(store):
    assert_rejected(store, make_tgz([*valid_entries(store), file_entry("adapter_config.json", b"{}")]))


def test_not_a_gzip_is_rejected(store):
    assert_rejected(store, io.BytesIO(b"definitely not a tarball"), "tar.gz")


def test_archive_without_serving_files_is_rejected(store):
    assert_rejected(store, make_tgz([file_entry("README.md", b"hi")]), "adapter_config.json")


def test_archive_with_broken_weights_is_rejected(store):
    entries = valid_entries(store)
    entries[1] = file_entry("adapter_model.safetensors", b"garbage")
    assert_rejected(store, make_tgz(entries))


def test_existing_name_is_409(store):
    with pytest.raises(KilnError) as e:
        store.extract_adapter_archive(make_tgz(valid_entries(store)), "src")
    assert (e.value.status, e.value.code) == (409, "adapter_already_exists")


def test_disk_quota_is_507(store):
    store.max_disk_bytes = store.disk_usage() + 10
    with pytest.raises(KilnError) as e:
        store.extract_adapter_archive(make_tgz(valid_entries(store)), "new")
    assert (e.value.status, e.value.code) == (507, "adapter_disk_quota_exceeded")
    assert store.names() == ["src"]
