// ortsparse._kernels, quant part: the quantized weight backend without ORT (kernel twin tests,
// comparisons with MatMulNBits, benchmarks).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "pybind/bindings_common.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/cpu_features.h"
#include "common/error.h"
#include "engine/quant_backend.h"

namespace py = pybind11;
using namespace ortsparse;
using bindings::FloatArray;
using bindings::IntArray;
using U8Array = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

namespace {

std::vector<int64_t> shape_of(const py::array& a) {
  std::vector<int64_t> shape;
  for (py::ssize_t i = 0; i < a.ndim(); ++i) shape.push_back(a.shape(i));
  return shape;
}

// Per token: None (dense) or its kept rows (ascending, in [0, K)).
engine::GatedRows gated_rows(const py::object& rows, const py::object& scale, size_t m, size_t k) {
  engine::GatedRows gated;
  std::vector<float> scales(m, 1.0f);
  if (!scale.is_none()) {
    FloatArray s = scale.cast<FloatArray>();
    if (static_cast<size_t>(s.size()) != m) throw py::value_error("scale must hold one value per token");
    std::copy(s.data(), s.data() + m, scales.begin());
  }
  if (rows.is_none()) {
    for (size_t t = 0; t < m; ++t) gated.add_dense_token();
    for (size_t t = 0; t < m; ++t) gated.scale[t] = scales[t];
    return gated;
  }
  py::list list = rows.cast<py::list>();
  if (list.size() != m) throw py::value_error("rows must hold one entry (None or a row list) per token");
  for (size_t t = 0; t < m; ++t) {
    if (list[t].is_none()) {
      gated.add_dense_token();
    } else {
      IntArray r = list[t].cast<IntArray>();
      for (py::ssize_t i = 0; i < r.size(); ++i) {
        if (r.data()[i] < 0 || static_cast<size_t>(r.data()[i]) >= k) throw py::index_error("row index out of range");
        if (i > 0 && r.data()[i] <= r.data()[i - 1]) throw py::value_error("row lists must be strictly ascending");
      }
      engine::BlockPartition part(k, 1);
      gated.add_token_blocks(part, r.data(), static_cast<size_t>(r.size()), 1.0f);
    }
    gated.scale[t] = scales[t];
  }
  return gated;
}

// Two threads for the benchmark's 2-thread rows only (the op library uses ORT's pool): the caller
// takes tasks too; the helper sleeps on a condition variable between calls (no spinning, like an
// ORT session with allow_spinning=0). The caller waits only for a helper that joined the call: a
// helper the OS has not scheduled yet when the caller ran out of tasks is simply left out.
class TwoThreadRunner final : public TaskRunner {
 public:
  TwoThreadRunner() : worker_([this] { loop(); }) {}
  ~TwoThreadRunner() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    worker_.join();
  }
  void run(size_t n_tasks, const std::function<void(size_t)>& fn) const override {
    if (n_tasks <= 1) {
      for (size_t i = 0; i < n_tasks; ++i) fn(i);
      return;
    }
    Job job{&fn, n_tasks};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      ++generation_;
    }
    wake_.notify_one();
    job.drain();
    std::unique_lock<std::mutex> lock(mutex_);
    job_ = nullptr;  // a helper that wakes from now on finds no job
    done_.wait(lock, [this] { return helper_active_ == 0; });
  }

 private:
  struct Job {
    const std::function<void(size_t)>* fn;
    size_t n;
    std::atomic<size_t> next{0};
    void drain() {
      for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) (*fn)(i);
    }
  };
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      Job* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (job_ == nullptr) continue;
        job = job_;
        ++helper_active_;
      }
      job->drain();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --helper_active_;
      }
      done_.notify_one();
    }
  }
  mutable std::mutex mutex_;
  mutable std::condition_variable wake_, done_;
  mutable Job* job_ = nullptr;
  mutable int helper_active_ = 0;
  mutable uint64_t generation_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

