"""`/openapi.json` built from the wire contracts, so `/docs`, client generators and fuzzers see real bodies.

FastAPI's generated document knows the routes but not their bodies (handlers read raw JSON to give
contract-shaped 400s). Here every `$defs` entry of the three contract schemas in `kiln/contracts` is
copied into `components/schemas` at start-up, with its `$ref`s rewritten to point there, and each
contract route gets its request body and response schema by reference to those components. Nothing
is hand-copied: the schema files are the one source, and `CONTRACT_OPERATIONS` only says which
entrypoint belongs to which route (the contracts name entrypoints, semantics.md §1 names routes).
Routes outside the contracts declare their body with `request_body(PydanticModel)` (or
`no_request_body`) on the handler; their documented body is that wire model's JSON Schema.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urldefrag, urljoin

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kiln.contracts import schemas

INFERENCE = "kiln-inference-v1.schema.json"
EVALS = "kiln-evals-v1.schema.json"
THINKING = "thinking-budget-v1.schema.json"
# Definitions whose bare names would be ambiguous or generic get a file prefix in `components`.
_ALWAYS_PREFIXED = {THINKING: "ThinkingBudget"}
_PREFIX = {INFERENCE: "Inference", EVALS: "Evals", THINKING: "ThinkingBudget"}

ERROR_COMPONENT = "KilnError"


@dataclass(frozen=True)
class ContractOperation:
    method: str
    path: str
    request: str | None = None        # entrypoint name of the body, in `file`
    response: str | None = None       # entrypoint name of the 200 body
    file: str = EVALS
    request_media: str = "application/json"
    stream: str | None = None         # entrypoint of the text/event-stream alternative


def _inf(method: str, path: str, request: str, response: str, stream: str | None = None) -> ContractOperation:
    return ContractOperation(method, path, request, response, INFERENCE, stream=stream)


# Every entrypoint of the inference contract (6 JSON + the SSE stream) and all 33 of the evals contract.
CONTRACT_OPERATIONS: tuple[ContractOperation, ...] = (
    _inf("post", "/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse",
         stream="ChatCompletionChunkStream"),
    _inf("post", "/v1/completions", "TextCompletionRequest", "TextCompletionResponse"),
    _inf("post", "/v1/completions/batch", "BatchCompletionRequest", "BatchCompletionResponse"),
    ContractOperation("get", "/v1/eval/suites", response="SuiteListResponse"),
    ContractOperation("post", "/v1/eval/suites", "EvalSuite", "SuiteSaveResponse"),
    ContractOperation("get", "/v1/eval/suites/{name}", response="EvalSuite"),
    ContractOperation("delete", "/v1/eval/suites/{name}", response="DeleteSuiteResponse"),
    ContractOperation("post", "/v1/eval/run", "EvalRunRequest", "EvalRunResponse"),
    ContractOperation("post", "/v1/eval/compare", "EvalCompareSpec", "EvalRunResponse"),
    ContractOperation("get", "/v1/eval/jobs", response="EvalJobListResponse"),
    ContractOperation("get", "/v1/eval/jobs/{job_id}", response="EvalResult"),
    ContractOperation("delete", "/v1/eval/jobs/{job_id}", response="CancelEvalJobResponse"),
    ContractOperation("post", "/v1/eval/jobs/{job_id}/rerun", "RerunBody", "EvalRunResponse"),
    ContractOperation("post", "/v1/eval/jobs/{job_id}/replay", "ReplayBody", "EvalRunResponse"),
    ContractOperation("get", "/v1/eval/datasets", response="DatasetListResponse"),
    ContractOperation("post", "/v1/eval/datasets/upload", "DatasetUploadMultipart", "DatasetManifest",
                      request_media="multipart/form-data"),
    ContractOperation("get", "/v1/eval/datasets/{name}", response="DatasetManifest"),
    ContractOperation("delete", "/v1/eval/datasets/{name}", response="DeleteDatasetResponse"),
    ContractOperation("get", "/v1/eval/datasets/{name}/split", response="DatasetSplitManifest"),
    ContractOperation("put", "/v1/eval/datasets/{name}/split", "DatasetSplitConfig", "DatasetSplitManifest"),
    ContractOperation("post", "/v1/eval/datasets/{name}/preview", "SynthesisPreviewBody", "SynthesisPreview"),
    ContractOperation("post", "/v1/eval/datasets/{name}/synthesize", "SynthesizeBody",
                      "SynthesizeDatasetResponse"),
    ContractOperation("get", "/v1/judgments", response="JudgmentListResponse"),
    ContractOperation("post", "/v1/judgments", "CreateJudgmentBody", "JudgmentManifest"),
    ContractOperation("post", "/v1/judgments/render_prompt", "AppendJudgmentBody", "RenderJudgmentPromptResponse"),
    ContractOperation("get", "/v1/judgments/{name}", response="JudgmentManifest"),
    ContractOperation("post", "/v1/judgments/{name}/rows", "AppendJudgmentBody", "AppendJudgmentResponse"),
    ContractOperation("delete", "/v1/judgments/{name}/rows/{judgment_id}", response="JudgmentManifest"),
    ContractOperation("delete", "/v1/judgments/{name}", response="DeleteJudgmentResponse"),
    ContractOperation("post", "/v1/judgments/{name}/compile", "CompileJudgmentBody", "CompileJudgmentResponse"),
    ContractOperation("post", "/v1/judgments/{name}/validate", "PromoteJudgmentBody", "ValidateJudgmentResponse"),
)

_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Every failure: the OpenAI error envelope plus Kiln's `code` and a `hint` (semantics.md §0).",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code", "hint"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "string"},
                       "hint": {"type": ["string", "null"]}},
    }},
}


def component_names() -> dict[tuple[str, str], str]:
    """(schema file, definition) -> its name under components/schemas."""
    files = schemas()
    seen: dict[str, int] = {}
    for data in files.values():
        for name in data.get("$defs", {}):
            seen[name] = seen.get(name, 0) + 1
    out = {}
    for file, data in files.items():
        for name in data.get("$defs", {}):
            prefix = _ALWAYS_PREFIXED.get(file) or (_PREFIX.get(file, file) if seen[name] > 1 else None)
            out[(file, name)] = f"{prefix}.{name}" if prefix else name
    return out


def _rewrite(node: Any, file: str, base_id: str, ids: dict[str, str], names: dict[tuple[str, str], str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = _component_ref(value, file, base_id, ids, names)
            else:
                out[key] = _rewrite(value, file, base_id, ids, names)
        return out
    if isinstance(node, list):
        return [_rewrite(v, file, base_id, ids, names) for v in node]
    return node


def _component_ref(ref: str, file: str, base_id: str, ids: dict[str, str], names: dict[tuple[str, str], str]) -> str:
    url, fragment = urldefrag(urljoin(base_id, ref))
    target = ids.get(url, file)
    match = re.fullmatch(r"/\$defs/([^/]+)(/.*)?", fragment)
    if match is None or (target, match.group(1)) not in names:
        raise ValueError(f"contract $ref {ref!r} in {file} does not name a definition")
    return f"#/components/schemas/{names[(target, match.group(1))]}{match.group(2) or ''}"


def contract_components() -> dict[str, Any]:
    """Every definition of every contract, refs pointing into components/schemas."""
    files = schemas()
    ids = {data["$id"]: file for file, data in files.items()}
    names = component_names()
    out: dict[str, Any] = {}
    for file, data in files.items():
        for name, definition in data.get("$defs", {}).items():
            out[names[(file, name)]] = _rewrite(copy.deepcopy(definition), file, data["$id"], ids, names)
    return out


def _ref(file: str, name: str) -> dict[str, str]:
    names = component_names()
    if (file, name) not in names:
        raise ValueError(f"{file} has no definition {name!r}")
    return {"$ref": f"#/components/schemas/{names[(file, name)]}"}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_COMPONENT}"}}}}


# A request that works against any served model, shown by /docs' "Try it out" and sent first by fuzzers
# (their explicit phase), so a run always serves at least one real body per inference route.
REQUEST_EXAMPLES: dict[str, dict[str, Any]] = {
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8},
    "TextCompletionRequest": {"prompt": "Once upon a time", "max_tokens": 8, "prompt_logprobs": 0},
    "BatchCompletionRequest": {"prompts": [[{"role": "user", "content": "Say hello."}]], "max_tokens": 8},
}


def _apply(operation: dict[str, Any], op: ContractOperation) -> None:
    if op.request is not None:
        media: dict[str, Any] = {"schema": _ref(op.file, op.request)}
        if op.request in REQUEST_EXAMPLES:
            media["example"] = REQUEST_EXAMPLES[op.request]
        operation["requestBody"] = {"required": True, "content": {op.request_media: media}}
    responses: dict[str, Any] = {}
    if op.response is not None:
        content: dict[str, Any] = {"application/json": {"schema": _ref(op.file, op.response)}}
        if op.stream is not None:
            content["text/event-stream"] = {"schema": _ref(op.file, op.stream)}
        responses["200"] = {"description": f"{op.response} ({op.file})", "content": content}
    responses["4XX"] = _error_response("The request is invalid, names something that does not exist, or conflicts.")
    responses["503"] = _error_response("Not available now: the model is loading, a queue is full, or a store is "
                                       "unavailable; retry later (Retry-After when known).")
    operation["responses"] = responses


def _path_parameters(path: str, operation: dict[str, Any]) -> None:
    """Handlers read path segments from the request, so FastAPI may not have listed them."""
    params = operation.setdefault("parameters", [])
    have = {(p.get("in"), p.get("name")) for p in params}
    for name in re.findall(r"{([^}]+)}", path):
        if ("path", name) not in have:
            params.append({"name": name, "in": "path", "required": True, "schema": {"type": "string"}})


def _wire_bodies() -> dict[tuple[str, str], Any]:
    """Non-contract routes whose bodies Kiln's own wire models define (vLLM's shapes)."""
    from kiln.api.wire.compat import DetokenizeRequest, LegacyCompletionRequest, TokenizeRequest

    out: dict[tuple[str, str], Any] = {("post", "/compat/v1/completions"): LegacyCompletionRequest}
    for base in ("", "/compat"):
        out[("post", f"{base}/tokenize")] = TokenizeRequest
        out[("post", f"{base}/detokenize")] = DetokenizeRequest
    return out


@dataclass(frozen=True)
class RequestBody:
    """What a route reads as its body, for the document only: handlers still read raw JSON themselves."""
    model: Any = None                 # a Pydantic model; None: the route takes no body
    media: str = "application/json"
    required: bool = True


_BODY_ATTR = "__kiln_request_body__"


def request_body(model: Any, *, media: str = "application/json", required: bool = True):
    """Mark a handler with the Pydantic wire model of its body (`required=False`: the body may be empty),
    so /openapi.json and /docs show its fields. Put it below the route decorators."""
    def mark(endpoint):
        setattr(endpoint, _BODY_ATTR, RequestBody(model, media, required))
        return endpoint
    return mark


def no_request_body(endpoint):
    """Mark a handler that reads no body (documented as `x-kiln-bodiless`)."""
    setattr(endpoint, _BODY_ATTR, RequestBody())
    return endpoint


def _add_component(components: dict[str, Any], name: str, schema: Any) -> None:
    if name in components and components[name] != schema:
        raise ValueError(f"two different schemas are named {name!r} in /openapi.json components")
    components[name] = schema


def _apply_wire_body(operation: dict[str, Any], model: Any, components: dict[str, Any], *,
                     media: str = "application/json", required: bool = True) -> None:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        _add_component(components, name, definition)
    _add_component(components, model.__name__, schema)
    operation["requestBody"] = {"required": required, "content": {media: {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    operation.setdefault("responses", {})["4XX"] = _error_response("The request is invalid.")


def _api_routes(routes: Any, prefix: str = "") -> Any:
    """(full path, route) of every endpoint route, also inside routers that FastAPI keeps nested
    (`_IncludedRouter` with the router it included and its prefix)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            context = getattr(route, "include_context", None)
            yield from _api_routes(inner.routes, prefix + (getattr(context, "prefix", "") or ""))
        elif hasattr(route, "endpoint") and hasattr(route, "path_format"):
            yield prefix + route.path_format, route


