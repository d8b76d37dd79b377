"""Training LoRA adapters on the served model, in the serving process (semantics.md §12).

requests (wire shapes) -> sources (rows + provenance) -> masks/sft/grpo (tokens, losses) -> plan
(everything checked at submission) -> manager (queue, worker thread, records via job_store, webhook)
-> executor (loop over the frozen base with trainable_lora, forward, then save + auto-load).
With `post_eval`: post_eval + overlap (checked at submission) -> eval_link (a post-training eval job) ->
gate_actions (kiln/evals/gate.py decides; promote, demote or leave the adapter; semantics.md §8.14).
The served model comes from the engine facade (`Engine.model`), never through its actor.

Imports: kiln.model, kiln.adapters, kiln.evals, kiln.data, kiln.core, kiln.store, kiln.config / errors;
the engine only through the JobContext it is handed; never kiln.api.
"""
