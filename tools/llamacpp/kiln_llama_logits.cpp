// Next-token log-probabilities from llama.cpp itself, with LoRA adapters applied: the reference side
// of tests/adapters/test_export_llamacpp.py. Built against libllama by tools/build-llamacpp.
//
//   kiln-llama-logits MODEL.gguf TOP [--lora ADAPTER.gguf [--scale S]] [--raw] -- ID ID ID ...
//
// Feeds the token ids (no tokenizer involved, so both sides score the same ids) in one batch and
// prints the TOP most likely next tokens after the last one, one "id<TAB>logprob" line each, best first
// (with --raw, "id<TAB>logit": the logits themselves, not shifted by their log-sum-exp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "llama.h"

static void quiet(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

static int usage() {
  std::fputs("usage: kiln-llama-logits MODEL.gguf TOP [--lora ADAPTER.gguf [--scale S]] [--raw] -- ID ...\n", stderr);
  return 2;
}

int main(int argc, char** argv) {
  if (argc < 4) return usage();
  const char* model_path = argv[1];
  const int top = std::atoi(argv[2]);
  const char* lora_path = nullptr;
  float scale = 1.0f;
  bool raw = false;
  std::vector<llama_token> ids;
  int i = 3;
  for (; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    if (!std::strcmp(argv[i], "--lora") && i + 1 < argc) {
      lora_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--scale") && i + 1 < argc) {
      scale = std::strtof(argv[++i], nullptr);
    } else if (!std::strcmp(argv[i], "--raw")) {
      raw = true;
    } else {
      return usage();
    }
  }
  for (++i; i < argc; ++i) ids.push_back(static_cast<llama_token>(std::atoi(argv[i])));
  if (ids.empty() || top <= 0) return usage();

  llama_log_set(quiet, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(model_path, mp);
  if (!model) {
    std::fprintf(stderr, "could not load %s\n", model_path);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(std::max<size_t>(256, ids.size() + 1));
  cp.n_batch = cp.n_ctx;
  cp.n_ubatch = cp.n_ctx;
  cp.n_threads = cp.n_threads_batch = 2;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) {
    std::fputs("could not create a context\n", stderr);
    return 1;
  }
  if (lora_path) {
    llama_adapter_lora* lora = llama_adapter_lora_init(model, lora_path);
    if (!lora) {
      std::fprintf(stderr, "could not load the adapter %s\n", lora_path);
      return 1;
    }
    if (llama_set_adapters_lora(ctx, &lora, 1, &scale) != 0) {
      std::fputs("could not apply the adapter\n", stderr);
      return 1;
    }
  }
  llama_batch batch = llama_batch_get_one(ids.data(), static_cast<int32_t>(ids.size()));
  if (llama_decode(ctx, batch) != 0) {
    std::fputs("llama_decode failed\n", stderr);
    return 1;
  }
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  const float* logits = llama_get_logits_ith(ctx, -1);
  double mx = *std::max_element(logits, logits + n_vocab), sum = 0.0;
  for (int v = 0; v < n_vocab; ++v) sum += std::exp(static_cast<double>(logits[v]) - mx);
  const double lse = raw ? 0.0 : mx + std::log(sum);
  std::vector<int> order(n_vocab);
  std::iota(order.begin(), order.end(), 0);
  const int k = std::min(top, n_vocab);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  for (int j = 0; j < k; ++j) std::printf("%d\t%.9g\n", order[j], logits[order[j]] - lse);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
