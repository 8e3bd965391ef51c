// tx_jax's float32 GEMM for XLA:CPU: C = op(A) · op(B) through a CBLAS sgemm (MKL's), as an
// XLA FFI handler. Built on first use by tx_jax/layers/cpu_gemm.py, which hands over the
// sgemm (tx_jax_cpu_gemm_set_sgemm) and says why this exists.
//
// The BLAS runs single-threaded; the handler splits C into row (or column) blocks over
// XLA's own intra-op pool, so the GEMM shares the cores with XLA's other work instead of
// starting a second thread pool beside it. A block no pool thread has started when the
// calling thread finishes its own is run by the calling thread: the handler never waits on a
// queue, so it cannot deadlock when every pool thread is inside such a handler.
//
// Two handlers: TxJaxCpuGemm for contiguous [batch, ., .] operands, and TxJaxCpuStridedGemm
// for matrices anywhere in their buffers (`View`), which attention reads in place.
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

// Where one operand's matrices lie in its buffer: matrix i = (i0, i1, i2) of the batch starts
// at offset + Σ i_j·stride[j] (a stride of 0 repeats one matrix along that batch dim), its
// rows are ld apart and its columns adjacent. trans: the stored matrix is op(X)ᵀ.
struct View {
  int64_t offset = 0;
  int64_t stride[3] = {0, 0, 0};
  int64_t ld = 0;
  bool trans = false;

  int64_t At(const int64_t index[3]) const {
    return offset + index[0] * stride[0] + index[1] * stride[1] + index[2] * stride[2];
  }
};

// A batch of GEMMs C[i] = op(A[i]) · op(B[i]), cut into `parts` blocks: of the batch when
// there is more than one matrix, else of C's rows (by_rows) or columns. Shared with pool
// tasks that may start after the handler has returned.
struct Job {
  Sgemm sgemm;
  const float* a;
  const float* b;
  float* c;
  int64_t batch[3] = {1, 1, 1};
  int64_t m, n, k;
  View va, vb, vc;
  bool by_rows;
  int parts;
  std::unique_ptr<Block[]> blocks;

  int64_t Count() const { return batch[0] * batch[1] * batch[2]; }

  // Rows [row0, row0 + rows) and columns [col0, col0 + cols) of C[i].
  void Multiply(int64_t i, int64_t row0, int64_t rows, int64_t col0, int64_t cols) const {
    const int64_t index[3] = {i / (batch[1] * batch[2]), i / batch[2] % batch[1], i % batch[2]};
    const float* a_i = a + va.At(index) + (va.trans ? row0 : row0 * va.ld);
    const float* b_i = b + vb.At(index) + (vb.trans ? col0 * vb.ld : col0);
    float* c_i = c + vc.At(index) + row0 * vc.ld + col0;
    sgemm(kRowMajor, va.trans ? kTrans : kNoTrans, vb.trans ? kTrans : kNoTrans,
          static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(k), 1.0f, a_i,
          static_cast<int>(va.ld), b_i, static_cast<int>(vb.ld), 0.0f, c_i,
          static_cast<int>(vc.ld));
  }

  void Run(int p) const {
    const int64_t count = Count();
    if (count > 1) {
      for (int64_t i = count * p / parts; i < count * (p + 1) / parts; ++i) Multiply(i, 0, m, 0, n);
      return;
    }
    const int64_t extent = by_rows ? m : n;
    const int64_t lo = extent * p / parts, hi = extent * (p + 1) / parts;
    if (hi <= lo) return;
    if (by_rows) {
      Multiply(0, lo, hi - lo, 0, n);
    } else {
      Multiply(0, 0, m, lo, hi - lo);
    }
  }

  void RunUnlessTaken(int p) {
    if (blocks[p].claimed.exchange(true, std::memory_order_acq_rel)) return;
    Run(p);
    blocks[p].done.store(true, std::memory_order_release);
  }
};