class QuantMatMul {
 public:
  QuantMatMul(py::array b, py::array scales, py::object zero_points, int64_t k, int64_t n, int64_t bits,
              int64_t block_size, size_t max_panel, const std::string& isa, size_t prefill_min_tokens,
              size_t decode_row_chunks, size_t decode_min_chunk_rows, size_t decode_parallel_min_bytes,
              int64_t accuracy_level, size_t decode_panel_tasks, const std::string& decode_dispatch)
      : kernels_(bindings::kernel_set(isa).quant) {
    if (b.dtype().kind() != 'u' || b.dtype().itemsize() != 1) throw Error("input B must be uint8");
    if (scales.dtype().kind() != 'f' || scales.dtype().itemsize() != 4) throw Error("input scales must be float32");
    b_ = U8Array::ensure(b);
    scales_ = FloatArray::ensure(scales);
    engine::MatMulNBitsTensors t;
    t.k = k;
    t.n = n;
    t.bits = bits;
    t.block_size = block_size;
    t.b = b_.data();
    t.b_shape = shape_of(b_);
    t.scales = scales_.data();
    t.scales_shape = shape_of(scales_);
    if (!zero_points.is_none()) {
      py::array zp = zero_points.cast<py::array>();
      t.zero_points_shape = shape_of(zp);
      if (zp.dtype().kind() == 'f') {
        t.zero_points_are_float = true;
        t.zero_points = zp.data();
      } else {
        if (zp.dtype().kind() != 'u' || zp.dtype().itemsize() != 1) throw Error("input zero_points must be uint8");
        zp_ = U8Array::ensure(zp);
        t.zero_points = zp_.data();
      }
    }
    weights_ = std::make_shared<const engine::QuantWeights>(t, max_panel);
    engine::QuantTuning tuning;
    tuning.prefill_min_tokens = prefill_min_tokens;
    tuning.decode_row_chunks = decode_row_chunks;
    tuning.decode_min_chunk_rows = decode_min_chunk_rows;
    tuning.decode_dispatch.min_units = decode_parallel_min_bytes;
    tuning.decode_panel_tasks = decode_panel_tasks;
    if (decode_dispatch != "measured" && decode_dispatch != "pool")
      throw Error("decode_dispatch must be 'measured' or 'pool', got '" + decode_dispatch + "'");
    tuning.decode_dispatch.measure = decode_dispatch == "measured";
    tuning.int8_decode = engine::int8_decode_for_accuracy_level(accuracy_level);
    backend_ = std::make_unique<engine::QuantBackend>(weights_, tuning);
    b_ = U8Array();  // repacked: the sources are no longer needed
    scales_ = FloatArray();
    zp_ = U8Array();
  }

  // out: None, or a C-contiguous float32 [M, N] array written in place (tests prefill it with NaN).
  // threads = 2: the benchmark's two-thread runner (tests check it gives the serial result).
  FloatArray call(FloatArray x, py::object rows, py::object scale, py::object bias, py::object out, size_t threads) {
    if (threads != 1 && threads != 2) throw py::value_error("threads must be 1 or 2");
    const size_t k = weights_->k(), n = weights_->n();
    const bindings::MatMulArgs args(x, bias, k, n);
    const engine::GatedRows gated = gated_rows(rows, scale, args.m, k);
    FloatArray y;
    if (out.is_none()) {
      y = FloatArray({args.m, n});
    } else {
      py::array given = out.cast<py::array>();
      if (!given.dtype().is(py::dtype::of<float>()) || !(given.flags() & py::array::c_style) || !given.writeable() ||
          given.ndim() != 2 || static_cast<size_t>(given.shape(0)) != args.m || static_cast<size_t>(given.shape(1)) != n)
        throw py::value_error("out must be a writable C-contiguous float32 [M, N] array");
      y = given.cast<FloatArray>();
    }
    {
      py::gil_scoped_release release;
      if (threads == 2) {
        backend_->run_quant(x.data(), args.m, gated, args.bias, y.mutable_data(), *kernels_, TwoThreadRunner());
      } else {
        backend_->run_quant(x.data(), args.m, gated, args.bias, y.mutable_data(), *kernels_, SerialTaskRunner());
      }
    }
    return y;
  }

  FloatArray dequantized() const {
    const std::vector<float> w = weights_->dequantized();
    FloatArray out({weights_->k(), weights_->n()});
    std::copy(w.begin(), w.end(), out.mutable_data());
    return out;
  }

  const engine::QuantBackend& backend() const { return *backend_; }
  const engine::QuantKernels& kernels() const { return *kernels_; }
  size_t bytes() const { return weights_->bytes(); }
  size_t panel() const { return weights_->packed().panel; }
  size_t num_panels() const { return weights_->packed().num_panels; }
  size_t k() const { return weights_->k(); }
  size_t n() const { return weights_->n(); }

 private:
  const engine::QuantKernels* kernels_;
  U8Array b_;
  FloatArray scales_;
  U8Array zp_;
  std::shared_ptr<const engine::QuantWeights> weights_;
  std::unique_ptr<engine::QuantBackend> backend_;
};

// Benchmark loop in C++: `runs` passes, each calling every weight copy once on the same x and row
// lists; returns the seconds per call of each pass (the caller takes the median).
FloatArray bench(const std::vector<QuantMatMul*>& copies, FloatArray x, py::object rows, size_t runs, size_t threads) {
  if (copies.empty()) throw py::value_error("no weight copies");
  const size_t k = copies[0]->k(), n = copies[0]->n();
  for (const QuantMatMul* c : copies)
    if (c->k() != k || c->n() != n) throw py::value_error("every copy must have the same K and N");
  const bindings::MatMulArgs args(x, py::none(), k, n);
  const engine::GatedRows gated = gated_rows(rows, py::none(), args.m, k);
  std::vector<float> y(args.m * n);
  FloatArray out(runs);
  {
    py::gil_scoped_release release;
    SerialTaskRunner serial;
    std::unique_ptr<TwoThreadRunner> pair;
    if (threads == 2) pair = std::make_unique<TwoThreadRunner>();
    const TaskRunner& runner = pair ? static_cast<const TaskRunner&>(*pair) : serial;
    for (size_t r = 0; r < runs; ++r) {
      const auto start = std::chrono::steady_clock::now();
      for (const QuantMatMul* c : copies)
        c->backend().run_quant(x.data(), args.m, gated, nullptr, y.data(), c->kernels(), runner);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      out.mutable_data()[r] = static_cast<float>(took.count() / copies.size());
    }
  }
  return out;
}

