"""Structured outputs and enforced tool calls on the embedded SmolLM2, through the official openai client
unchanged: `chat.completions.parse` with a Pydantic model, tool_choice "required" and a named function,
and a schema the grammar engine refuses surfacing as the client's BadRequestError; LangChain's
with_structured_output, Instructor (TOOLS and JSON_SCHEMA modes) and a pydantic-ai Agent on top of it."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from .conftest import start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    # an unbounded JSON number lets a 135M model write digits up to max_tokens; bounds keep it short
    founded: int = Field(ge=0, le=2100)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("structured"))
    yield server
    stop_server(server)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=180)


@pytest.fixture
def model(client):
    return client.models.list().data[0].id


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as a city record."}],
        response_format=City, max_tokens=120, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert choice.message.parsed.name


def test_json_object_mode_returns_json(client, model):
    completion = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a JSON object with a greeting."}],
        response_format={"type": "json_object"}, max_tokens=150, temperature=0)
    content = completion.choices[0].message.content
    assert content.startswith("{")
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_tool_choice_required_gives_a_tool_call(client, model):
    completion = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


def test_a_named_tool_choice_calls_that_function_streamed(client, model):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=120, temperature=0, stream=True)
    names, arguments, finish = [], "", None
    for chunk in stream:
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    arguments += call.function.arguments
            finish = c.finish_reason or finish
    assert names == ["get_time"] and finish == "tool_calls"
    assert set(json.loads(arguments)) == {"zone"}


def test_a_schema_the_engine_cannot_enforce_is_a_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, model, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url, api_key="unused", model=model, temperature=0, max_tokens=120,
                     timeout=180)
    city = llm.with_structured_output(City, method=method).invoke("Describe Paris as a city record.")
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_the_response_model(client, model, mode):
    import instructor

    # TOOLS sends City as the one function under a named tool_choice; JSON_SCHEMA sends its schema as
    # response_format {"type": "json_object", "schema": ...}
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(
        model=model, response_model=City, max_retries=0, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as a city record."}])
    assert isinstance(city, City) and city.name


def test_pydantic_ai_agent_with_a_structured_output_type(server, model):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    chat_model = OpenAIChatModel(model, provider=OpenAIProvider(base_url=server.base_url, api_key="unused"))
    agent = Agent(chat_model, output_type=City, model_settings={"temperature": 0, "max_tokens": 120}, retries=0)
    result = agent.run_sync("Describe Paris as a city record.")
    assert isinstance(result.output, City) and result.output.name
