"""LoRA adapters: the PEFT-format store, compatibility checks, merge, composition and archives.

The API keeps one AdapterStore in `state.services.adapter_store`, the default-adapter holder in
`state.services.adapters_active` and the composition cache in `state.services.adapter_compose_cache`;
the engine resolves a request's adapter against them (kiln.engine.adapter_resolver).

Imports: torch and safetensors (the factors), kiln.core, kiln.model, kiln.store, kiln.config / kiln.errors.
"""

from kiln.adapters.active import ActiveAdapter, model_spec_for
from kiln.adapters.archive import ArchiveLimits
from kiln.adapters.compat import CompatibilityReport, check_compatibility, model_spec_from_config
from kiln.adapters.compose import ComposedAdapter, CompositionCache, compose_modules
from kiln.adapters.merge import MergeSource, merge_adapters
from kiln.adapters.peft_format import LoraConfig, LoraModule, config_dict, parse_lora_config
from kiln.adapters.store import AdapterInfo, AdapterStore, LoadedAdapter

__all__ = [
    "ActiveAdapter", "AdapterInfo", "AdapterStore", "ArchiveLimits", "CompatibilityReport", "ComposedAdapter",
    "CompositionCache", "LoadedAdapter", "LoraConfig", "LoraModule", "MergeSource", "check_compatibility",
    "compose_modules", "config_dict", "merge_adapters", "model_spec_for", "model_spec_from_config",
    "parse_lora_config",
]
