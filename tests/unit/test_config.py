"""Settings.from_env: documented defaults, and a ConfigError naming the variable for every
invalid value."""

from __future__ import annotations

import os
import socket

import pytest

from runtime.config import ConfigError, Settings

INT_SETTINGS = {
    # variable: (minimum, attribute)
    "DAR_MAX_TOKENS": (1, "max_tokens"),
    "DAR_DEFAULT_MAX_STEPS": (1, "default_max_steps"),
    "DAR_MAX_CLAIMS_WITHOUT_PROGRESS": (1, "max_claims_without_progress"),
    "DAR_RETRY_MAX_ATTEMPTS": (1, "retry_max_attempts"),
    "DAR_DEMO_LATENCY_MS": (0, "demo_latency_ms"),
    "DAR_MAX_BODY_BYTES": (1024, "max_body_bytes"),
    "DAR_MAX_INPUT_CHARS": (1, "max_input_chars"),
    "DAR_DEFAULT_TOKEN_BUDGET": (1, "default_token_budget"),
    "DAR_MAX_TOKEN_BUDGET": (1, "max_token_budget"),
    "DAR_DEFAULT_TIMEOUT_SECONDS": (1, "default_timeout_seconds"),
    "DAR_MAX_TIMEOUT_SECONDS": (1, "max_timeout_seconds"),
}
NUM_SETTINGS = {
    "DAR_LEASE_SECONDS": (1, "lease_seconds"),
    "DAR_HEARTBEAT_SECONDS": (0.1, "heartbeat_seconds"),
    "DAR_REDISPATCH_AFTER_SECONDS": (1, "redispatch_after_seconds"),
    "DAR_REAPER_INTERVAL_SECONDS": (0.1, "reaper_interval_seconds"),
    "DAR_VISIBILITY_TIMEOUT_SECONDS": (60, "visibility_timeout_seconds"),
    "DAR_MODEL_TIMEOUT_SECONDS": (1, "model_timeout_seconds"),
    "DAR_RETRY_BASE_SECONDS": (0, "retry_base_seconds"),
    "DAR_RETRY_CAP_SECONDS": (0, "retry_cap_seconds"),
    "DAR_LONG_WAIT_SECONDS": (0, "long_wait_seconds"),
    "DAR_MAX_COUNTDOWN_SECONDS": (0, "max_countdown_seconds"),
    "DAR_MCP_CONNECT_TIMEOUT_SECONDS": (1, "mcp_connect_timeout_seconds"),
    "DAR_MCP_RETRY_SECONDS": (0.1, "mcp_retry_seconds"),
}
# Settings checked against each other: what the minimum of one needs from the others.
# Settings whose minimum is only valid together with another setting (cross-checks).
COMPANIONS = {
    "DAR_VISIBILITY_TIMEOUT_SECONDS": {"DAR_MAX_COUNTDOWN_SECONDS": "30"},
    "DAR_MAX_TIMEOUT_SECONDS": {"DAR_DEFAULT_TIMEOUT_SECONDS": "1"},
    "DAR_MAX_TOKEN_BUDGET": {"DAR_DEFAULT_TOKEN_BUDGET": "1"},
}
ALL_NUMERIC = {**INT_SETTINGS, **NUM_SETTINGS}


def test_defaults_with_an_empty_environment() -> None:
    s = Settings.from_env({})
    assert s.database_url is None
    assert s.redis_url is None
    assert s.anthropic_api_key is None
    assert s.anthropic_base_url is None
    assert s.default_model == ""
    assert s.model_default == "demo", "no key: the offline demo model answers, and says so"
    assert s.default_agent == "acme-tickets"
    assert s.agent_modules == ()
    assert s.max_tokens == 4096
    assert s.default_max_steps == 50
    assert s.lease_seconds == 8.0
    assert s.heartbeat_seconds == pytest.approx(8.0 / 3)
    assert s.redispatch_after_seconds == 30.0
    assert s.reaper_interval_seconds == 1.0
    assert s.max_claims_without_progress == 3
    assert s.store_requests is False
    assert s.model_timeout_seconds == 120.0
    assert s.retry_max_attempts == 5
    assert s.retry_base_seconds == 0.5
    assert s.retry_cap_seconds == 30.0
    assert s.long_wait_seconds == 5.0
    assert s.max_countdown_seconds == 60.0
    assert s.on_max_tokens == "fail"
    assert s.strict_budget is False
    assert s.prices_json is None
    assert s.demo_latency_ms == 3000
    assert s.queue == "dar"
    assert s.visibility_timeout_seconds == 3600.0
    assert s.max_body_bytes == 1_048_576
    assert s.max_input_chars == 100_000
    assert s.default_token_budget == 100_000
    assert s.max_token_budget == 10_000_000
    assert s.default_timeout_seconds == 600
    assert s.max_timeout_seconds == 7 * 86400
    assert s.worker_name == f"{socket.gethostname()}:{os.getpid()}"


