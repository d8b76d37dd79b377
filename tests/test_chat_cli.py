"""`kiln chat`: an interactive session against a server (httpx's mock transport stands in for it)."""

from __future__ import annotations

import json

import httpx

from kiln.cli import main
from kiln.commands import chat


def _sse(text: str) -> bytes:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}}]}
    return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()


def test_a_failed_turn_prints_the_error_and_the_session_goes_on(monkeypatch, capsys):
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        if len(sent) == 1:
            return httpx.Response(404, json={"error": {"message": "Adapter 'nope' not found.", "type": "invalid_request_error",
                                                       "param": "adapter", "code": "adapter_not_found",
                                                       "hint": "GET /v1/adapters lists the saved adapters."}})
        return httpx.Response(200, content=_sse("Paris."), headers={"content-type": "text/event-stream"})

    real_client = httpx.Client
    monkeypatch.setattr(chat.httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    lines = iter(["first question", "capital of France?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))

    assert main(["chat", "--url", "http://kiln.test"]) == 0
    out, err = capsys.readouterr()
    assert "error 404 [adapter_not_found]: Adapter 'nope' not found." in err
    assert "Paris." in out
    # the unanswered turn is not resent as part of the conversation
    assert sent[1]["messages"] == [{"role": "user", "content": "capital of France?"}]


def test_one_shot_message_exits_1_on_an_error(monkeypatch, capsys):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad", "type": "invalid_request_error", "param": None,
                                                   "code": "chat_invalid_request", "hint": "fix it"}})

    real_client = httpx.Client
    monkeypatch.setattr(chat.httpx, "Client", lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    assert main(["chat", "--url", "http://kiln.test", "-m", "hi"]) == 1
    assert "hint: fix it" in capsys.readouterr().err
