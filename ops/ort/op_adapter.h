// ORT glue shared by every op: the OrtCustomOp shell (CustomOpBase with status-returning entry
// points, so no exception ever crosses the C boundary), attribute readers with defaults, the
// intra-op pool as a TaskRunner, and the error text format "<Op> node '<name>': <what>".
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <exception>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/metrics.h"
#include "common/task_runner.h"

namespace ortsparse::ort {

struct InputSpec {
  ONNXTensorElementDataType type;
  bool optional;
};

// Attribute access with defaults: ORT reports a missing attribute as an error status, which here
// means "use the default".
class Attributes {
 public:
  explicit Attributes(const OrtKernelInfo* info) : info_(info) {}
  float get_float(const char* name, float fallback) const;
  int64_t get_int(const char* name, int64_t fallback) const;
  std::string get_string(const char* name, const std::string& fallback) const;
  // A required list of ints (throws naming the attribute when it is missing or not ints).
  std::vector<int64_t> get_ints(const char* name) const;

 private:
  const OrtKernelInfo* info_;
};

std::string node_name(const OrtKernelInfo* info);

class OrtTaskRunner final : public TaskRunner {
 public:
  explicit OrtTaskRunner(const OrtKernelContext* context) : context_(context) {}
  void run(size_t n_tasks, const std::function<void(size_t)>& fn) const override;

 private:
  const OrtKernelContext* context_;
};

// Base of every kernel: turns exceptions from Compute into an ORT status naming op and node.
template <typename Derived>
class KernelBase {
 public:
  KernelBase(const char* op_name, const OrtKernelInfo* info) : op_name_(op_name), node_name_(node_name(info)) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) noexcept {
    try {
      const MetricsBatch metrics_batch;  // one Compute's counts are published together
      static_cast<Derived*>(this)->Compute(context);
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, describe(e.what()).c_str());
    } catch (...) {
      return Ort::GetApi().CreateStatus(ORT_FAIL, describe("unknown error").c_str());
    }
  }

  const std::string& node() const { return node_name_; }
  std::string describe(const std::string& what) const {
    return std::string(op_name_) + " node '" + node_name_ + "': " + what;
  }

 private:
  const char* op_name_;
  std::string node_name_;
};

// The OrtCustomOp for kernel type K. K provides: static constexpr const char* kOpName;
// static std::vector<InputSpec> inputs(); static size_t output_count();
// K(const OrtApi&, const OrtKernelInfo*) (may throw); void Compute(OrtKernelContext*) (may throw).
template <typename K>
struct OpAdapter : Ort::CustomOpBase<OpAdapter<K>, K, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const noexcept {
    *kernel = nullptr;
    std::string node = "?";
    try {
      node = node_name(info);
      *kernel = new K(api, info);
      return nullptr;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string(K::kOpName) + " node '" + node + "': " + e.what()).c_str());
    } catch (...) {
      return api.CreateStatus(ORT_FAIL, (std::string(K::kOpName) + " node '" + node + "': unknown error").c_str());
    }
  }
  const char* GetName() const { return K::kOpName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return K::inputs().size(); }
  ONNXTensorElementDataType GetInputType(size_t index) const { return K::inputs()[index].type; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return K::inputs()[index].optional ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return K::output_count(); }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// Reads a constant float32 initializer input at kernel creation; throws naming the input when it
// is missing, not constant, not float32 or not of the expected rank.
struct ConstantTensor {
  const float* data = nullptr;
  std::vector<int64_t> shape;
};
ConstantTensor constant_float_input(const OrtKernelInfo* info, size_t index, const char* input_name, size_t rank);

// A constant initializer of any element type (packed or quantized weights); throws naming the input
// when it is missing or not constant (`why` says what the op does with it).
struct ConstantTensorAny {
  const void* data = nullptr;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> shape;
};
ConstantTensorAny constant_input(const OrtKernelInfo* info, size_t index, const char* input_name, const char* why);

// Whether optional input `index` is given (present and not the empty name).
bool input_present(const OrtKernelInfo* info, size_t index);
// The element type of input `index` as the graph declares it.
ONNXTensorElementDataType input_type(const OrtKernelInfo* info, size_t index);

// "float32", "double", "uint8", ... (the ONNX name of an element type, for error messages).
std::string element_type_name(ONNXTensorElementDataType type);

}  // namespace ortsparse::ort
