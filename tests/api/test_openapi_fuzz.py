"""Fuzz every JSON route of /openapi.json (schemathesis, bodies generated from the contract schemas) against
the whole app over a real tiny engine: no response may be a 5xx other than a documented 503.

Bounded: KILN_FUZZ_EXAMPLES examples per operation (default 30, under a minute on 2 cores); set it to
e.g. 200 for a long run: `KILN_FUZZ_EXAMPLES=200 make test PYTEST_ARGS=tests/api/test_openapi_fuzz.py`.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

import kiln.api.app as app_module
from kiln.config import DataSettings, EngineSettings, EvalSettings, ModelSettings, Settings, TrainingSettings
from kiln.server import build_state

EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "30"))
# multipart uploads are not JSON routes; the fuzzer would only send it random bytes as archives
NOT_JSON = ["/v1/eval/datasets/upload", "/v1/adapters/upload"]


@pytest.fixture(scope="module")
def contract_api(tmp_path_factory):
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("fuzz")
    model = make_tiny_model(root / "tiny", arch="llama", init_std=0.3)
    settings = Settings(model=ModelSettings(path=str(model), dtype="float32", served_model_id="tiny"),
                        data=DataSettings(data_dir=str(root / "data")),
                        engine=EngineSettings(kv_cache_memory_mb=8, max_model_len=96),
                        eval=EvalSettings(max_queued_jobs=4), training=TrainingSettings(max_queued_jobs=2))
    settings.server.request_timeout_secs = 30
    state = build_state(settings)
    app = app_module.create_app(settings, state)
    engine = build_engine(settings)
    state.engine = engine
    state.attach_adapters()
    yield schemathesis.openapi.from_asgi("/openapi.json", app).exclude(path=NOT_JSON)
    engine.shutdown()


def fuzz_operation(operation, seen: dict[tuple[str, str, int], int], failures: list[str]) -> None:
    documented = operation.definition.raw.get("responses", {})

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(headers={"x-request-id": "fuzz"})
        key = (operation.method.upper(), operation.path, response.status_code)
        seen[key] = seen.get(key, 0) + 1
        if response.status_code >= 500 and not (response.status_code == 503 and "503" in documented):
            failures.append(f"{case.method} {case.path} answered {response.status_code}: "
                            f"{response.text[:600]}\n  reproduce: {case.as_curl_command()}")

    fuzz()


def test_no_route_answers_a_5xx_other_than_a_documented_503(contract_api):
    failures: list[str] = []
    seen: dict[tuple[str, str, int], int] = {}
    operations = [r.ok() for r in contract_api.get_all_operations()]
    assert len(operations) > 50
    for operation in operations:
        fuzz_operation(operation, seen, failures)
    if os.environ.get("KILN_FUZZ_REPORT"):
        for key in sorted(seen):
            print(*key, seen[key])
    assert not failures, "\n".join(failures[:20])
    # the fuzzer got past validation: generated contract bodies were served, not only rejected
    accepted = {(method, path) for method, path, status in seen if status < 300}
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/completions/batch"),
            ("POST", "/v1/eval/suites"), ("POST", "/v1/judgments"), ("POST", "/compat/v1/completions")} <= accepted
