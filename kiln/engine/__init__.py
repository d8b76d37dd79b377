"""Serving: tokenizer and chat template, the request path, the batching actor and its facade.

One request path (docs/DESIGN.md, "A chat request"): chat_request (a validated request -> `ChatInput`
-> `prepare_chat` / `prepare_batch`: prompt ids, per-choice sampling, context clamp, thinking-budget
controllers, adapter) -> serving.Engine.submit (the one way work reaches the actor) -> actor.EngineActor
(schedule a step, runner.ModelRunner runs it, detokenize, stop) -> chat_response (choices, stream
chunks, batch items; every completion ends in `Engine.finish_completion`, which the observers see).
score_request does the same for prompt scoring; eval_generator is the eval `Generator` over this path.
Also: timing (per-request latency records), provenance (content identities), lora_slots and
adapter_resolver (adapter revisions bound to bank slots).

Imports: kiln.core, kiln.model, kiln.store, kiln.adapters (the stored adapters it serves), kiln.config / kiln.errors, and the evals protocol types
(kiln.evals.generator) for the generator; never kiln.api.
"""

