// The library's C entry points: RegisterCustomOps (what ORT calls) and the metrics readers.
// Only these are exported (exports.map); nothing throws across them.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/cpu_features.h"
#include "common/metrics.h"
#include "ort/ops.h"

namespace {

constexpr const char* kDomain = "ai.ortsparse";

OrtStatus* error_status(const OrtApiBase* api_base, const std::string& message) {
  // API version 1 exists in every ORT, so an error can be reported even to a too-old runtime.
  const OrtApi* api = api_base->GetApi(1);
  return api->CreateStatus(ORT_FAIL, message.c_str());
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* api_base) {
  // ORTSPARSE_REQUIRE_ORT_API exists so tests can exercise the refusal path below.
  uint32_t required = ORT_API_VERSION;
  if (const char* forced = std::getenv("ORTSPARSE_REQUIRE_ORT_API")) required = static_cast<uint32_t>(std::atoi(forced));
  const OrtApi* api = required >= 1 ? api_base->GetApi(required) : nullptr;
  if (api == nullptr) {
    return error_status(api_base, std::string("ortsparse: this ONNX Runtime (") + api_base->GetVersionString() +
                                      ") is older than the API version the library was built for (" +
                                      std::to_string(required) + "); install onnxruntime >= 1." +
                                      std::to_string(required));
  }
  // Once per process: kernels of earlier sessions read the API table while a new session registers.
  static std::once_flag init_once;
  std::call_once(init_once, [api] { Ort::InitApi(api); });
  const std::string& isa_error = ortsparse::active_isa_error();
  if (!isa_error.empty()) return api->CreateStatus(ORT_FAIL, ("ortsparse: " + isa_error).c_str());
  try {
    static std::mutex mutex;
    static std::vector<Ort::CustomOpDomain>* domains = new std::vector<Ort::CustomOpDomain>();
    std::lock_guard<std::mutex> lock(mutex);
    Ort::CustomOpDomain domain(kDomain);
    domain.Add(ortsparse::ort::kwta_block_matmul_op());
    domain.Add(ortsparse::ort::event_driven_matmul_op());
    domain.Add(ortsparse::ort::proc_sparse_matmul_op());
    domain.Add(ortsparse::ort::popcount_attention_op());
    domain.Add(ortsparse::ort::popcount_group_query_attention_op());
    domain.Add(ortsparse::ort::tt_matmul_op());
    Ort::UnownedSessionOptions(options).Add(domain);
    domains->push_back(std::move(domain));  // must outlive every session that uses it
    return nullptr;
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, (std::string("ortsparse: RegisterCustomOps failed: ") + e.what()).c_str());
  } catch (...) {
    return api->CreateStatus(ORT_FAIL, "ortsparse: RegisterCustomOps failed");
  }
}

// One snapshot per call. If the JSON and its NUL fit in `capacity`, writes them and returns the
// JSON's length (< capacity); otherwise writes nothing and returns the length it needs
// (>= capacity): the caller retries with a bigger buffer and gets a newer, complete snapshot (a
// separate "how long?" call would race with sessions that change the JSON in between).
// Returns SIZE_MAX if the snapshot could not be made (out of memory).
__attribute__((visibility("default"))) size_t OrtSparseMetricsJson(char* buffer, size_t capacity) {
  try {
    const std::string json = ortsparse::metrics_json();
    if (buffer == nullptr || json.size() >= capacity) return json.size();
    std::memcpy(buffer, json.data(), json.size());
    buffer[json.size()] = '\0';
    return json.size();
  } catch (...) {
    return SIZE_MAX;
  }
}

__attribute__((visibility("default"))) void OrtSparseResetMetrics() {
  try {
    ortsparse::reset_metrics();
  } catch (...) {
  }
}

__attribute__((visibility("default"))) const char* OrtSparseActiveIsa() { return ortsparse::isa_name(ortsparse::active_isa()); }

}  // extern "C"