// One token's activations quantized by an ISA's kernel: (q int8, q16 int16, scale, sum) per block.
py::tuple quantize(const std::string& isa, FloatArray x, size_t block, float gate_scale) {
  if (x.ndim() != 1 || x.size() == 0) throw py::value_error("x must be a non-empty vector");
  if (block < 16 || block % 16) throw py::value_error("block must be a multiple of 16");
  const size_t k = x.size(), nb = (k + block - 1) / block;
  py::array_t<int8_t> q(nb * block);
  py::array_t<int16_t> q16(nb * block);
  FloatArray scale(nb);
  py::array_t<int32_t> sum(nb);
  bindings::kernel_set(isa).quant->quantize(x.data(), k, block, nb, gate_scale, q.mutable_data(), q16.mutable_data(), scale.mutable_data(),
                sum.mutable_data());
  return py::make_tuple(q, q16, scale, sum);
}

}  // namespace

void register_quant(py::module_& m) {
  py::class_<MeasuredDispatch>(m, "MeasuredDispatch")
      .def(py::init([](size_t trial_calls, size_t recheck_every) {
             return std::make_unique<MeasuredDispatch>(MeasuredDispatch::Settings{trial_calls, recheck_every});
           }),
           py::arg("trial_calls") = MeasuredDispatch::Settings{}.trial_calls,
           py::arg("recheck_every") = MeasuredDispatch::Settings{}.recheck_every)
      .def("next", [](MeasuredDispatch& d) {
        const MeasuredDispatch::Choice c = d.next();
        return py::make_tuple(c.pool, c.timed);
      }, "(pool, timed) for the next call")
      .def("record", [](MeasuredDispatch& d, bool pool, bool timed, double seconds_per_unit) {
        d.record({pool, timed}, seconds_per_unit);
      }, py::arg("pool"), py::arg("timed"), py::arg("seconds_per_unit"))
      .def_property_readonly("uses_pool", &MeasuredDispatch::uses_pool)
      .def_property_readonly("trials", &MeasuredDispatch::trials);
  m.def("quant_quantize", &quantize, py::arg("isa"), py::arg("x"), py::arg("block"), py::arg("gate_scale") = 1.0f);
  m.attr("QUANT_GROUP") = engine::kQuantGroup;
  m.attr("QUANT_MAX_PANEL") = engine::kQuantMaxPanel;
  py::class_<QuantMatMul>(m, "QuantMatMul")
      .def(py::init<py::array, py::array, py::object, int64_t, int64_t, int64_t, int64_t, size_t, const std::string&,
                    size_t, size_t, size_t, size_t, int64_t, size_t, const std::string&>(),
           py::arg("b"), py::arg("scales"), py::arg("zero_points"), py::arg("k"), py::arg("n"), py::arg("bits"),
           py::arg("block_size"), py::arg("max_panel") = engine::kQuantMaxPanel, py::arg("isa") = "active",
           py::arg("prefill_min_tokens") = engine::QuantTuning{}.prefill_min_tokens,
           py::arg("decode_row_chunks") = engine::QuantTuning{}.decode_row_chunks,
           py::arg("decode_min_chunk_rows") = engine::QuantTuning{}.decode_min_chunk_rows,
           py::arg("decode_parallel_min_bytes") = engine::QuantTuning{}.decode_dispatch.min_units,
           py::arg("accuracy_level") = 0,
           py::arg("decode_panel_tasks") = engine::QuantTuning{}.decode_panel_tasks,
           py::arg("decode_dispatch") = "measured")
      .def("__call__", &QuantMatMul::call, py::arg("x"), py::arg("rows") = py::none(), py::arg("scale") = py::none(),
           py::arg("bias") = py::none(), py::arg("out") = py::none(), py::arg("threads") = 1)
      .def("dequantized", &QuantMatMul::dequantized)
      .def_property_readonly("decode_uses_pool",
                             [](const QuantMatMul& q) { return q.backend().decode_dispatch().uses_pool(); })
      .def_property_readonly("decode_dispatch_trials",
                             [](const QuantMatMul& q) { return q.backend().decode_dispatch().trials(); })
      .def_property_readonly("bytes", &QuantMatMul::bytes)
      .def_property_readonly("panel", &QuantMatMul::panel)
      .def_property_readonly("num_panels", &QuantMatMul::num_panels);
  m.def("quant_bench", &bench, py::arg("copies"), py::arg("x"), py::arg("rows") = py::none(), py::arg("runs") = 50,
        py::arg("threads") = 1);
}
