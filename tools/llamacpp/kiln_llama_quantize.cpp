// llama.cpp's quantizer without its CLI's dependencies: `llama-quantize`'s plain form, built against
// libllama alone by `tools/build-llamacpp quantize` (seconds beside the logits harness's build, where
// llama-quantize itself needs llama.cpp's `common` library, minutes on 2 cores).
//
//   kiln-llama-quantize [--allow-requantize] IN.gguf OUT.gguf TYPE [NTHREADS]
//
// Same arguments and the same call as llama-quantize without an imatrix or overrides:
// llama_model_quantize() with llama_model_quantize_default_params(), so the files are byte for byte
// the ones llama-quantize writes. TYPE: F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_M, Q5_K_M, Q6_K.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>

#include "llama.h"

struct Named {
  const char* name;
  llama_ftype ftype;
};

static const Named TYPES[] = {
    {"F32", LLAMA_FTYPE_ALL_F32},         {"F16", LLAMA_FTYPE_MOSTLY_F16},
    {"Q8_0", LLAMA_FTYPE_MOSTLY_Q8_0},    {"Q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},
    {"Q4_1", LLAMA_FTYPE_MOSTLY_Q4_1},    {"Q5_0", LLAMA_FTYPE_MOSTLY_Q5_0},
    {"Q5_1", LLAMA_FTYPE_MOSTLY_Q5_1},    {"Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M},
    {"Q5_K_M", LLAMA_FTYPE_MOSTLY_Q5_K_M}, {"Q6_K", LLAMA_FTYPE_MOSTLY_Q6_K},
};

static int usage() {
  std::fputs("usage: kiln-llama-quantize [--allow-requantize] IN.gguf OUT.gguf TYPE [NTHREADS]\n"
             "TYPE: F32 F16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K_M Q5_K_M Q6_K\n", stderr);
  return 2;
}

static void quiet(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

int main(int argc, char** argv) {
  llama_model_quantize_params params = llama_model_quantize_default_params();
  int i = 1;
  for (; i < argc && !std::strncmp(argv[i], "--", 2); ++i) {
    if (!std::strcmp(argv[i], "--allow-requantize")) {
      params.allow_requantize = true;
    } else {
      return usage();
    }
  }
  if (argc - i < 3 || argc - i > 4) return usage();
  const char* in = argv[i];
  const char* out = argv[i + 1];
  const char* type = argv[i + 2];
  bool known = false;
  for (const Named& t : TYPES) {
    if (!strcasecmp(t.name, type)) {
      params.ftype = t.ftype;
      known = true;
    }
  }
  if (!known) return usage();
  if (argc - i == 4) params.nthread = std::atoi(argv[i + 3]);

  llama_log_set(quiet, nullptr);
  llama_backend_init();
  const uint32_t failed = llama_model_quantize(in, out, &params);
  llama_backend_free();
  if (failed) {
    std::fprintf(stderr, "failed to quantize %s to %s as %s\n", in, out, type);
    return 1;
  }
  return 0;
}
