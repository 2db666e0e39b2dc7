#include "ort/op_adapter.h"

#include <cmath>
#include <sstream>

namespace ortsparse::ort {

namespace {

bool succeeded(OrtStatus* status) {
  if (status == nullptr) return true;
  Ort::GetApi().ReleaseStatus(status);
  return false;
}

// ORT reports "missing" and "present with another type" alike; an attribute of the wrong type must
// not silently turn into the default, so look for it under the other scalar types.
const char* other_type_of(const OrtKernelInfo* info, const char* name, const char* wanted) {
  const OrtApi& api = Ort::GetApi();
  float f = 0.0f;
  int64_t i = 0;
  size_t size = 0;
  if (std::string(wanted) != "float" && succeeded(api.KernelInfoGetAttribute_float(info, name, &f))) return "float";
  if (std::string(wanted) != "int" && succeeded(api.KernelInfoGetAttribute_int64(info, name, &i))) return "int";
  if (std::string(wanted) != "string" && succeeded(api.KernelInfoGetAttribute_string(info, name, nullptr, &size)))
    return "string";
  return nullptr;
}

// A list where one value is expected (k_frac=[0.9]) would otherwise read as "missing". (ORT's
// array readers do not tell ints from floats apart, so the message does not name the list's type.)
bool is_list(const OrtKernelInfo* info, const char* name) {
  const OrtApi& api = Ort::GetApi();
  size_t size = 0;
  return succeeded(api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &size)) ||
         succeeded(api.KernelInfoGetAttributeArray_float(info, name, nullptr, &size));
}

void check_missing(const OrtKernelInfo* info, const char* name, const char* wanted) {
  if (const char* other = other_type_of(info, name, wanted))
    fail("attribute ", name, " must be of type ", wanted, ", not ", other);
  if (is_list(info, name)) fail("attribute ", name, " must be a single ", wanted, ", not a list");
}

}  // namespace

float Attributes::get_float(const char* name, float fallback) const {
  float value = 0.0f;
  if (succeeded(Ort::GetApi().KernelInfoGetAttribute_float(info_, name, &value))) {
    if (!std::isfinite(value)) fail("attribute ", name, "=", value, " must be a finite number");
    return value;
  }
  int64_t integer = 0;  // k_frac=1 written as an int attribute means 1.0: accept it
  if (succeeded(Ort::GetApi().KernelInfoGetAttribute_int64(info_, name, &integer))) return static_cast<float>(integer);
  check_missing(info_, name, "float");
  return fallback;
}

int64_t Attributes::get_int(const char* name, int64_t fallback) const {
  int64_t value = 0;
  if (succeeded(Ort::GetApi().KernelInfoGetAttribute_int64(info_, name, &value))) return value;
  check_missing(info_, name, "int");
  return fallback;
}

std::string Attributes::get_string(const char* name, const std::string& fallback) const {
  size_t size = 0;
  if (!succeeded(Ort::GetApi().KernelInfoGetAttribute_string(info_, name, nullptr, &size))) {
    check_missing(info_, name, "string");
    return fallback;
  }
  std::string value(size, '\0');
  if (!succeeded(Ort::GetApi().KernelInfoGetAttribute_string(info_, name, value.data(), &size))) return fallback;
  if (!value.empty() && value.back() == '\0') value.pop_back();
  return value;
}

std::vector<int64_t> Attributes::get_ints(const char* name) const {
  size_t size = 0;
  if (!succeeded(Ort::GetApi().KernelInfoGetAttributeArray_int64(info_, name, nullptr, &size)))
    fail("attribute ", name, " is required and must be a list of ints");
  std::vector<int64_t> out(size);
  if (size > 0 && !succeeded(Ort::GetApi().KernelInfoGetAttributeArray_int64(info_, name, out.data(), &size)))
    fail("attribute ", name, " could not be read as ints");
  return out;
}

std::string node_name(const OrtKernelInfo* info) {
  size_t size = 0;
  OrtStatus* status = Ort::GetApi().KernelInfo_GetNodeName(info, nullptr, &size);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return "?";
  }
  std::string name(size, '\0');
  status = Ort::GetApi().KernelInfo_GetNodeName(info, name.data(), &size);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return "?";
  }
  if (!name.empty() && name.back() == '\0') name.pop_back();
  return name;
}

namespace {
void run_task(void* user_data, size_t index) {
  (*static_cast<const std::function<void(size_t)>*>(user_data))(index);
}
}  // namespace

void OrtTaskRunner::run(size_t n_tasks, const std::function<void(size_t)>& fn) const {
  if (n_tasks == 0) return;
  if (n_tasks == 1) {
    fn(0);
    return;
  }
  Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(context_, run_task, n_tasks, 0,
                                                            const_cast<std::function<void(size_t)>*>(&fn)));
}

std::string element_type_name(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "double";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return "uint16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return "int16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING: return "string";
    default: return "element type " + std::to_string(static_cast<int>(type));
  }
}

ConstantTensor constant_float_input(const OrtKernelInfo* info, size_t index, const char* input_name, size_t rank) {
  Ort::ConstKernelInfo kinfo(info);
  if (index >= kinfo.GetInputCount()) fail("input ", input_name, " (#", index, ") is missing");
  int is_constant = 0;
  Ort::ConstValue value = kinfo.GetTensorConstantInput(index, &is_constant);
  if (!is_constant) {
    fail("input ", input_name, " (#", index, ", '", kinfo.GetInputName(index),
         "') must be a constant initializer (it is packed once at session creation); "
         "it is a graph input or computed at run time");
  }
  auto info_shape = value.GetTensorTypeAndShapeInfo();
  if (info_shape.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    fail("input ", input_name, " must be float32, got ", element_type_name(info_shape.GetElementType()));
  ConstantTensor out;
  out.shape = info_shape.GetShape();
  if (out.shape.size() != rank)
    fail("input ", input_name, " must have rank ", rank, ", got shape ", shape_string(out.shape));
  out.data = value.GetTensorData<float>();
  return out;
}

ConstantTensorAny constant_input(const OrtKernelInfo* info, size_t index, const char* input_name, const char* why) {
  Ort::ConstKernelInfo kinfo(info);
  if (index >= kinfo.GetInputCount()) fail("input ", input_name, " (#", index, ") is missing");
  int is_constant = 0;
  Ort::ConstValue value = kinfo.GetTensorConstantInput(index, &is_constant);
  if (!is_constant)
    fail("input ", input_name, " (#", index, ", '", kinfo.GetInputName(index), "') must be a constant initializer (",
         why, ")");
  auto info_shape = value.GetTensorTypeAndShapeInfo();
  ConstantTensorAny out;
  out.type = info_shape.GetElementType();
  out.shape = info_shape.GetShape();
  out.data = value.GetTensorRawData();
  return out;
}

bool input_present(const OrtKernelInfo* info, size_t index) {
  Ort::ConstKernelInfo kinfo(info);
  return index < kinfo.GetInputCount() && !kinfo.GetInputName(index).empty();
}

ONNXTensorElementDataType input_type(const OrtKernelInfo* info, size_t index) {
  Ort::ConstKernelInfo kinfo(info);
  return kinfo.GetInputTypeInfo(index).GetTensorTypeAndShapeInfo().GetElementType();
}

}  // namespace ortsparse::ort
