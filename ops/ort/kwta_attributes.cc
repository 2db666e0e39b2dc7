#include "ort/kwta_attributes.h"

#include "ort/op_schema.h"

namespace ortsparse::ort {

// The gate's defaults are KwtaBlockMatMul's (graph_rewrite/op_schema.json), k_frac aside: each op passes its own.
using Gate = schema::KwtaBlockMatMul;

engine::KwtaConfig read_kwta_attributes(const Attributes& attrs, const std::string& prefix, float default_k_frac) {
  const auto name = [&](const char* attribute) { return prefix + attribute; };
  engine::KwtaConfig c;
  c.k_frac = attrs.get_float(name("k_frac").c_str(), default_k_frac);
  c.k_abs = attrs.get_int(name("k_abs").c_str(), Gate::k_abs);
  c.score = engine::parse_kwta_score(attrs.get_string(name("score").c_str(), Gate::score));
  c.threshold = attrs.get_float(name("threshold").c_str(), Gate::threshold);
  c.temp = attrs.get_float(name("temp").c_str(), Gate::temp);
  c.duty = attrs.get_int(name("duty").c_str(), Gate::duty);
  c.duty_mode = engine::parse_duty_mode(attrs.get_string(name("duty_mode").c_str(), Gate::duty_mode));
  const int64_t renorm = attrs.get_int(name("renorm").c_str(), Gate::renorm);
  c.max_gated_rows = attrs.get_int(name("max_gated_rows").c_str(), Gate::max_gated_rows);
  if (c.max_gated_rows < 0)
    fail("attribute ", name("max_gated_rows"), "=", c.max_gated_rows, " must be >= 0 (0: gate every call)");
  if (!(c.k_frac > 0.0 && c.k_frac <= 1.0)) fail("attribute ", name("k_frac"), "=", c.k_frac, " must be in (0, 1]");
  if (c.k_abs < 0) fail("attribute ", name("k_abs"), "=", c.k_abs, " must be >= 0");
  if (!(c.threshold >= 0.0f)) fail("attribute ", name("threshold"), "=", c.threshold, " must be >= 0");
  if (!(c.temp > 0.0f)) fail("attribute ", name("temp"), "=", c.temp, " must be > 0");
  if (c.duty < 1) fail("attribute ", name("duty"), "=", c.duty, " must be >= 1");
  if (renorm != 0 && renorm != 1) fail("attribute ", name("renorm"), "=", renorm, " must be 0 or 1");
  c.renorm = renorm == 1;
  return c;
}

}  // namespace ortsparse::ort
