#include "attention/head_reuse.h"

#include "common/error.h"

namespace ortsparse::attention {

void validate(const HeadReuseConfig& c) {
  if (!(c.topk >= 0.0f && c.topk <= 1.0f))
    fail("attribute event_topk=", c.topk, " must be in [0, 1] (the fraction of uncertified heads re-ranked)");
  if (c.age_max < 1) fail("attribute event_age_max=", c.age_max, " must be >= 1");
  if (c.gap_every < 0) fail("attribute event_gap_every=", c.gap_every, " must be >= 0 (0: never)");
  if (!(c.gap_tol >= 0.0f) || !std::isfinite(c.gap_tol))
    fail("attribute event_gap_tol=", c.gap_tol, " must be a finite number >= 0");
}

bool reuse_certified(const HeadMemory& m, float delta_l1, float q_l1, size_t d, float scale) {
  if (!std::isfinite(delta_l1) || !std::isfinite(m.gap)) return m.gap == INFINITY && std::isfinite(delta_l1);
  // Rounding: each bound is a float dot of length 2D whose error is at most 2D·2^-24·|q|_1·max|k|
  // (as attention's bound_slack); both steps' bounds carry it, doubled again for room.
  const double slack = (8.0 * static_cast<double>(d) + 16.0) * 0x1.0p-24 * q_l1;
  const double move = (static_cast<double>(delta_l1) * (1.0 + 1e-6) + slack) * m.absmax * scale;
  return static_cast<double>(m.gap) > 2.0 * move;
}

void HeadReuse::report_gap(float gap, HeadReuseStats& stats) {
  if (disabled_ || !(gap <= config_.gap_tol)) {  // NaN counts as over
    if (!disabled_) ++stats.disables;
    disabled_ = true;
  }
}

}  // namespace ortsparse::attention
