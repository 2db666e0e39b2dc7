// _kernels bindings of the attention engine: every ISA and popcount path callable in one process,
// so tests compare them all against the numpy reference.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "pybind/bindings_common.h"
#include <pybind11/stl.h>

#include <string>

#include "attention/popcount_attention.h"
#include "common/cpu_features.h"
#include "common/error.h"

namespace py = pybind11;
using namespace ortsparse;

namespace {

using bindings::FloatArray;


std::vector<size_t> shape4(const FloatArray& a, const char* name) {
  if (a.ndim() != 4) throw py::value_error(std::string(name) + " must be 4-D");
  return {static_cast<size_t>(a.shape(0)), static_cast<size_t>(a.shape(1)), static_cast<size_t>(a.shape(2)),
          static_cast<size_t>(a.shape(3))};
}

py::tuple run_op(const attention::PopcountAttention& op, FloatArray q, FloatArray k, FloatArray v, py::object mask);

attention::PopcountAttentionConfig make_config(float scale, bool causal, const std::string& mode, const std::string& select,
                                               int64_t topk, int64_t min_keys, float eps, float density_max,
                                               float candidates, bool pack_cache, int64_t keep_first,
                                               int64_t keep_recent, bool center, int64_t proj_bits) {
  attention::PopcountAttentionConfig c;
  c.scale = scale;
  c.causal = causal;
  c.mode = attention::parse_pack_mode(mode);
  c.select = attention::parse_selector(select);
  c.topk = topk;
  c.min_keys = min_keys;
  c.eps = eps;
  c.density_max = density_max;
  c.candidates = candidates;
  c.cache_keys = pack_cache;
  c.keep_first = keep_first;
  c.keep_recent = keep_recent;
  c.center = center;
  c.proj_bits = proj_bits;
  return c;
}

// A kernel instance that lives across calls (its packed-key cache too), as in an ORT session.
class AttentionOp {
 public:
  AttentionOp(float scale, bool causal, const std::string& mode, const std::string& select, int64_t topk,
              int64_t min_keys, float eps, float density_max, float candidates, bool pack_cache, int64_t keep_first,
              int64_t keep_recent, bool center, int64_t proj_bits, const std::string& isa, const std::string& popcnt)
      : op_(make_config(scale, causal, mode, select, topk, min_keys, eps, density_max, candidates, pack_cache,
                        keep_first, keep_recent, center, proj_bits),
            bindings::kernel_set(isa, popcnt)) {}
  py::tuple call(FloatArray q, FloatArray k, FloatArray v, py::object mask) { return run_op(op_, q, k, v, mask); }