def test_from_env_defaults_match_the_dataclass_defaults() -> None:
    assert Settings.from_env({}) == Settings()


def test_empty_and_blank_values_take_the_default() -> None:
    s = Settings.from_env({"DAR_MAX_TOKENS": "", "DAR_QUEUE": "   ", "DAR_LEASE_SECONDS": " "})
    assert s.max_tokens == 4096
    assert s.queue == "dar"
    assert s.lease_seconds == 8.0


def test_values_are_read() -> None:
    s = Settings.from_env(
        {
            "DATABASE_URL": "postgresql://u@db:5432/dar",
            "REDIS_URL": "redis://r:6379/1",
            "ANTHROPIC_API_KEY": "sk-test",
            "ANTHROPIC_BASE_URL": "http://127.0.0.1:9999",
            "DAR_DEFAULT_MODEL": "claude-haiku-4-5",
            "DAR_DEFAULT_AGENT": "other",
            "DAR_AGENT_MODULES": " a.agents , b ,, ",
            "DAR_MAX_TOKENS": " 1024 ",
            "DAR_LEASE_SECONDS": "30",
            "DAR_STORE_REQUESTS": "yes",
            "DAR_DEMO_LATENCY_MS": "0",
            "DAR_QUEUE": "runs",
            "DAR_MAX_BODY_BYTES": "2048",
            "DAR_WORKER_NAME": "worker-7",
        }
    )
    assert s.database_url == "postgresql://u@db:5432/dar"
    assert s.redis_url == "redis://r:6379/1"
    assert s.anthropic_api_key == "sk-test"
    assert s.anthropic_base_url == "http://127.0.0.1:9999"
    assert s.default_model == "claude-haiku-4-5"
    assert s.default_agent == "other"
    assert s.agent_modules == ("a.agents", "b")
    assert s.max_tokens == 1024
    assert s.lease_seconds == 30.0
    assert s.heartbeat_seconds == 10.0, "the heartbeat defaults to a third of the lease"
    assert s.store_requests is True
    assert s.demo_latency_ms == 0
    assert s.queue == "runs"
    assert s.max_body_bytes == 2048
    assert s.worker_name == "worker-7"


def test_the_api_key_is_not_in_the_repr() -> None:
    assert "sk-secret" not in repr(Settings.from_env({"ANTHROPIC_API_KEY": "sk-secret"}))


def test_reads_os_environ_when_no_mapping_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAR_QUEUE", "from-environ")
    monkeypatch.setenv("DAR_MAX_TOKENS", "77")
    s = Settings.from_env()
    assert s.queue == "from-environ"
    assert s.max_tokens == 77


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
    ],
)
def test_boolean_spellings(raw: str, expected: bool) -> None:
    assert Settings.from_env({"DAR_STORE_REQUESTS": raw}).store_requests is expected


@pytest.mark.parametrize("raw", ["maybe", "2", "y", "enabled"])
def test_an_invalid_boolean_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="DAR_STORE_REQUESTS") as e:
        Settings.from_env({"DAR_STORE_REQUESTS": raw})
    assert raw in str(e.value)


@pytest.mark.parametrize("name", sorted(ALL_NUMERIC))
@pytest.mark.parametrize("raw", ["abc", "12abc", "1,5", "--1"])
def test_a_non_number_names_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=name) as e:
        Settings.from_env({name: raw})
    assert "must be a number" in str(e.value)
    assert repr(raw) in str(e.value)


@pytest.mark.parametrize("name", sorted(ALL_NUMERIC))
def test_a_value_below_the_minimum_names_the_variable(name: str) -> None:
    minimum, _ = ALL_NUMERIC[name]
    too_low = minimum - 1 if minimum >= 1 else -1
    env = {name: str(too_low)}
    with pytest.raises(ConfigError, match=name) as e:
        Settings.from_env(env)
    assert "at least" in str(e.value)


@pytest.mark.parametrize("name", sorted(ALL_NUMERIC))
def test_the_minimum_itself_is_accepted(name: str) -> None:
    minimum, attribute = ALL_NUMERIC[name]
    env = {name: str(minimum), **COMPANIONS.get(name, {})}
    assert getattr(Settings.from_env(env), attribute) == minimum


@pytest.mark.parametrize("name", sorted(INT_SETTINGS))
def test_a_fraction_for_a_whole_number_names_the_variable(name: str) -> None:
    minimum, _ = INT_SETTINGS[name]
    with pytest.raises(ConfigError, match=name) as e:
        Settings.from_env({name: f"{minimum + 1}.5"})
    assert "whole number" in str(e.value)


@pytest.mark.parametrize("name", sorted(INT_SETTINGS))
def test_a_whole_number_in_float_notation_is_accepted(name: str) -> None:
    _, attribute = INT_SETTINGS[name]
    env = {name: "2048.0", **COMPANIONS.get(name, {})}
    value = getattr(Settings.from_env(env), attribute)
    assert value == 2048
    assert isinstance(value, int)


