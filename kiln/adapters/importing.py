"""Import a PEFT adapter folder from anywhere on disk into the store (`kiln serve --lora-modules`,
`/v1/load_lora_adapter` with an outside `lora_path` when the operator allows it).

The folder goes through the same path as an uploaded archive: packed, validated (a LoRA PEFT layout
Kiln can serve), and published atomically under its new name. An adapter already stored under that
name with the same content is kept as it is; one with other content is a 409, never overwritten.
"""

from __future__ import annotations

import io
from pathlib import Path

from kiln.adapters.identity import compute_content_hash
from kiln.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from kiln.adapters.store import AdapterInfo, AdapterStore
from kiln.errors import KilnError
from kiln.store.folder_archive import pack_folder

IMPORT_CODE = "adapter_import_invalid"


def import_adapter_folder(store: AdapterStore, name: str, path: str | Path, *, param: str = "lora_path"
                          ) -> tuple[AdapterInfo, bool]:
    """(info, imported): imported is False when the store already held the same adapter under `name`."""
    folder = Path(path).expanduser()
    store.path(name, param="lora_name")
    if not folder.is_dir():
        raise KilnError(400, IMPORT_CODE, f"{folder} is not a folder", param=param,
                        hint=f"Point at a PEFT adapter folder holding {CONFIG_FILE} and {WEIGHTS_FILE}.")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).is_file():
            raise KilnError(400, IMPORT_CODE, f"{folder} has no {f}", param=param,
                            hint=f"Point at a PEFT adapter folder holding {CONFIG_FILE} and {WEIGHTS_FILE}.")
    if store.exists(name):
        if store.content_hash(name) == compute_content_hash(folder):
            return store.info(name), False
        raise KilnError(409, "adapter_already_exists",
                        f"an adapter named {name!r} is already stored with other content than {folder}",
                        param="lora_name", hint="Pick another name, or DELETE /v1/adapters/{name} first.")
    return store.extract_adapter_archive(io.BytesIO(pack_folder(folder)), name), True


def parse_lora_module(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise KilnError(400, IMPORT_CODE, f"expected NAME=PATH, got {spec!r}", param="lora_modules",
                        hint="Pass --lora-modules my-adapter=/path/to/peft-folder.")
    return name.strip(), path.strip()


def import_lora_modules(store: AdapterStore, specs: list[str]) -> list[str]:
    """Import every NAME=PATH; returns one line per adapter saying what happened."""
    lines = []
    for spec in specs:
        name, path = parse_lora_module(spec)
        info, imported = import_adapter_folder(store, name, path, param="lora_modules")
        verb = "imported" if imported else "already stored:"
        lines.append(f"lora module {verb} {name} <- {path} ({info.content_sha256})")
    return lines


def import_lora_path(store: AdapterStore, name: str, lora_path: str | None, *, allow_external: bool) -> None:
    """vLLM's `/v1/load_lora_adapter` path rule: no `lora_path`, or the stored adapter's own folder,
    loads what is stored; any other folder is imported under `name` only when the operator allows
    it (`server.allow_external_lora_paths`), else 403 `lora_path_not_allowed`."""
    path = store.path(name, param="lora_name")
    if not lora_path or Path(lora_path).resolve() == path.resolve():
        return
    if not allow_external:
        raise KilnError(403, "lora_path_not_allowed",
                        "lora_path outside the adapter directory is not allowed on this server.",
                        param="lora_path",
                        hint="Upload the adapter (POST /v1/adapters/upload) and load it by lora_name, or "
                        "start the server with server.allow_external_lora_paths = true "
                        "(KILN_SERVER_ALLOW_EXTERNAL_LORA_PATHS=1).")
    import_adapter_folder(store, name, lora_path)
