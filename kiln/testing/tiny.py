"""Tiny random HF model directories for tests and benchmarks.

`make_tiny_model` writes what a real Hub checkpoint has -- config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json -- for a llama / qwen2 / qwen3 decoder
of a few hundred thousand parameters. The tokenizer is a real byte-level BPE, trained in-process on a
small built-in corpus and shaped exactly like Qwen2's (NFC, Qwen2 split regex, ByteLevel), so every
string encodes and multi-byte characters span several tokens. The chat template follows Qwen3's:
tools, tool calls, tool responses, reasoning_content and enable_thinking. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Qwen2's pre-tokenizer split: digits one by one, letters with one leading non-letter, newline runs apart.
QWEN2_SPLIT_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Special (skipped by skip_special_tokens) and plain added tokens, in Qwen3's order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

# Upper bound for training; the corpus yields about 675 tokens in all.
_MAX_VOCAB = 768

_DEFAULT = object()

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time there was a small village by the sea. The people who lived there were fishermen and
farmers, and every morning they walked down to the harbour to see what the night had brought in.
The weather was often cold, but the children played on the beach all day long, building castles of
sand and looking for shells. In the evening the families gathered around the fire and told stories
about the old days, when the boats were made of wood and the sails were sewn by hand.
Science is the study of the natural world through observation and experiment. Water boils at one
hundred degrees at sea level. The sun is a star, and the earth moves around it once every year.
Plants need light, water and air to grow. Animals eat plants or other animals to get their energy.
Mathematics gives us numbers: 1, 2, 3, 42, 100, 2024 and 3.14159. Two plus two is four; ten times
ten is one hundred. What is the capital of France? The capital of France is Paris. Which colour do
you get when you mix blue and yellow? You get green. Red, orange, yellow, green, blue and violet.
I think that the answer should be short and clear. Let me think about this step by step. First, we
read the question carefully. Then we look for the important words. Finally, we write the answer.
Hello! How can I help you today? I would like to know the weather in London, please. Sure, let me
check that for you. It is sunny and warm, with a light wind from the west. Thank you very much!
You are a helpful assistant. The user asks a question and the assistant gives a helpful answer.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

class Point:
    def __init__(self, x: float, y: float) -> None:
        self.x = x
        self.y = y

{"name": "get_weather", "arguments": {"city": "London", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters":
{"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
The library opens at nine in the morning and closes at six in the evening. Books can be borrowed for
two weeks. Please return them on time so that other readers can enjoy them too. Music, art and
history are taught at the school on the hill. Students learn to read, write, count and think.
Good morning, good afternoon, good evening and good night. Yes, no, maybe, always, never, sometimes.
Hello there! Hello again. The user said hello, and the assistant answered with a friendly greeting.
The system message tells the assistant how to behave. The assistant may call a tool: it writes a
function name and the arguments, the tool returns a result, and the assistant uses that result to
answer the user. If the answer is not known, the assistant should say so instead of guessing.
Computers store numbers and letters as bytes. A program is a list of instructions that a computer
can follow. Programmers write programs in languages such as Python, Rust, C and JavaScript. They
test their code, read the error messages, and fix the bugs they find. Good code is simple to read.
import json
import os

def main() -> int:
    data = json.loads(os.environ.get("CONFIG", "{}"))
    if not data:
        return 1
    for key, value in sorted(data.items()):
        print(f"{key} = {value}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
The river runs through the valley and into the sea. Trees grow along its banks, and birds build
their nests in the branches. In spring the flowers open; in summer the fields turn gold; in autumn
the leaves fall; and in winter the snow covers everything in white. The seasons change every year.
My friend lives in a big city with tall buildings, busy streets and many shops. She takes the train
to work every day and reads a book on the way. At the weekend she likes to visit her family in the
country, where it is quiet and the air is fresh. They cook dinner together and talk until late.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: What is the largest planet in our solar system? Answer: Jupiter is the largest planet.
Question: Who wrote the play Romeo and Juliet? Answer: William Shakespeare wrote it.
"""


@functools.cache
def _tokenizer_json() -> str:
    # Trained once per process: the trainer is deterministic for a fixed corpus, so caching is exact.
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_MAX_VOCAB - len(SPECIAL_TOKENS) - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tokenizer.to_str()


def tiny_tokenizer() -> Tokenizer:
    """The trained byte-level BPE every tiny model ships (a fresh object each call)."""
    return Tokenizer.from_str(_tokenizer_json())


def qwen3_chat_template(*, thinking_prompt: bool = False) -> str:
    """Qwen3's chat template. With `thinking_prompt` the generation prompt opens "<think>\\n" (as
    Qwen3.5 does) so a rendered prompt shows whether thinking is on."""
    return _QWEN3_TEMPLATE.replace(
        "{{THINKING_PROMPT}}", _THINKING_PROMPT if thinking_prompt else _PLAIN_PROMPT
    )


_PLAIN_PROMPT = """\
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}"""

_THINKING_PROMPT = """\
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}"""

_QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{THINKING_PROMPT}}
{%- endif %}"""


def make_tiny_model(
    path: str | Path,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    extra_vocab: int = 0,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = True,
    init_std: float = 0.02,
    dtype: str = "float32",
    chat_template: str | None | object = _DEFAULT,
    thinking_prompt: bool = False,
    generation_defaults: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random HF model directory at `path` and return it.

    `extra_vocab` adds embedding rows no token uses (real checkpoints pad their vocabulary).
    `chat_template=None` writes a model without a template; a string replaces Qwen3's.
    `generation_defaults` adds sampling fields (temperature, top_p, ...) to generation_config.json.
    The same arguments and seed always give byte-identical files.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = _config(
        arch,
        vocab_size=tokenizer.get_vocab_size() + extra_vocab,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        intermediate_size=intermediate_size or 2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    _write_json(out / "config.json", config)
    _write_weights(out / "model.safetensors", config, arch, seed=seed, init_std=init_std, dtype=dtype)
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        **(generation_defaults or {}),
    }
    _write_json(out / "generation_config.json", generation)
    (out / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    template = (
        qwen3_chat_template(thinking_prompt=thinking_prompt) if chat_template is _DEFAULT else chat_template
    )
    _write_json(
        out / "tokenizer_config.json", _tokenizer_config(tokenizer, template, max_position_embeddings)
    )
    return out


def _config(arch: str, **c: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"],
        "num_key_value_heads": c["num_kv_heads"],
        "head_dim": c["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": c["rope_theta"],
        "rope_scaling": c["rope_scaling"],
        "tie_word_embeddings": c["tie_word_embeddings"],
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": c["bos_token_id"],
        "eos_token_id": c["eos_token_id"],
        "torch_dtype": c["dtype"],
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=c["num_layers"])
    else:
        config.update(
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=c["num_layers"],
        )
    return config


def _weight_shapes(config: dict[str, Any], arch: str) -> dict[str, tuple[int, ...]]:
    h, v = config["hidden_size"], config["vocab_size"]
    d, i = config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
        if arch == "qwen2":
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if arch == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def _write_weights(
    path: Path, config: dict[str, Any], arch: str, *, seed: int, init_std: float, dtype: str
) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(_weight_shapes(config, arch).items()):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            # Norm gains away from 1, so a loader that forgets them produces different logits.
            tensor = 1.0 + 0.1 * noise
        else:
            tensor = init_std * noise
        tensors[name] = tensor.to(getattr(torch, dtype)).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _tokenizer_config(tokenizer: Tokenizer, chat_template: str | None, max_length: int) -> dict[str, Any]:
    decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in (*SPECIAL_TOKENS, *ADDED_TOKENS)
    }
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
