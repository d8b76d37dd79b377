"""The embedded default model (SmolLM2-135M-Instruct) answers a simple question sensibly."""

from __future__ import annotations

import httpx
import pytest

from kiln.testing.schemas import validate

from .conftest import start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("default"))
    yield server
    stop_server(server)


def test_default_model_knows_the_capital_of_france(default_server):
    r = httpx.post(default_server.base_url + "/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32, "temperature": 0,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    validate("kiln-inference-v1.schema.json", "ChatCompletionResponse", body)
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_default_model_is_listed_under_its_file_name(default_server):
    models = httpx.get(default_server.base_url + "/models").json()
    assert models["data"][0]["id"].startswith("SmolLM2-135M-Instruct")
