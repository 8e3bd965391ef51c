// tx_jax's float32 GEMM for XLA:CPU: C = op(A) · op(B) through a CBLAS sgemm (MKL's), as an
// XLA FFI handler. Built on first use by tx_jax/layers/cpu_gemm.py, which hands over the
// sgemm (tx_jax_cpu_gemm_set_sgemm) and says why this exists.
//
// The BLAS runs single-threaded; the handler splits C into row (or column) blocks over
// XLA's own intra-op pool, so the GEMM shares the cores with XLA's other work instead of
// starting a second thread pool beside it. A block no pool thread has started when the
// calling thread finishes its own is run by the calling thread: the handler never waits on a
// queue, so it cannot deadlock when every pool thread is inside such a handler.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Sgemm = void (*)(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha,
                       const float* a, int lda, const float* b, int ldb, float beta, float* c,
                       int ldc);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
// Below this many FLOPs per block, handing a block to another thread costs more than it saves.
constexpr int64_t kMinBlockFlops = int64_t{4} << 20;
constexpr int64_t kMinBlockWidth = 16;

std::atomic<Sgemm> g_sgemm{nullptr};

struct Block {
  std::atomic<bool> claimed{false};
  std::atomic<bool> done{false};
};

// A batch of GEMMs C[i] = op(A[i]) · op(B[i]), cut into `parts` blocks: of the batch when
// there is one, else of C's rows (by_rows) or columns. Shared with pool tasks that may start
// after the handler has returned.
struct Job {
  Sgemm sgemm;
  const float* a;
  const float* b;
  float* c;
  int64_t batch, m, n, k, lda, ldb;
  bool trans_a, trans_b, by_rows;
  int parts;
  std::unique_ptr<Block[]> blocks;

  void Multiply(const float* a_i, const float* b_i, float* c_i, int64_t rows, int64_t cols) const {
    sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans,
          static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(k), 1.0f, a_i,
          static_cast<int>(lda), b_i, static_cast<int>(ldb), 0.0f, c_i, static_cast<int>(n));
  }

  void Run(int p) const {
    const int64_t a_size = m * k, b_size = k * n, c_size = m * n;
    if (batch > 1) {
      for (int64_t i = batch * p / parts; i < batch * (p + 1) / parts; ++i) {
        Multiply(a + i * a_size, b + i * b_size, c + i * c_size, m, n);
      }
      return;
    }
    const int64_t extent = by_rows ? m : n;
    const int64_t lo = extent * p / parts, hi = extent * (p + 1) / parts;
    if (hi <= lo) return;
    if (by_rows) {  // rows of op(A): A's columns when A is transposed
      Multiply(a + (trans_a ? lo : lo * lda), b, c + lo * n, hi - lo, n);
    } else {  // columns of op(B): B's rows when B is transposed
      Multiply(a, b + (trans_b ? lo * ldb : lo), c + lo, m, hi - lo);
    }
  }

  void RunUnlessTaken(int p) {
    if (blocks[p].claimed.exchange(true, std::memory_order_acq_rel)) return;
    Run(p);
    blocks[p].done.store(true, std::memory_order_release);
  }
};

// Operands [batch, ., .] (or 2-D, a batch of one); C = [batch, m, n].
ffi::Error Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b) {
  const Sgemm sgemm = g_sgemm.load();
  if (sgemm == nullptr) {
    return ffi::Error::Internal("tx_jax cpu_gemm: no sgemm was registered");
  }
  const auto a_dims = a.dimensions(), b_dims = b.dimensions(), c_dims = c->dimensions();
  const size_t rank = c_dims.size();
  if ((rank != 2 && rank != 3) || a_dims.size() != rank || b_dims.size() != rank) {
    return ffi::Error::InvalidArgument("tx_jax cpu_gemm: operands must be 2-D or 3-D alike");
  }
  const size_t r = rank - 2;  // the first matrix dimension
  const int64_t batch = rank == 3 ? c_dims[0] : 1;
  const int64_t m = c_dims[r], n = c_dims[r + 1], k = trans_a ? a_dims[r] : a_dims[r + 1];
  if ((rank == 3 && (a_dims[0] != batch || b_dims[0] != batch)) ||
      (trans_a ? a_dims[r + 1] : a_dims[r]) != m || (trans_b ? b_dims[r] : b_dims[r + 1]) != n ||
      (trans_b ? b_dims[r + 1] : b_dims[r]) != k) {
    return ffi::Error::InvalidArgument("tx_jax cpu_gemm: operand shapes do not match");
  }
  if (batch == 0 || m == 0 || n == 0) return ffi::Error::Success();
  float* out = c->typed_data();
  if (k == 0) {
    std::fill(out, out + batch * m * n, 0.0f);
    return ffi::Error::Success();
  }
  auto job = std::make_shared<Job>();
  job->sgemm = sgemm;
  job->a = a.typed_data();
  job->b = b.typed_data();
  job->c = out;
  job->batch = batch;
  job->m = m;
  job->n = n;
  job->k = k;
  job->lda = a_dims[r + 1];
  job->ldb = b_dims[r + 1];
  job->trans_a = trans_a;
  job->trans_b = trans_b;
  job->by_rows = m >= n;
  const int64_t width = batch > 1 ? batch : (job->by_rows ? m : n) / kMinBlockWidth;
  job->parts = static_cast<int>(std::max<int64_t>(
      1, std::min({static_cast<int64_t>(pool.num_threads()), width,
                   2 * batch * m * n * k / kMinBlockFlops})));
  job->blocks.reset(new Block[job->parts]);
  for (int p = 1; p < job->parts; ++p) pool.Schedule([job, p] { job->RunUnlessTaken(p); });
  job->RunUnlessTaken(0);
  for (int p = 1; p < job->parts; ++p) job->RunUnlessTaken(p);
  for (int p = 1; p < job->parts; ++p) {
    while (!job->blocks[p].done.load(std::memory_order_acquire)) std::this_thread::yield();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TxJaxCpuGemm, Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));

extern "C" void tx_jax_cpu_gemm_set_sgemm(void* sgemm) {
  g_sgemm.store(reinterpret_cast<Sgemm>(sgemm));
}
