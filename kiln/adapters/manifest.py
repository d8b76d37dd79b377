"""adapter_manifest.json (semantics.md §7.2): file hashes and lineage written next to the adapter."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kiln.adapters.identity import file_hash
from kiln.adapters.peft_format import CONFIG_FILE, MANIFEST_FILE, RECEIPT_FILE, WEIGHTS_FILE

SCHEMA_VERSION = 1
MANIFEST_TYPE = "kiln_adapter_manifest"
LINEAGE_KEYS = (
    "parent_adapter", "model_config_hash", "training_chat_template_hash", "base_weight_shard_manifest",
    "execution_provenance", "training_precision", "kiln_commit", "training_data_hash",
    "training_data_source", "training_data_path", "merge",
)
_SHA = re.compile(r"^sha256:[0-9a-f]{64}$")


def build_manifest(name: str, adapter_dir: Path, lineage: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hash the files as they are in `adapter_dir`; call after they are fully written."""
    files: dict[str, str] = {"adapter_model": WEIGHTS_FILE, "adapter_config": CONFIG_FILE}
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "manifest_type": MANIFEST_TYPE,
        "adapter_name": name,
        "safetensors_hash": file_hash(adapter_dir / WEIGHTS_FILE),
        "config_hash": file_hash(adapter_dir / CONFIG_FILE),
    }
    if (adapter_dir / RECEIPT_FILE).is_file():
        manifest["receipt_hash"] = file_hash(adapter_dir / RECEIPT_FILE)
        files["train_receipt"] = RECEIPT_FILE
    manifest["files"] = files
    manifest["lineage"] = {k: v for k, v in (lineage or {}).items() if k in LINEAGE_KEYS and v is not None}
    return manifest


def read_manifest(adapter_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None), (None, None) when absent, or (None, why) when malformed. Never re-hashes."""
    path = adapter_dir / MANIFEST_FILE
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST_FILE} is not valid JSON: {e}"
    problem = _manifest_problem(data)
    return (None, problem) if problem else (data, None)


def _manifest_problem(data: Any) -> str | None:
    if not isinstance(data, dict):
        return f"{MANIFEST_FILE} must be a JSON object"
    if data.get("schema_version") != SCHEMA_VERSION:
        return f"unsupported schema_version {data.get('schema_version')!r} (expected {SCHEMA_VERSION})"
    if data.get("manifest_type") != MANIFEST_TYPE:
        return f"manifest_type must be {MANIFEST_TYPE!r}"
    for key in ("safetensors_hash", "config_hash"):
        if not isinstance(data.get(key), str) or not _SHA.match(data[key]):
            return f"{key} must be 'sha256:' followed by 64 lowercase hex digits"
    if "receipt_hash" in data and not (isinstance(data["receipt_hash"], str) and _SHA.match(data["receipt_hash"])):
        return "receipt_hash must be 'sha256:' followed by 64 lowercase hex digits"
    if not isinstance(data.get("files"), dict):
        return "files must be an object"
    if "lineage" in data and not isinstance(data["lineage"], dict):
        return "lineage must be an object"
    return None
