"""The exported LoRA GGUF, applied by llama.cpp itself, gives Kiln's logits on the embedded model.

A random rank-8 adapter on every projection of SmolLM2 (per-module alphas, so scale folding matters) is
exported with `kiln.adapters.export`, then llama.cpp applies it: libllama through the small harness
that `tools/build-llamacpp logits` builds (`make test` builds it; CI requires it with
KILN_REQUIRE_LLAMACPP=1), else `llama-server --lora`, else llama-cpp-python (the `llamacpp` extra).
The base is the embedded GGUF with its weights dequantized to float32 (same metadata and tokenizer), so llama.cpp and Kiln multiply the same
numbers in float32 and the tolerance is tight; Kiln's side adds the adapter's deltas to its weights.
The comparison means something because the adapter moves the logits far more than the tolerance, and
an export without the q/k permutation is far off. Skipped when no llama.cpp is built (failed under
KILN_REQUIRE_LLAMACPP=1).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from kiln.adapters.export import export_gguf
from kiln.adapters.peft_format import DEFAULT_TARGET_MODULES, MODULE_PARENT, config_dict
from kiln.adapters.store import AdapterStore
from kiln.model.loader import default_model_path, load_model

pytestmark = pytest.mark.slow
TOP = 10
TOLERANCE = 0.01  # float32 on both sides: only summation order differs
PROMPT = "The capital of France is Paris. The capital of Italy is"


CACHE = Path(os.environ.get("LLAMA_SERVER_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln-llama-server")


def find_llama_logits() -> str | None:
    """tools/build-llamacpp's libllama harness (`make test` builds it): the reference llama.cpp uses."""
    found = os.environ.get("KILN_LLAMA_LOGITS")
    if found:
        return found
    built = sorted(glob.glob(str(CACHE / "*/vendor/llama.cpp/build-lib-*/bin/kiln-llama-logits")))
    return built[-1] if built else None


def find_llama_server() -> str | None:
    found = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if found:
        return found
    built = sorted(glob.glob(str(CACHE / "*/vendor/llama.cpp/build-native/bin/llama-server")))
    return built[-1] if built else None


def have_llama_cpp_python() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


MISSING = ("llama.cpp is not built: run `tools/build-llamacpp logits` (make test does), pip install "
           "'kiln[llamacpp]', or set LLAMA_SERVER=/path/to/llama-server")
if find_llama_logits() is None and find_llama_server() is None and not have_llama_cpp_python():
    if os.environ.get("KILN_REQUIRE_LLAMACPP") == "1":
        raise RuntimeError(f"KILN_REQUIRE_LLAMACPP=1 but {MISSING}")
    pytest.skip(MISSING, allow_module_level=True)


