"""vLLM's tokenizer routes over the served tokenizer: /tokenize (text or chat messages rendered with the
served template), /detokenize, /tokenizer_info. The router parses the body (kiln.api.wire.compat) and
serializes what these return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.engine.legacy_request import check_token_ids
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

TOKENIZE_CODE = "tokenize_invalid_request"
TOKENIZE_PREFIX = "Invalid tokenize request: "
DETOKENIZE_PREFIX = "Invalid detokenize request: "


def tokenizer_info(engine: EngineView) -> dict[str, Any]:
    tok = engine.tokenizer
    info: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
        "unk_token": tok.unk_token, "model_max_length": engine.info.max_model_len,
        "vocab_size": tok.vocab_size, "clean_up_tokenization_spaces": False,
    }
    if tok.chat_template:
        info["chat_template"] = tok.chat_template
    return info


def tokenize(engine: EngineView, body: Any) -> dict[str, Any]:
    """A validated TokenizeRequest -> {count, max_model_len, tokens[, token_strs]}."""
    prefix = TOKENIZE_PREFIX
    if (body.prompt is None) == (body.messages is None):
        raise KilnError(400, TOKENIZE_CODE, prefix + "send exactly one of prompt or messages", param="prompt",
                        hint='Send {"prompt": "text"} or {"messages": [...]}.')
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = engine.tokenizer.encode(body.prompt, add_special_tokens=add)
    else:
        try:
            text = engine.template.render(body.messages, add_generation_prompt=body.add_generation_prompt,
                                          **(body.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - the template's complaint is the client's to fix
            raise KilnError(400, TOKENIZE_CODE, f"{prefix}the chat template rejected the messages: {e}",
                            param="messages", hint="Send messages with role and content.") from None
        ids = engine.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [engine.tokenizer.id_to_token(i) for i in ids]
    return out


def detokenize(engine: EngineView, tokens: list[int]) -> dict[str, Any]:
    check_token_ids(tokens, engine.tokenizer.vocab_size, "tokens", TOKENIZE_CODE, DETOKENIZE_PREFIX)
    return {"prompt": engine.tokenizer.decode(tokens)}
