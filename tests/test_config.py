"""Settings precedence: flags > env > file > defaults; unknown keys rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.config import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_without_file_or_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = load_settings(env={})
    assert (s.server.host, s.server.port) == ("127.0.0.1", 8420)


def test_file_then_env_then_flags(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('[server]\nport = 9001\nhost = "0.0.0.0"\n[engine]\nblock_size = 32\n')
    s = load_settings(cfg, overrides={"server": {"host": "127.0.0.2"}}, env={"KILN_SERVER_PORT": "9002"})
    assert s.server.port == 9002
    assert s.server.host == "127.0.0.2"
    assert s.engine.block_size == 32


def test_unknown_toml_key_is_rejected(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text("[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match="server.prot"):
        load_settings(cfg, env={})


def test_env_booleans_and_unlimited_budget(tmp_path):
    s = load_settings(None, env={"KILN_SERVER_EVAL_MODE": "yes",
                                 "KILN_SERVER_DEFAULT_THINKING_BUDGET_TOKENS": "unlimited",
                                 "KILN_SERVER_DEFAULT_THINKING_BUDGET_MS": "250"})
    assert s.server.eval_mode is True
    assert s.server.default_thinking_budget_tokens == "unlimited"
    assert s.server.default_thinking_budget_ms == 250


def test_bad_value_names_the_setting():
    with pytest.raises(ConfigError, match="server.port"):
        load_settings(None, env={"KILN_SERVER_PORT": "eighty"})


def test_example_config_lists_valid_settings():
    s = load_settings(ROOT / "kiln.example.toml", env={})
    assert s.engine.max_batch_tokens == 512


def test_request_log_and_stats_settings_are_checked():
    s = load_settings(None, env={"KILN_REQUEST_LOG_ENABLED": "on", "KILN_STATS_RECENT_REQUESTS": "7"})
    assert s.request_log.enabled is True and s.stats.recent_requests == 7
    assert s.request_log_dir == Path("./kiln-data") / "requests"
    with pytest.raises(ConfigError, match="request_log.max_file_bytes"):
        load_settings(None, env={"KILN_REQUEST_LOG_MAX_FILE_BYTES": "10"})
    with pytest.raises(ConfigError, match="stats.recent_requests"):
        load_settings(None, env={"KILN_STATS_RECENT_REQUESTS": "0"})


def test_itl_target_is_auto_by_default_and_takes_a_number_from_the_environment(tmp_path):
    assert load_settings(env={}).engine.itl_target_ms == "auto"
    assert load_settings(env={"KILN_ENGINE_ITL_TARGET_MS": "150"}).engine.itl_target_ms == 150.0
    assert load_settings(env={"KILN_ENGINE_ITL_TARGET_MS": "AUTO"}).engine.itl_target_ms == "auto"
    cfg = tmp_path / "k.toml"
    cfg.write_text("[engine]\nitl_target_ms = 0\n")
    assert load_settings(cfg, env={}).engine.itl_target_ms == 0.0


@pytest.mark.parametrize("bad", ["fast", "-5"])
def test_itl_target_rejects_what_is_neither_a_number_nor_auto(bad):
    with pytest.raises(ConfigError, match="itl_target_ms"):
        load_settings(env={"KILN_ENGINE_ITL_TARGET_MS": bad})
