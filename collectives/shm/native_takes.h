// Does the native path take this call? One answer, asked by the engine before each call and by
// Python through the engine's `takes_all_reduce` (direct.py, and the tests that count calls that
// fall to the Python path): process_group.py runs whatever this refuses, and docs/shm.md lists
// what it refuses and why.

#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <utility>
#include <vector>

#include "native_setup.h"

namespace shm_native {

class Takes {
 public:
  explicit Takes(const Setup& s) : setup_(s) {}

  static bool plain(const at::Tensor& t) {
    return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && !t.is_conj() && !t.is_neg();
  }
  int dtype_code(const at::Tensor& t) const {
    const int st = static_cast<int>(t.scalar_type());
    return st >= 0 && st < 64 ? setup_.dtype_codes[st] : -1;
  }
  bool reducible(int op, const at::Tensor& t) const {
    const int st = static_cast<int>(t.scalar_type());
    return op > 0 && op < 8 && st >= 0 && st < 64 && setup_.reducible[op][st];
  }
  // whether the native path reduces `t` with `rop` itself: a contiguous CPU tensor, an op it sums in
  // the dtype, and avg only on floating or complex dtypes (an integer average is the Python path's)
  bool reduces(const c10d::ReduceOp& rop, const at::Tensor& t) const {
    auto [op, avg] = op_of(rop);
    return plain(t) && reducible(op, t) && dtype_code(t) >= 0 && (!avg || t.is_floating_point() || t.is_complex());
  }
  // ReduceOp -> (native op, avg); op 0 when the native path does not take it
  static std::pair<int, bool> op_of(const c10d::ReduceOp& r) {
    switch (r.op_) {
      case c10d::ReduceOp::SUM: return {OP_SUM, false};
      case c10d::ReduceOp::AVG: return {OP_SUM, true};
      case c10d::ReduceOp::PRODUCT: return {OP_PRODUCT, false};
      case c10d::ReduceOp::MIN: return {OP_MIN, false};
      case c10d::ReduceOp::MAX: return {OP_MAX, false};
      case c10d::ReduceOp::BAND: return {OP_BAND, false};
      case c10d::ReduceOp::BOR: return {OP_BOR, false};
      case c10d::ReduceOp::BXOR: return {OP_BXOR, false};
      default: return {0, false};
    }
  }

  bool takes_all_gather(const at::Tensor& out, const at::Tensor& in) const {
    return plain(out) && plain(in) && out.scalar_type() == in.scalar_type() && dtype_code(in) >= 0 &&
           out.numel() == setup_.size * in.numel();
  }

  // Out of place, or in place: the output this rank's own chunk of the input (nccl-tests' in-place
  // column; Megatron's distributed optimizer). In place is safe because each round copies every
  // chunk's piece of the input into the slot before the meeting, and writes the output's piece
  // after it: a later round reads only pieces no earlier round wrote. Any other overlap: Python.
  bool takes_reduce_scatter(const at::Tensor& out, const at::Tensor& in, const c10d::ReduceOp& rop) const {
    return plain(out) && reduces(rop, in) && out.scalar_type() == in.scalar_type() &&
           in.numel() == setup_.size * out.numel() && (!overlaps(out, in) || own_chunk(out, in));
  }
  bool own_chunk(const at::Tensor& out, const at::Tensor& in) const {
    return static_cast<const char*>(out.data_ptr()) ==
           static_cast<const char*>(in.data_ptr()) + static_cast<int64_t>(setup_.rank) * out.nbytes();
  }

  bool takes_all_gather_list(const std::vector<at::Tensor>& outs, const at::Tensor& in) const {
    if (!plain(in) || dtype_code(in) < 0 || static_cast<int>(outs.size()) != setup_.size) return false;
    for (const auto& o : outs)
      if (!plain(o) || o.scalar_type() != in.scalar_type() || o.numel() != in.numel()) return false;
    return true;
  }

  // gather, scatter, all_to_all (routing.py): on contiguous tensors of one dtype, the arguments
  // as the Python path takes them (anything else goes there, which names what is wrong)
  bool alike(const std::vector<at::Tensor>& ts, const at::Tensor& like, bool same_numel = true) const {
    for (const auto& t : ts)
      if (!plain(t) || t.scalar_type() != like.scalar_type() || (same_numel && t.numel() != like.numel())) return false;
    return true;
  }

  // gather's and scatter's arguments as the Python path takes them (_wrong_rooted): one tensor on
  // every rank, and at the root a list of one like it per rank (*list), elsewhere no list
  bool rooted(const std::vector<at::Tensor>& one, const std::vector<std::vector<at::Tensor>>& listed, int root,
              std::vector<at::Tensor>* list) const {
    if (one.size() != 1 || !plain(one[0]) || dtype_code(one[0]) < 0 || root < 0 || root >= setup_.size ||
        listed.size() > 1)
      return false;
    *list = listed.empty() ? std::vector<at::Tensor>{} : listed[0];
    return setup_.rank == root ? static_cast<int>(list->size()) == setup_.size && alike(*list, one[0]) : list->empty();
  }

  static bool overlaps(const at::Tensor& a, const at::Tensor& b) {
    const char* a0 = static_cast<const char*>(a.data_ptr());
    const char* b0 = static_cast<const char*>(b.data_ptr());
    return a.nbytes() && b.nbytes() && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
  }

  // dist.all_reduce(t, op) on this group: a tensor and an op the native path reduces, below the
  // size that goes by cross-memory attach (a c10d RedOpType number: premul_sum is refused)
  bool takes_all_reduce(const at::Tensor& t, const c10d::ReduceOp& rop) const {
    return reduces(rop, t) && !(setup_.cma_min_bytes >= 0 && static_cast<int64_t>(t.nbytes()) >= setup_.cma_min_bytes);
  }
  bool takes_all_reduce(const at::Tensor& t, int op) const {
    if (op < 0 || op >= static_cast<int>(c10d::ReduceOp::PREMUL_SUM)) return false;
    return takes_all_reduce(t, c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op)));
  }

 protected:
  Setup setup_;
};

}  // namespace shm_native
