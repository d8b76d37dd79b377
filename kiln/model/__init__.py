"""The model in torch: configs, our own llama/qwen2/qwen3 decoder, paged attention metadata and the KV
cache, HF and GGUF loading (kiln.model.gguf_file is the one GGUF reader, metadata included), the
sampler, batched multi-adapter LoRA math, quantized weights and the C++ kernels (kiln.model.kernels).

The engine's runner feeds it scheduled steps; training runs `forward_dense` with trainable factors.

Imports: torch, numpy, gguf, safetensors, kiln.core, kiln.store, kiln.config / kiln.errors.
"""