def float32_gguf(src: Path, dst: Path) -> Path:
    """`src` with every tensor dequantized to float32: metadata (tokenizer included) copied as it is."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = f.types[0]
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        elif kind == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                value = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                value = [f.parts[i].tolist()[0] for i in f.data]
        elif kind == gguf.GGUFValueType.STRING:
            value = bytes(f.parts[f.data[0]]).decode()
        else:
            value = f.parts[f.data[0]].tolist()[0]
        writer.add_key_value(name, value, kind, sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-lora")
    base = float32_gguf(default_model_path(), root / "SmolLM2-135M-Instruct.F32.gguf")
    model, weights = load_model(str(base), dtype="float32")
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    factors = {}
    for layer in range(cfg.num_hidden_layers):
        for name in DEFAULT_TARGET_MODULES:
            out_f, in_f = _weight(model, layer, name).shape
            factors[(layer, name)] = (torch.randn(8, in_f, generator=g) / in_f**0.5,
                                      torch.randn(out_f, 8, generator=g) * 0.05)
    store = AdapterStore(root / "adapters")
    store.save_adapter("rand", factors, config_dict(8, 16, list(DEFAULT_TARGET_MODULES)) |
                       {"alpha_pattern": {"q_proj": 32, "down_proj": 8}})
    modules = store.load_adapter("rand").modules
    good = export_gguf(modules, cfg, root / "rand.gguf", name="rand")
    flat = root / "rand-unpermuted.gguf"
    _export_unpermuted(modules, cfg, flat)
    tok = _tokenize(weights)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    base_logp = _ours(model, ids)
    with torch.no_grad():
        for (layer, name), lm in modules.items():
            _weight(model, layer, name).add_(lm.scale * (lm.b.float() @ lm.a.float()))
    lora_logp = _ours(model, ids)
    return {"ids": ids, "base": base_logp, "lora": lora_logp, "good": good, "flat": flat, "root": root,
            "model": base}


def _weight(model, layer: int, name: str) -> torch.Tensor:
    return model.get_submodule(f"model.layers.{layer}.{MODULE_PARENT[name]}.{name}").weight


def _tokenize(weights):
    from kiln.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(weights.gguf_metadata or {})


def _ours(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model.forward_dense(torch.tensor([ids]))[0, -1].float(), -1)


def _export_unpermuted(modules, cfg, path: Path) -> None:
    """The same adapter with q/k rows left in HF order: what a converter that forgot the permutation writes."""
    import gguf

    from kiln.adapters.export import gguf_lora_tensors
    from kiln.model.gguf_loader import unpermute_qk

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
    for name, t in gguf_lora_tensors(modules, cfg).items():
        if name.endswith("lora_b") and (".attn_q." in name or ".attn_k." in name):
            t = unpermute_qk(t, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        writer.add_tensor(name, t.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_cpp_logprobs(model: Path, lora: Path | None, ids: list[int], root: Path) -> dict[int, float]:
    """Top-TOP next-token log-probs after `ids`, from llama.cpp with the adapter applied."""
    harness = find_llama_logits()
    if harness is not None:
        args = [harness, str(model), str(TOP)] + (["--lora", str(lora)] if lora else []) + ["--"]
        out = subprocess.run(args + [str(i) for i in ids], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        rows = [line.split("\t") for line in out.stdout.splitlines()]
        return {int(tid): float(lp) for tid, lp in rows}
    server = find_llama_server()
    if server is None:
        import llama_cpp

        llm = llama_cpp.Llama(str(model), lora_path=str(lora) if lora else None, n_ctx=256,
                              n_threads=2, logits_all=False, verbose=False)
        llm.eval(ids)
        logits = torch.tensor(llm.scores[len(ids) - 1])
        logp = torch.log_softmax(logits.float(), -1)
        vals, idx = logp.topk(TOP)
        return dict(zip(idx.tolist(), vals.tolist(), strict=True))
    port = _free_port()
    args = [server, "-m", str(model), "--port", str(port), "--host", "127.0.0.1", "-c", "512",
            "-t", "2", "-np", "1", "--no-warmup"]
    if lora is not None:
        args += ["--lora", str(lora)]
    log = open(root / f"llama-server-{port}.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError((root / f"llama-server-{port}.log").read_text())
            time.sleep(0.2)
        body = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=120, json={
            "prompt": ids, "n_predict": 1, "n_probs": TOP, "temperature": 0, "post_sampling_probs": False,
            "cache_prompt": False}).json()
        top = body["completion_probabilities"][0]["top_logprobs"]
        return {int(t["id"]): float(t["logprob"]) for t in top}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _gap(theirs: dict[int, float], ours: torch.Tensor) -> float:
    return max(abs(lp - float(ours[tid])) for tid, lp in theirs.items())


def test_llama_cpp_base_model_matches_ours(setup):
    gap = _gap(llama_cpp_logprobs(setup["model"], None, setup["ids"], setup["root"]), setup["base"])
    print(f"base: max |logprob| gap over llama.cpp's top {TOP}: {gap:.4f}")
    assert gap < TOLERANCE


def test_llama_cpp_with_the_exported_adapter_matches_our_logits(setup):
    theirs = llama_cpp_logprobs(setup["model"], setup["good"], setup["ids"], setup["root"])
    gap = _gap(theirs, setup["lora"])
    moved = _gap(theirs, setup["base"])
    print(f"adapter: max |logprob| gap over llama.cpp's top {TOP}: {gap:.4f} (vs the base model's: {moved:.4f})")
    assert max(theirs, key=theirs.get) == int(setup["lora"].argmax())
    assert gap < TOLERANCE
    assert moved > 20 * TOLERANCE  # the adapter moves the logits far more than the tolerance


def test_without_the_q_k_permutation_llama_cpp_would_disagree(setup):
    flat = _gap(llama_cpp_logprobs(setup["model"], setup["flat"], setup["ids"], setup["root"]), setup["lora"])
    print(f"an export without the q/k permutation: gap {flat:.4f}")
    assert flat > 20 * TOLERANCE
