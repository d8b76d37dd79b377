"""The detail view of one stored adapter: its manifest, PEFT config, tensor layout and compatibility
with the served model (`GET /v1/adapters/{name}/detail`, the dashboard's adapter page)."""

from __future__ import annotations

from typing import Any

from kiln.adapters.compat import check_compatibility
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError


def adapter_detail_body(store: AdapterStore, name: str, active_name: str | None,
                        model_spec: dict | None) -> dict[str, Any]:
    """What `GET /v1/adapters/{name}/detail` answers: the listing entry, whether it is the default, its
    PEFT config and layout (modules by layer), and its compatibility with the served model; a layout
    the store cannot load is reported as `layout_error`, not raised."""
    out = store.info(name).to_dict()
    out["active"] = name == active_name
    try:
        loaded = store.load_adapter(name)
    except KilnError as e:
        if e.status != 400:
            raise
        out["layout_error"] = e.message
        return out
    cfg = loaded.config
    modules: dict[str, list[int]] = {}
    for layer, module in sorted(loaded.modules):
        modules.setdefault(module, []).append(layer)
    out.update({
        "config": cfg.raw,
        "rank": cfg.r,
        "lora_alpha": cfg.lora_alpha,
        "use_rslora": cfg.use_rslora,
        "target_modules": list(cfg.target_modules) if isinstance(cfg.target_modules, tuple) else cfg.target_modules,
        "dtype": loaded.dtype,
        "num_tensors": loaded.num_tensors,
        "num_layers": len({layer for layer, _ in loaded.modules}),
        "modules": modules,
    })
    if model_spec is not None:
        try:
            out["compatibility"] = check_compatibility(loaded, model_spec).to_dict()
        except KilnError as e:
            out["compatibility"] = {"compatible": False, "error": e.message}
    return out