 private:
  attention::PopcountAttention op_;
};

// mask: None, or a 4-D bool/float array whose dims are 1 or equal to [B, H, Sq, Skv].
py::tuple attention_call(FloatArray q, FloatArray k, FloatArray v, py::object mask, float scale, bool causal,
                         const std::string& mode, const std::string& select, int64_t topk, int64_t min_keys, float eps,
                         float density_max, float candidates, const std::string& isa, const std::string& popcnt,
                         bool pack_cache, int64_t keep_first, int64_t keep_recent, bool center, int64_t proj_bits) {
  const attention::PopcountAttention op(make_config(scale, causal, mode, select, topk, min_keys, eps, density_max,
                                                    candidates, pack_cache, keep_first, keep_recent, center, proj_bits),
                                        bindings::kernel_set(isa, popcnt));
  return run_op(op, q, k, v, mask);
}

py::tuple run_op(const attention::PopcountAttention& op, FloatArray q, FloatArray k, FloatArray v, py::object mask) {
  const auto qs = shape4(q, "q"), ks = shape4(k, "k"), vs = shape4(v, "v");
  attention::AttentionCall call;
  call.dims = attention::AttentionDims{qs[0], qs[1], ks[1], qs[2], ks[2], qs[3], vs[3]};
  const attention::AttentionDims& dims = call.dims;
  if (ks[0] != qs[0] || vs[0] != qs[0] || ks[3] != qs[3] || vs[1] != ks[1] || vs[2] != ks[2] || ks[1] == 0 ||
      qs[1] % ks[1] != 0)
    throw py::value_error("inconsistent q/k/v shapes");
  attention::MaskView& view = call.mask;
  py::array_t<uint8_t, py::array::c_style | py::array::forcecast> keep;
  FloatArray add;
  if (!mask.is_none()) {
    py::array m = mask.cast<py::array>();
    if (m.ndim() != 4) throw py::value_error("mask must be 4-D");
    const size_t full[4] = {qs[0], qs[1], qs[2], ks[2]};
    size_t stride = 1;
    for (int a = 3; a >= 0; --a) {
      const size_t md = static_cast<size_t>(m.shape(a));
      if (md != 1 && md != full[a]) throw py::value_error("mask not broadcastable");
      view.stride[a] = md == 1 ? 0 : stride;
      stride *= md;
    }
    if (m.dtype().kind() == 'b') {
      keep = m.cast<py::array_t<uint8_t, py::array::c_style | py::array::forcecast>>();
      view.keep = keep.data();
    } else {
      add = m.cast<FloatArray>();
      view.add = add.data();
    }
  }
  FloatArray y = bindings::nan_filled(std::vector<size_t>{qs[0], qs[1], qs[2], vs[3]});
  call.q = q.data();
  call.k = k.data();
  call.v = v.data();
  call.y = y.mutable_data();
  call.q_rows = attention::contiguous_bhsd(dims.h, dims.sq, dims.d);
  call.k_rows = attention::contiguous_bhsd(dims.hkv, dims.skv, dims.d);
  call.v_rows = attention::contiguous_bhsd(dims.hkv, dims.skv, dims.dv);
  call.y_rows = attention::contiguous_bhsd(dims.h, dims.sq, dims.dv);
  attention::AttentionStats st;
  {
    py::gil_scoped_release release;
    st = op.run(call, SerialTaskRunner());
  }
  py::dict stats;
  stats["packed"] = st.packed;
  stats["bits_set"] = st.bits_set;
  stats["bits_total"] = st.bits_total;
  stats["keys_total"] = st.keys_total;
  stats["keys_exact"] = st.keys_exact;
  stats["keys_packed"] = st.keys_packed;
  return py::make_tuple(y, stats);
}

// Approximate counts of one packed query against keys [N, D] on one popcount path: the integer
// before gamma (sign: D - 2·hamming; binary: |q∧k|; ternary: agree - disagree), plus gammas.
py::tuple popcount_counts(const std::string& path, const std::string& mode_name, FloatArray q, FloatArray keys, float eps,
                          const std::string& isa) {
  const kernels::KernelSet& set = bindings::kernel_set(isa, path);
  const kernels::AttentionKernels& attn = *set.attention;
  const attention::PackMode mode = attention::parse_pack_mode(mode_name);
  const kernels::PopcountKernels& table = *set.popcount;
  if (q.ndim() != 1 || keys.ndim() != 2 || keys.shape(1) != q.shape(0)) throw py::value_error("q [D], keys [N, D]");
  const size_t d = q.shape(0), n = keys.shape(0), words = (d + 63) / 64, planes = attention::pack_planes(mode);
  const size_t nb = (n + kernels::kLanes - 1) / kernels::kLanes;
  std::vector<uint64_t> packed(nb * planes * words * kernels::kLanes, 0), qbits(planes * words, 0);
  py::array_t<float> gk(n);
  uint64_t bits = 0;
  for (size_t j = 0; j < n; ++j)
    gk.mutable_data()[j] = attn.pack_row(keys.data() + j * d, d, static_cast<int>(mode), eps,
                                                  packed.data() + (j / kernels::kLanes) * planes * words * kernels::kLanes +
                                                      j % kernels::kLanes,
                                                  kernels::kLanes, &bits);
  const float gq = attn.pack_row(q.data(), d, static_cast<int>(mode), eps, qbits.data(), 1, &bits);
  std::vector<int32_t> counts(nb * kernels::kLanes);
  switch (mode) {
    case attention::PackMode::kSign: table.xor_counts(qbits.data(), packed.data(), words, nb, counts.data()); break;
    case attention::PackMode::kBinary: table.and_counts(qbits.data(), packed.data(), words, nb, counts.data()); break;
    case attention::PackMode::kTernary:
      table.ternary_counts(qbits.data(), qbits.data() + words, packed.data(), words, nb, counts.data());
      break;
  }
  py::array_t<int32_t> out(n);
  for (size_t j = 0; j < n; ++j)
    out.mutable_data()[j] = mode == attention::PackMode::kSign ? static_cast<int32_t>(d) - 2 * counts[j] : counts[j];
  return py::make_tuple(out, gq, gk);
}

// One step of the tiled prompt kernel (kernels::FlashTile) on one ISA: q [M, D] against keys
// [N, D] and values [N, Dv] (N <= kFlashKeys), optional bias [M, N] and per-row key ranges lo/hi
// [M]; the running state row_max, row_sum [M] and o [M, Dv] goes in and the updated copies come
// out. The scores scratch is NaN-filled (the kernel must write before it reads).
py::tuple flash_tile_step(const std::string& isa, FloatArray q, FloatArray keys, FloatArray values, float scale,
                          float softcap, py::object bias, py::object lo, py::object hi, FloatArray row_max,
                          FloatArray row_sum, FloatArray o) {
  using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
  if (q.ndim() != 2 || keys.ndim() != 2 || values.ndim() != 2 || keys.shape(1) != q.shape(1) ||
      values.shape(0) != keys.shape(0) || o.ndim() != 2 || o.shape(0) != q.shape(0) || o.shape(1) != values.shape(1))
    throw py::value_error("q [M, D], keys [N, D], values [N, Dv], o [M, Dv]");
  const size_t m = static_cast<size_t>(q.shape(0)), d = static_cast<size_t>(q.shape(1));
  const size_t n = static_cast<size_t>(keys.shape(0)), dv = static_cast<size_t>(values.shape(1));
  if (n == 0 || n > kernels::kFlashKeys) throw py::value_error("1 <= N <= kFlashKeys");
  if (static_cast<size_t>(row_max.size()) != m || static_cast<size_t>(row_sum.size()) != m)
    throw py::value_error("row_max, row_sum [M]");
  std::vector<float> kt(d * kernels::kFlashKeys, 0.0f);
  for (size_t j = 0; j < n; ++j)
    for (size_t c = 0; c < d; ++c) kt[c * kernels::kFlashKeys + j] = keys.data()[j * d + c];
  FloatArray bias_values, out_max(std::vector<size_t>{m}), out_sum(std::vector<size_t>{m});
  FloatArray out_o(std::vector<size_t>{m, dv});
  std::copy_n(row_max.data(), m, out_max.mutable_data());
  std::copy_n(row_sum.data(), m, out_sum.mutable_data());
  std::copy_n(o.data(), m * dv, out_o.mutable_data());
  I32 lo_values, hi_values;
  kernels::FlashTile t;
  if (!bias.is_none()) {
    bias_values = bias.cast<FloatArray>();
    if (bias_values.ndim() != 2 || static_cast<size_t>(bias_values.shape(0)) != m ||
        static_cast<size_t>(bias_values.shape(1)) != n)
      throw py::value_error("bias [M, N]");
    t.bias = bias_values.data();
    t.ldb = n;
  }
  if (!lo.is_none()) {
    lo_values = lo.cast<I32>();
    hi_values = hi.cast<I32>();
    if (static_cast<size_t>(lo_values.size()) != m || static_cast<size_t>(hi_values.size()) != m)
      throw py::value_error("lo, hi [M]");
    for (size_t r = 0; r < m; ++r)
      if (lo_values.data()[r] < 0 || hi_values.data()[r] < lo_values.data()[r] ||
          static_cast<size_t>(hi_values.data()[r]) > n)
        throw py::value_error("0 <= lo <= hi <= N");
    t.lo = lo_values.data();
    t.hi = hi_values.data();
  }
  FloatArray scores = bindings::nan_filled(std::vector<size_t>{m * kernels::kFlashKeys});
  t.q = q.data();
  t.kt = kt.data();
  t.v = values.data();
  t.ldv = dv;
  t.m = m;
  t.n = n;
  t.d = d;
  t.dv = dv;
  t.scale = scale;
  t.softcap = softcap;
  t.scores = scores.mutable_data();
  t.row_max = out_max.mutable_data();
  t.row_sum = out_sum.mutable_data();
  t.o = out_o.mutable_data();
  bindings::kernel_set(isa).attention->flash_tile(t);
  return py::make_tuple(out_max, out_sum, out_o);
}

}  // namespace

