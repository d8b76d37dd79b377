"""The adapter directory: one folder per adapter in PEFT's format, published atomically.

Writers build an adapter in a hidden staging dir inside the adapter dir (same filesystem), fsync every
file, then rename the folder into place: a reader sees the whole adapter or none of it. Hidden
entries (".tmp-*", ".trash-*", ".old-*", ".composed", ".eval", ...) are never listed. Replacing an
adapter moves the old folder to ".old-<hex>-<name>" first: should a kill land between the two renames,
the startup sweep (`sweep`) puts it back; every other scratch entry is deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kiln.adapters.archive import ArchiveLimits, extract_tar_gz, import_error, iter_tar_gz
from kiln.adapters.identity import HashCache, compute_content_hash
from kiln.adapters.manifest import build_manifest, read_manifest
from kiln.adapters.peft_format import (
    CONFIG_FILE,
    LAYOUT_INVALID,
    MANIFEST_FILE,
    RECEIPT_FILE,
    WEIGHTS_FILE,
    LoraConfig,
    LoraModule,
    ModuleKey,
    config_dict,
    group_modules,
    layout_error,
    parse_lora_config,
    peft_key,
)
from kiln.errors import KilnError
from kiln.store.atomic import atomic_write_json, fsync_path
from kiln.store.names import name_problem, validate_name
from kiln.store.sweep import remove_path, sweep_temp_files

NAME_CODE = "invalid_adapter_name"
STALE_STAGING_SECS = 6 * 3600
SCRATCH = (".tmp-", ".trash-", ".old-")


@dataclass
class AdapterInfo:
    name: str
    has_config: bool
    has_weights: bool
    size_bytes: int
    modified_at: str  # RFC 3339 UTC
    files: list[str]
    content_sha256: str | None
    manifest: dict[str, Any] | None = None
    adapter_manifest_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("manifest", "adapter_manifest_error", "content_sha256"):
            if out[key] is None:
                del out[key]
        return out


@dataclass
class LoadedAdapter:
    name: str
    config: LoraConfig
    modules: dict[ModuleKey, LoraModule]
    content_sha256: str
    dtype: str
    num_tensors: int = field(default=0)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            p = Path(dirpath, f)
            if p.is_file() and not p.is_symlink():
                fsync_path(p)
        fsync_path(Path(dirpath))


class AdapterStore:
    def __init__(self, root: str | Path, *, limits: ArchiveLimits | None = None,
                 max_disk_bytes: int = 100 << 30) -> None:
        self.root = Path(root)
        self.limits = limits or ArchiveLimits()
        self.max_disk_bytes = max_disk_bytes
        self._lock = threading.RLock()
        self._hashes = HashCache()
        self._remove_stale_staging()

    # -- names and paths ------------------------------------------------------------------------
    def path(self, name: object, *, param: str = "name") -> Path:
        return self.root / validate_name(name, kind="adapter", param=param, code=NAME_CODE)

    def exists(self, name: str) -> bool:
        return self.path(name).is_dir()

    def require(self, name: object, *, param: str = "name") -> Path:
        path = self.path(name, param=param)
        if not path.is_dir():
            raise KilnError(404, "adapter_not_found", f"Adapter {name!r} not found.", param=param,
                            hint="GET /v1/adapters lists the saved adapters.")
        return path

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(e.name for e in os.scandir(self.root)
                      if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))

    # -- listing ----------------------------------------------------------------------------------
    def info(self, name: str) -> AdapterInfo:
        path = self.require(name)
        files: list[str] = []
        size = 0
        newest = path.stat().st_mtime
        for dirpath, _, filenames in os.walk(path):
            for f in filenames:
                p = Path(dirpath, f)
                st = p.lstat()
                if not p.is_file() or p.is_symlink():
                    continue
                files.append(p.relative_to(path).as_posix())
                size += st.st_size
                newest = max(newest, st.st_mtime)
        has_config, has_weights = (path / CONFIG_FILE).is_file(), (path / WEIGHTS_FILE).is_file()
        manifest, manifest_error = read_manifest(path)
        return AdapterInfo(
            name=name, has_config=has_config, has_weights=has_weights, size_bytes=size,
            modified_at=_iso(newest), files=sorted(files),
            content_sha256=self.content_hash(name) if has_config and has_weights else None,
            manifest=manifest, adapter_manifest_error=manifest_error,
        )

    def list(self) -> list[AdapterInfo]:
        out = []
        for name in self.names():
            try:
                out.append(self.info(name))
            except (KilnError, FileNotFoundError):
                continue  # invalid name on disk, or deleted while we listed
        return out

    def disk_usage(self) -> int:
        total = 0
        if not self.root.is_dir():
            return 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            if Path(dirpath) == self.root:
                dirnames[:] = [d for d in dirnames if not d.startswith(SCRATCH)]
            for f in filenames:
                with suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(dirpath, f)).st_size
        return total

    # -- reading ----------------------------------------------------------------------------------
    def content_hash(self, name: str) -> str:
        """`sha256:` content identity (identity.py), cached until the serving files change."""
        path = self.require(name)
        files = [path / CONFIG_FILE, path / WEIGHTS_FILE]
        for f in files:
            if not f.is_file():
                raise layout_error(f"adapter {name!r} has no {f.name}", param=f.name)
        return self._hashes.get("content", path, files, lambda: compute_content_hash(path))

    def read_config(self, name: str) -> LoraConfig:
        path = self.require(name) / CONFIG_FILE
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise layout_error(f"adapter {name!r} has no {CONFIG_FILE}", param=CONFIG_FILE) from None
        except ValueError as e:
            raise layout_error(f"{CONFIG_FILE} of {name!r} is not valid JSON: {e}", param=CONFIG_FILE) from None
        return parse_lora_config(data)

    def read_peft_tensors(self, name: str) -> dict[str, torch.Tensor]:
        path = self.require(name) / WEIGHTS_FILE
        try:
            return load_file(path)
        except FileNotFoundError:
            raise layout_error(f"adapter {name!r} has no {WEIGHTS_FILE}", param=WEIGHTS_FILE) from None
        except (SafetensorError, OSError, ValueError) as e:
            raise layout_error(f"{WEIGHTS_FILE} of {name!r} cannot be read: {e}", param=WEIGHTS_FILE) from None

    def load_adapter(self, name: str) -> LoadedAdapter:
        revision = self.content_hash(name)
        config = self.read_config(name)
        tensors = self.read_peft_tensors(name)
        modules = group_modules(tensors, config)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
        return LoadedAdapter(name, config, modules, revision, ",".join(dtypes), len(tensors))

    def load_lora_tensors(self, name: str) -> dict[ModuleKey, LoraModule]:
        """(layer, module) -> (A [r, in], B [out, r], scale) with scale = alpha/r, or alpha/sqrt(r) (rslora)."""
        return self.load_adapter(name).modules

    # -- writing ----------------------------------------------------------------------------------
    def save_adapter(self, name: str, tensors: Mapping[Any, Any], config: LoraConfig | Mapping[str, Any],
                     receipt: Mapping[str, Any] | None = None, *, lineage: Mapping[str, Any] | None = None,
                     overwrite: bool = False) -> AdapterInfo:
        """Write an adapter atomically.

        `tensors` is either PEFT keys -> Tensor, or (layer, module) -> (A, B[, scale]); the scale in a
        triple is ignored because the config's r/lora_alpha define it. With `overwrite` an existing
        adapter is replaced (it is briefly absent, never half-written).
        """
        self.path(name)
        config_data = _config_data(config)
        parsed = parse_lora_config(config_data)
        peft = _as_peft_tensors(tensors)
        group_modules(peft, parsed)  # refuse to write what we could not load back
        if not overwrite and self.exists(name):
            raise _exists(name)
        with self._staging() as staging:
            save_file(peft, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
            (staging / CONFIG_FILE).write_text(json.dumps(config_data, indent=2) + "\n")
            if receipt is not None:
                (staging / RECEIPT_FILE).write_text(json.dumps(dict(receipt), indent=2) + "\n")
            (staging / MANIFEST_FILE).write_text(
                json.dumps(build_manifest(name, staging, dict(lineage or {})), indent=2) + "\n")
            self._publish(staging, name, overwrite=overwrite)
        return self.info(name)

    def delete(self, name: str) -> None:
        path = self.require(name)
        with self._lock:
            trash = self.root / f".trash-{uuid.uuid4().hex}"
            os.rename(path, trash)
            fsync_path(self.root)
        self._hashes.forget(path)
        shutil.rmtree(trash, ignore_errors=True)

    # -- archives ---------------------------------------------------------------------------------
    def extract_adapter_archive(self, fileobj: BinaryIO, dest_name: str, *, replace: bool = False,
                                check: Callable[[LoadedAdapter], None] | None = None) -> AdapterInfo:
        """Import an uploaded tar.gz (a top-level folder or flat files) as adapter `dest_name`.

        With `replace` an adapter already stored under the name is swapped for the new one in one rename,
        only after the new one is extracted, validated and has passed `check` (given the new adapter as
        loaded): any failure before the swap leaves the stored revision exactly as it was.
        """
        self.path(dest_name)
        if not replace and self.exists(dest_name):
            raise _exists(dest_name)
        with self._staging() as staging:
            extracted = extract_tar_gz(fileobj, staging, self.limits)
            adapter_root = _adapter_root(staging)
            _validate_import(adapter_root)
            if self.disk_usage() + extracted > self.max_disk_bytes:
                raise KilnError(507, "adapter_disk_quota_exceeded",
                                f"Storing {extracted} more bytes would exceed the adapter disk quota "
                                f"of {self.max_disk_bytes} bytes.",
                                param="archive", hint="Delete unused adapters (DELETE /v1/adapters/{name}).")
            old, _ = read_manifest(adapter_root)
            lineage = old.get("lineage") if old else None
            atomic_write_json(adapter_root / MANIFEST_FILE,
                              build_manifest(dest_name, adapter_root, lineage if isinstance(lineage, dict) else None))
            if check is not None:
                check(_load_folder(adapter_root, dest_name))
            self._publish(adapter_root, dest_name, overwrite=replace)
        return self.info(dest_name)

    def adapter_archive_bytes(self, name: str) -> Iterator[bytes]:
        """tar.gz of the adapter folder (as `<name>/...`), streamed; regular files only."""
        return iter_tar_gz(self.require(name), name)

    # -- internals --------------------------------------------------------------------------------
    @contextmanager
    def _staging(self) -> Iterator[Path]:
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".tmp-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            yield staging
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def _publish(self, staged: Path, name: str, *, overwrite: bool) -> None:
        _fsync_tree(staged)
        dest = self.root / name
        with self._lock:
            trash = None
            if dest.exists():
                if not overwrite:
                    raise _exists(name)
                trash = self.root / f".old-{uuid.uuid4().hex}-{name}"
                os.rename(dest, trash)
            try:
                os.rename(staged, dest)
            except OSError:
                if trash is not None:
                    os.rename(trash, dest)
                raise
            fsync_path(self.root)
        self._hashes.forget(dest)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def _remove_stale_staging(self) -> None:
        # Left by a crash mid-write; young ones may belong to another live store on the same dir.
        if not self.root.is_dir():
            return
        cutoff = time.time() - STALE_STAGING_SECS
        for entry in os.scandir(self.root):
            if entry.name.startswith((".tmp-", ".trash-")) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                shutil.rmtree(entry.path, ignore_errors=True)

    def sweep(self) -> list[str]:
        """Startup sweep: every staging and trash folder goes; an old copy whose adapter is missing (a
        replace killed between its renames) is put back, any other old copy goes."""
        done: list[str] = []
        if not self.root.is_dir():
            return done
        with self._lock:
            for entry in sorted(os.listdir(self.root)):
                path = self.root / entry
                if entry.startswith(".old-"):
                    name = entry[len(".old-") + 33:]
                    dest = self.root / name
                    if len(entry) > len(".old-") + 33 and name_problem(name) is None and not dest.exists():
                        os.rename(path, dest)
                        fsync_path(self.root)
                        self._hashes.forget(dest)
                        done.append(f"restored {dest} from {entry}")
                        continue
                if entry.startswith(SCRATCH):
                    remove_path(path)
                    done.append(f"removed {path}")
            # the default adapter's record (active.py) is written atomically beside the adapters
            done.extend(sweep_temp_files(self.root))
        return done


def _exists(name: str) -> KilnError:
    return KilnError(409, "adapter_already_exists", f"Adapter {name!r} already exists.", param="name",
                     hint="Pick another name, or DELETE /v1/adapters/{name} first.")


def _config_data(config: LoraConfig | Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(config, LoraConfig):
        return dict(config)
    if config.raw:
        return dict(config.raw)
    targets = config.target_modules
    data = config_dict(config.r, config.lora_alpha, list(targets) if isinstance(targets, tuple) else [],
                       use_rslora=config.use_rslora, base_model_name_or_path=config.base_model_name_or_path)
    if isinstance(targets, str):
        data["target_modules"] = targets
    if config.rank_pattern:
        data["rank_pattern"] = dict(config.rank_pattern)
    if config.alpha_pattern:
        data["alpha_pattern"] = dict(config.alpha_pattern)
    return data


def _as_peft_tensors(tensors: Mapping[Any, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if isinstance(key, str):
            out[key] = value.detach().to("cpu").contiguous().clone()
            continue
        layer, module = key
        a, b = value[0], value[1]
        out[peft_key(int(layer), module, "A")] = a.detach().to("cpu").contiguous().clone()
        out[peft_key(int(layer), module, "B")] = b.detach().to("cpu").contiguous().clone()
    return out


def _adapter_root(staging: Path) -> Path:
    """Flat files, or one top-level folder holding them (the way `tar czf x.tgz my-adapter/` packs)."""
    if (staging / CONFIG_FILE).exists():
        return staging
    entries = [e for e in staging.iterdir()]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return staging


def _load_folder(root: Path, name: str) -> LoadedAdapter:
    """A staged (validated) adapter folder as `load_adapter` would load it once stored as `name`."""
    config = parse_lora_config(json.loads((root / CONFIG_FILE).read_bytes()), code="adapter_import_invalid")
    tensors = load_file(root / WEIGHTS_FILE)
    modules = group_modules(tensors, config, code="adapter_import_invalid")
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return LoadedAdapter(name, config, modules, compute_content_hash(root), ",".join(dtypes), len(tensors))


def _validate_import(root: Path) -> None:
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (root / f).is_file():
            raise import_error(f"no {f} at the top level or inside a single top-level folder")
    try:
        config = parse_lora_config(json.loads((root / CONFIG_FILE).read_bytes()), code="adapter_import_invalid")
    except ValueError as e:
        raise import_error(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    try:
        tensors = load_file(root / WEIGHTS_FILE)
    except (SafetensorError, OSError, ValueError) as e:
        raise import_error(f"{WEIGHTS_FILE} cannot be read: {e}") from None
    group_modules(tensors, config, code="adapter_import_invalid")


__all__ = ["AdapterInfo", "AdapterStore", "ArchiveLimits", "LoadedAdapter", "LAYOUT_INVALID", "NAME_CODE"]