def test_heartbeat_not_shorter_than_the_lease_names_both_variables() -> None:
    with pytest.raises(ConfigError, match="DAR_HEARTBEAT_SECONDS") as e:
        Settings.from_env({"DAR_LEASE_SECONDS": "10", "DAR_HEARTBEAT_SECONDS": "10"})
    assert "DAR_LEASE_SECONDS" in str(e.value)
    assert Settings.from_env(
        {"DAR_LEASE_SECONDS": "10", "DAR_HEARTBEAT_SECONDS": "9.9"}
    ).heartbeat_seconds == pytest.approx(9.9)


def test_countdown_not_below_the_visibility_timeout_names_both_variables() -> None:
    with pytest.raises(ConfigError, match="DAR_MAX_COUNTDOWN_SECONDS") as e:
        Settings.from_env(
            {"DAR_VISIBILITY_TIMEOUT_SECONDS": "120", "DAR_MAX_COUNTDOWN_SECONDS": "120"}
        )
    assert "DAR_VISIBILITY_TIMEOUT_SECONDS" in str(e.value)
    ok = Settings.from_env(
        {"DAR_VISIBILITY_TIMEOUT_SECONDS": "120", "DAR_MAX_COUNTDOWN_SECONDS": "119"}
    )
    assert ok.max_countdown_seconds == 119


@pytest.mark.parametrize(("raw", "expected"), [("fail", "fail"), ("CONTINUE", "continue")])
def test_on_max_tokens_choices(raw: str, expected: str) -> None:
    assert Settings.from_env({"DAR_ON_MAX_TOKENS": raw}).on_max_tokens == expected


def test_an_invalid_choice_names_the_variable_and_the_choices() -> None:
    with pytest.raises(ConfigError, match="DAR_ON_MAX_TOKENS") as e:
        Settings.from_env({"DAR_ON_MAX_TOKENS": "retry"})
    assert "fail" in str(e.value)
    assert "continue" in str(e.value)
    assert "'retry'" in str(e.value)


@pytest.mark.parametrize("name", ["DAR_STORE_REQUESTS", "DAR_STRICT_BUDGET"])
def test_every_boolean_rejects_junk_naming_itself(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: "perhaps"})
    assert Settings.from_env({name: "true"}) != Settings.from_env({name: "false"})


def test_require_urls_name_the_variable() -> None:
    s = Settings.from_env({})
    with pytest.raises(ConfigError, match="DATABASE_URL"):
        s.require_database_url()
    with pytest.raises(ConfigError, match="REDIS_URL"):
        s.require_redis_url()
    full = Settings.from_env({"DATABASE_URL": "postgresql://x/y", "REDIS_URL": "redis://z"})
    assert full.require_database_url() == "postgresql://x/y"
    assert full.require_redis_url() == "redis://z"


@pytest.mark.parametrize("raw", ["nan", "inf", "1e400"])
def test_non_finite_whole_numbers_give_a_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match="DAR_MAX_TOKENS"):
        Settings.from_env({"DAR_MAX_TOKENS": raw})


@pytest.mark.parametrize(
    "name", ["DAR_REDISPATCH_AFTER_SECONDS", "DAR_LEASE_SECONDS", "DAR_REAPER_INTERVAL_SECONDS"]
)
def test_nan_seconds_give_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: "nan"})


@pytest.mark.parametrize(
    ("default_var", "max_var"),
    [
        ("DAR_DEFAULT_TOKEN_BUDGET", "DAR_MAX_TOKEN_BUDGET"),
        ("DAR_DEFAULT_TIMEOUT_SECONDS", "DAR_MAX_TIMEOUT_SECONDS"),
    ],
)
def test_a_default_above_its_maximum_is_rejected(default_var: str, max_var: str) -> None:
    with pytest.raises(ConfigError, match=default_var):
        Settings.from_env({default_var: "200", max_var: "100"})


def test_mcp_settings() -> None:
    s = Settings.from_env({})
    assert (s.mcp_servers_json, s.mcp_tools_json, s.mcp_startup_check) == (None, None, "strict")
    s = Settings.from_env({"DAR_MCP_SERVERS": "{}", "DAR_MCP_STARTUP_CHECK": "warn"})
    assert (s.mcp_servers_json, s.mcp_startup_check) == ("{}", "warn")
    with pytest.raises(ConfigError, match="DAR_MCP_STARTUP_CHECK must be one of strict, warn"):
        Settings.from_env({"DAR_MCP_STARTUP_CHECK": "maybe"})


def test_the_default_model_is_claude_with_a_key_or_a_client_of_your_own() -> None:
    assert Settings.from_env({"ANTHROPIC_API_KEY": "k"}).model_default == "claude-sonnet-4-5"
    assert Settings.from_env({"DAR_LLM_FACTORY": "m:f"}).model_default == "claude-sonnet-4-5"
    named = {"DAR_DEFAULT_MODEL": "claude-haiku-4-5"}
    assert Settings.from_env(named).model_default == "claude-haiku-4-5"