// Runs the job's blocks on the calling thread and XLA's pool, and returns when all are done.
void Execute(ffi::ThreadPool& pool, std::shared_ptr<Job> job) {
  const int64_t count = job->Count();
  job->by_rows = job->m >= job->n;
  const int64_t width = count > 1 ? count : (job->by_rows ? job->m : job->n) / kMinBlockWidth;
  job->parts = static_cast<int>(std::max<int64_t>(
      1, std::min({static_cast<int64_t>(pool.num_threads()), width,
                   2 * count * job->m * job->n * job->k / kMinBlockFlops})));
  job->blocks.reset(new Block[job->parts]);
  for (int p = 1; p < job->parts; ++p) pool.Schedule([job, p] { job->RunUnlessTaken(p); });
  job->RunUnlessTaken(0);
  for (int p = 1; p < job->parts; ++p) job->RunUnlessTaken(p);
  for (int p = 1; p < job->parts; ++p) {
    while (!job->blocks[p].done.load(std::memory_order_acquire)) std::this_thread::yield();
  }
}

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
  job->batch[0] = batch;
  job->m = m;
  job->n = n;
  job->k = k;
  job->va = View{0, {m * k, 0, 0}, a_dims[r + 1], trans_a};
  job->vb = View{0, {k * n, 0, 0}, b_dims[r + 1], trans_b};
  job->vc = View{0, {m * n, 0, 0}, n, false};
  Execute(pool, std::move(job));
  return ffi::Error::Success();
}

// view = [offset, stride0, stride1, stride2, ld, trans]; false where it reaches outside a
// buffer of `size` elements for a stored matrix of rows x cols per batch entry.
bool ReadView(ffi::Span<const int64_t> attr, const int64_t batch[3], int64_t rows, int64_t cols,
              int64_t size, View* view) {
  if (attr.size() != 6) return false;
  *view = View{attr[0], {attr[1], attr[2], attr[3]}, attr[4], attr[5] != 0};
  if (view->trans) std::swap(rows, cols);
  int64_t last = view->offset + (rows - 1) * view->ld + cols;
  for (int j = 0; j < 3; ++j) {
    if (view->stride[j] < 0) return false;
    last += (batch[j] - 1) * view->stride[j];
  }
  return view->offset >= 0 && view->ld >= std::max<int64_t>(cols, 1) && last <= size;
}

// C[i0, i1, i2] = op(A[i0, i1, i2]) · op(B[i0, i1, i2]) for matrices that lie anywhere in
// their buffers (`View`): a slice, a transposed or interleaved layout, read in place. shape =
// [batch0, batch1, batch2, m, n, k]; C's views must cover its buffer.
ffi::Error StridedGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                       ffi::ResultBuffer<ffi::F32> c, ffi::Span<const int64_t> shape,
                       ffi::Span<const int64_t> a_view, ffi::Span<const int64_t> b_view,
                       ffi::Span<const int64_t> c_view) {
  const Sgemm sgemm = g_sgemm.load();
  if (sgemm == nullptr) {
    return ffi::Error::Internal("tx_jax cpu_gemm: no sgemm was registered");
  }
  if (shape.size() != 6) {
    return ffi::Error::InvalidArgument("tx_jax cpu_gemm: shape is [b0, b1, b2, m, n, k]");
  }
  auto job = std::make_shared<Job>();
  for (int j = 0; j < 3; ++j) job->batch[j] = shape[j];
  job->m = shape[3];
  job->n = shape[4];
  job->k = shape[5];
  const int64_t count = job->Count(), c_size = static_cast<int64_t>(c->element_count());
  if (count <= 0 || job->m <= 0 || job->n <= 0 || job->k <= 0 ||
      count * job->m * job->n != c_size ||
      !ReadView(a_view, job->batch, job->m, job->k, a.element_count(), &job->va) ||
      !ReadView(b_view, job->batch, job->k, job->n, b.element_count(), &job->vb) ||
      !ReadView(c_view, job->batch, job->m, job->n, c_size, &job->vc) || job->vc.trans) {
    return ffi::Error::InvalidArgument("tx_jax cpu_gemm: a view lies outside its buffer");
  }
  job->sgemm = sgemm;
  job->a = a.typed_data();
  job->b = b.typed_data();
  job->c = c->typed_data();
  Execute(pool, std::move(job));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(TxJaxCpuStridedGemm, StridedGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("shape")
                                  .Attr<ffi::Span<const int64_t>>("a_view")
                                  .Attr<ffi::Span<const int64_t>>("b_view")
                                  .Attr<ffi::Span<const int64_t>>("c_view"));

extern "C" void tx_jax_cpu_gemm_set_sgemm(void* sgemm) {
  g_sgemm.store(reinterpret_cast<Sgemm>(sgemm));
}
