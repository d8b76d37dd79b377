"""`StandInEngine`: an `EngineView` (kiln.engine.view) without a batching actor, for tests of the layers
above the engine. It holds what a test gives it (model info, tokenizer, template, a model to train
on, scheduler counts) and answers the rest as an idle engine would; what only a running actor can do
(generate, score) raises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kiln.core.admission import AdmissionGate
from kiln.core.decode_stats import DecodeSnapshot, DecodeWindow
from kiln.engine.grammar import GrammarCounters
from kiln.engine.prompt_context import PromptContext


class StandInEngine:
    def __init__(self, *, info: Any = None, tokenizer: Any = None, template: Any = None, model: Any = None,
                 identity: Any = None, running: int = 0, waiting: int = 0, in_flight: int = 0) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.template = template
        self._model = model
        self.identity = identity
        self.effective_config: dict[str, Any] = {}
        self.effective_config_sha256 = ""
        self.adapters: Any = None
        self.observers: list[Any] = []
        self.in_flight = in_flight
        self.admission = AdmissionGate()
        self.running, self.waiting = running, waiting
        self._grammar_counters = GrammarCounters()

    @property
    def backend(self) -> str:
        return "stand-in"

    @property
    def model(self) -> Any:
        return self._model

    def policy(self) -> None:
        return None

    def config_hashes(self) -> None:
        return None

    def attach_adapters(self, store: Any, compose_cache: Any, active: Any) -> None:
        pass

    def resolve_adapter(self, *, adapter_given: bool, adapter: str | None, adapters: Any,
                        param: str = "adapter") -> None:
        return None

    def describe(self) -> str:
        return "stand-in engine"

    def is_alive(self) -> bool:
        return True

    @property
    def prewarmed(self) -> bool:
        return True

    def join(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def scheduler_snapshot(self) -> dict[str, int]:
        return {"waiting": self.waiting, "running": self.running, "blocks_used": 0, "blocks_free": 0,
                "blocks_total": 0}

    def memory(self) -> Any:
        raise NotImplementedError("a stand-in engine holds no KV pool")

    def decode_stats(self) -> DecodeSnapshot:
        return DecodeWindow(60.0).snapshot()

    def stats(self) -> Any:
        raise NotImplementedError("a stand-in engine has no actor to report on")

    def responsive(self, stall_s: float = 30.0) -> bool:
        return True

    def cpu_kernels(self) -> None:
        return None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        return self.template.render(messages, tools=tools, **(template_kwargs or {}))

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def choice_params(self, base: Any, n: int) -> list[Any]:
        return [base] * n

    @property
    def close_think_ids(self) -> list[int]:
        return self.tokenizer.encode("</think>", add_special_tokens=False)

    def prompt_context(self) -> PromptContext:
        """Preparation over the stand-in's tokenizer and template; output grammars are not compiled."""
        def no_grammars() -> Any:
            raise RuntimeError("StandInEngine compiles no output grammars")

        return PromptContext(info=self.info, render_chat=self.render_chat, encode_prompt=self.encode_prompt,
                             decode=self.tokenizer.decode if self.tokenizer is not None else str,
                             choice_params=self.choice_params, resolve_adapter=self.resolve_adapter,
                             adapter_store=lambda: None, grammars=no_grammars, policy=self.policy,
                             tool_tag_ids=None, close_think_ids=self.close_think_ids if self.tokenizer else [])

    def admit(self, prompt_tokens: list[int]) -> Any:
        raise NotImplementedError("a stand-in engine admits no requests")

    def submit(self, requests: list[Any], admission: Any = None) -> AsyncIterator[Any]:
        raise NotImplementedError("a stand-in engine generates nothing")

    def generate(self, prompt_ids: list[int], params: list[Any], request_id: str | None = None,
                 budgets: list | None = None, adapter: Any = None) -> AsyncIterator[Any]:
        raise NotImplementedError("a stand-in engine generates nothing")

    async def score(self, token_ids: list[int], top_k: int, adapter: Any = None) -> Any:
        raise NotImplementedError("a stand-in engine scores nothing")

    def grammar_counters(self) -> GrammarCounters:
        return self._grammar_counters

    def start_completion(self) -> None:
        self.in_flight += 1

    def finish_completion(self, done: Any) -> None:
        self.in_flight -= 1