void register_attention(py::module_& m) {
  m.def("popcount_attention", &attention_call, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask") = py::none(),
        py::arg("scale") = 0.0f, py::arg("is_causal") = false, py::arg("mode") = "sign", py::arg("select") = "popcount",
        py::arg("topk") = 256, py::arg("min_keys") = 1024, py::arg("eps") = 1e-4f, py::arg("density_max") = 0.15f,
        py::arg("candidates") = 1.0f, py::arg("isa") = "active", py::arg("popcnt") = "active", py::arg("pack_cache") = true,
        py::arg("keep_first") = 0, py::arg("keep_recent") = 0, py::arg("center") = true, py::arg("proj_bits") = 0);
  m.def("projection_matrix", [](size_t d, size_t bits) {
    const std::vector<float> r = attention::projection_matrix(d, bits);
    py::array_t<float> out({d, bits});
    std::copy(r.begin(), r.end(), out.mutable_data());
    return out;
  }, py::arg("d"), py::arg("bits"));
  py::class_<AttentionOp>(m, "PopcountAttention")
      .def(py::init<float, bool, const std::string&, const std::string&, int64_t, int64_t, float, float, float, bool,
                    int64_t, int64_t, bool, int64_t, const std::string&, const std::string&>(),
           py::arg("scale") = 0.0f, py::arg("is_causal") = false, py::arg("mode") = "sign", py::arg("select") = "popcount",
           py::arg("topk") = 256, py::arg("min_keys") = 1024, py::arg("eps") = 1e-4f, py::arg("density_max") = 0.15f,
           py::arg("candidates") = 1.0f, py::arg("pack_cache") = true, py::arg("keep_first") = 0,
           py::arg("keep_recent") = 0, py::arg("center") = true, py::arg("proj_bits") = 0, py::arg("isa") = "active",
           py::arg("popcnt") = "active")
      .def("__call__", &AttentionOp::call, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask") = py::none());
  m.def("row_hash", [](const std::string& isa, FloatArray x, py::array_t<uint32_t, py::array::c_style | py::array::forcecast> key) {
    const size_t d = static_cast<size_t>(x.size());
    if (static_cast<size_t>(key.size()) != kernels::row_hash_key_words(d))
      throw py::value_error("key must have row_hash_key_words(d) words");
    uint64_t out[2] = {~uint64_t{0}, ~uint64_t{0}};
    bindings::kernel_set(isa).attention->row_hash(x.data(), d, key.data(), out);
    return py::make_tuple(out[0], out[1]);
  }, py::arg("isa"), py::arg("x"), py::arg("key"));
  // q [D] against rows of keys [N, D] (rows: optional int32 list of row indices).
  m.def("dot_rows", [](const std::string& isa, FloatArray q, FloatArray keys, py::object rows) {
    if (q.ndim() != 1 || keys.ndim() != 2 || keys.shape(1) != q.shape(0)) throw py::value_error("q [D], keys [N, D]");
    py::array_t<int32_t, py::array::c_style | py::array::forcecast> index;
    size_t n = static_cast<size_t>(keys.shape(0));
    if (!rows.is_none()) {
      index = rows.cast<py::array_t<int32_t, py::array::c_style | py::array::forcecast>>();
      for (ssize_t i = 0; i < index.size(); ++i)
        if (index.data()[i] < 0 || index.data()[i] >= keys.shape(0)) throw py::value_error("row out of range");
      n = static_cast<size_t>(index.size());
    }
    FloatArray out = bindings::nan_filled(std::vector<size_t>{n});
    bindings::kernel_set(isa).attention->dot_rows(q.data(), keys.data(), static_cast<size_t>(keys.shape(1)),
                                                  static_cast<size_t>(keys.shape(1)), rows.is_none() ? nullptr : index.data(),
                                                  n, out.mutable_data());
    return out;
  }, py::arg("isa"), py::arg("q"), py::arg("keys"), py::arg("rows") = py::none());
  // Rotary embedding of x [2·half] by cos, sin [half].
  m.def("rotate", [](const std::string& isa, FloatArray x, FloatArray cos, FloatArray sin, bool interleaved) {
    const size_t half = static_cast<size_t>(cos.size());
    if (static_cast<size_t>(sin.size()) != half || static_cast<size_t>(x.size()) != 2 * half)
      throw py::value_error("x [2·half], cos and sin [half]");
    FloatArray out = bindings::nan_filled(std::vector<size_t>{2 * half});
    bindings::kernel_set(isa).attention->rotate(x.data(), cos.data(), sin.data(), half, interleaved ? 1 : 0,
                                                out.mutable_data());
    return out;
  }, py::arg("isa"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("interleaved") = false);
  // (exp(x - shift), its sum) on one ISA.
  m.def("exp_sub", [](const std::string& isa, FloatArray x, float shift) {
    FloatArray out = bindings::nan_filled(std::vector<size_t>{static_cast<size_t>(x.size())});
    const double sum = bindings::kernel_set(isa).attention->exp_sub(x.data(), static_cast<size_t>(x.size()), shift,
                                                                    out.mutable_data());
    return py::make_tuple(out, sum);
  }, py::arg("isa"), py::arg("x"), py::arg("shift"));
  m.def("flash_tile", &flash_tile_step, py::arg("isa"), py::arg("q"), py::arg("keys"), py::arg("values"),
        py::arg("scale"), py::arg("softcap") = 0.0f, py::arg("bias") = py::none(), py::arg("lo") = py::none(),
        py::arg("hi") = py::none(), py::arg("row_max"), py::arg("row_sum"), py::arg("o"));
  m.attr("FLASH_KEYS") = kernels::kFlashKeys;
  m.def("popcount_counts", &popcount_counts, py::arg("path"), py::arg("mode"), py::arg("q"), py::arg("keys"),
        py::arg("eps") = 1e-4f, py::arg("isa") = "active");
  m.def("popcnt_paths", [] {
    std::vector<std::string> out;
    for (auto p : {kernels::PopcntPath::kPortable, kernels::PopcntPath::kPopcnt, kernels::PopcntPath::kVpopcntdq})
      if (kernels::popcnt_path_supported(p)) out.push_back(kernels::popcnt_path_name(p));
    return out;
  });
  m.def("active_popcnt", [] { return std::string(kernels::popcnt_path_name(kernels::active_kernel_set().popcnt_path)); });
}