def _marked_bodies(app: FastAPI, paths: dict[str, Any], components: dict[str, Any]) -> None:
    for path, route in _api_routes(app.routes):
        body = getattr(route.endpoint, _BODY_ATTR, None)
        if body is None or not getattr(route, "include_in_schema", False):
            continue
        for method in sorted(getattr(route, "methods", ())):
            operation = paths.get(path, {}).get(method.lower())
            if operation is None:
                continue
            if body.model is None:
                operation.pop("requestBody", None)
                operation["x-kiln-bodiless"] = True
            else:
                _apply_wire_body(operation, body.model, components, media=body.media, required=body.required)


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components.update(contract_components())
    components[ERROR_COMPONENT] = _ERROR_SCHEMA
    paths = doc.setdefault("paths", {})
    for op in CONTRACT_OPERATIONS:
        operation = paths.get(op.path, {}).get(op.method)
        if operation is not None:  # an app built with a subset of the routers (tests) lacks some
            _apply(operation, op)
    for (method, path), model in _wire_bodies().items():
        operation = paths.get(path, {}).get(method)
        if operation is not None:
            _apply_wire_body(operation, model, components)
    _marked_bodies(app, paths, components)
    for path, item in paths.items():
        for operation in item.values():
            if isinstance(operation, dict) and "{" in path:
                _path_parameters(path, operation)
    return doc


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def contract_entrypoints() -> set[tuple[str, str]]:
    """(file, entrypoint) the operations above cover; tests compare it with the contracts' own lists."""
    found = set()
    for op in CONTRACT_OPERATIONS:
        for name in (op.request, op.response, op.stream):
            if name is not None:
                found.add((op.file, name))
    return found
