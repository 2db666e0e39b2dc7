#include "ort/matmul_io.h"

#include <limits>

namespace ortsparse::ort {

MatMulIo bind_matmul_io(Ort::KernelContext& context, size_t k, size_t n, size_t bias_index, size_t out_n,
                        const char* bias_name) {
  MatMulIo io;
  Ort::ConstValue x = context.GetInput(0);
  auto x_info = x.GetTensorTypeAndShapeInfo();
  if (x_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
    fail("input X must be float32, got ", element_type_name(x_info.GetElementType()));
  std::vector<int64_t> shape = x_info.GetShape();
  if (shape.empty()) fail("input X must have rank >= 1, got a scalar");
  if (shape.back() != static_cast<int64_t>(k))
    fail("input X has shape ", shape_string(shape), " but the weight has K = ", k, " rows (last dim of X must be K)");
  size_t m = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) {
    if (shape[i] < 0) fail("input X has a negative dim: ", shape_string(shape));
    const size_t d = static_cast<size_t>(shape[i]);
    if (d != 0 && m > std::numeric_limits<size_t>::max() / d / (k > n ? k : n))
      fail("input X shape ", shape_string(shape), " is too large");
    m *= d;
  }
  io.m = m;
  io.seq = shape.size() >= 2 ? static_cast<size_t>(shape[shape.size() - 2]) : 1;
  io.x = x.GetTensorData<float>();
  if (bias_index < context.GetInputCount()) {
    Ort::ConstValue b = context.GetInput(bias_index);
    if (b) {
      auto b_info = b.GetTensorTypeAndShapeInfo();
      if (b_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
        fail("input ", bias_name, " (#", bias_index, ") must be float32, got ", element_type_name(b_info.GetElementType()));
      if (b_info.GetElementCount() != n)
        fail("input ", bias_name, " (#", bias_index, ") has shape ", shape_string(b_info.GetShape()), " but N = ", n,
             " (the bias must hold N values)");
      io.bias = b.GetTensorData<float>();
    }
  }
  shape.back() = static_cast<int64_t>(out_n);
  Ort::UnownedValue y = context.GetOutput(0, shape);
  io.y = y.GetTensorMutableData<float>();
  return io;
}

engine::MatMulStats run_matmul(OrtKernelContext* raw_context, const engine::GatedMatMul& matmul, size_t bias_index,
                               bool reset, const char* bias_name) {
  Ort::KernelContext context(raw_context);
  const MatMulIo io = bind_matmul_io(context, matmul.k(), matmul.n(), bias_index, matmul.out_n(), bias_name);
  const size_t batch = io.seq == 0 ? 0 : io.m / io.seq;
  if (io.m == 0 && !reset) return engine::MatMulStats{};  // nothing to compute, nothing to count
  return matmul.run(io.x, batch, io.seq, io.bias, io.y, reset, kernel_set_or_fail(), OrtTaskRunner(raw_context));
}

const kernels::KernelSet& kernel_set_or_fail() {
  if (!kernels::active_kernel_set_error().empty()) fail(kernels::active_kernel_set_error());
  return kernels::active_kernel_set();
}

}  // namespace ortsparse::ort
