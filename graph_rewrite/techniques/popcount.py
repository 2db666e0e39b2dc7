"""Attention technique: attention cores -> ``ai.ortsparse.PopcountAttention``.

Settings are the op's attributes that are the user's choice (see docs/ops.md); ``scale`` and
``is_causal`` come from the matched graph, never from the user.

Flag mapping (documented in docs/rewriter.md):

- ``--attn=popcount`` -> ``select="popcount"`` (bitmap + popcount candidate keys, refined
  exactly when ``topk > 0``); on ``com.microsoft.GroupQueryAttention`` cores, ``--attn=popcount`` with
  every other ``--attn-*`` flag at its default means the recommended setting of that form,
  :data:`GQA_RECOMMENDED` (the budgeted page selector, see docs/ops.md);
- ``--attn=pages`` -> ``select="pages"``: keys grouped in pages with per-page min/max bounds of K,
  visited best bound first until no unvisited key can enter the top-k (certified top-k);
- ``--attn=energy`` -> ``select="energy"`` (KWTA's attention side: top keys by ||k||, the same
  key mask for K and V);
- ``--attn=none`` -> ``select="none"``: the op computes exact attention (used to check a rewrite);
- ``--attn=off`` (default) -> no attention rewrite;
- ``--kwta-target=attn|both``, when ``--attn`` is not given and KWTA is on (``--kwta=on``
  or its ``auto`` default), also turns attention on as ``energy`` (``config.config_from_flags``): KWTA on attention ("filter low-energy keys, same mask for K/V") is exactly
  ``select="energy"``; the q/k/v/out projections keep their KWTA meaning.

Composition: popcount-approximate scores (``select="popcount"`` with ``topk = 0``, no exact
refine) must not be combined with event-driven on attention: event-driven would reuse stale
approximate scores with no dense refine. :func:`check_composition` raises for that combination.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from ... import flag_types
from .. import op_schema
from ..errors import ConfigError
from .base import Flag, FlagGroup, Switch, TechniqueSettings

OP_TYPE = "PopcountAttention"
GQA_OP_TYPE = "PopcountGroupQueryAttention"  # the GroupQueryAttention form (graph_rewrite/attention_rules/ms_group_query_attention.py)
GQA_FORM = "com.microsoft.GroupQueryAttention"
ATTN_CHOICES = ("popcount", "energy", "pages", "none", "off")
MODES = ("sign", "binary", "ternary")
SELECTS = ("popcount", "energy", "pages", "none")
PREFILL_SELECTS = ("exact", "certified", "budget")
# The ops' defaults (graph_rewrite/op_schema.json, which the C++ readers read too).
_OP, _GQA = op_schema.defaults(OP_TYPE), op_schema.defaults(GQA_OP_TYPE)


@dataclasses.dataclass(frozen=True)
class AttentionSettings(TechniqueSettings):
    """User-chosen attributes of ``PopcountAttention``; the defaults are the op's (docs/ops.md), so
    a rewritten file written with every attribute means what the op's defaults mean today."""

    label: ClassVar[str] = "attention"
    float_fields: ClassVar[tuple[str, ...]] = ("eps", "density_max", "candidates", "event_topk", "event_gap_tol",
                                               "prefill_eps", "mass_eps")

    mode: str = _OP["mode"]
    select: str = _OP["select"]
    topk: int = _OP["topk"]
    min_keys: int = _OP["min_keys"]
    eps: float = _OP["eps"]
    density_max: float = _OP["density_max"]
    candidates: float = _OP["candidates"]
    keep_first: int = _OP["keep_first"]
    keep_recent: int = _OP["keep_recent"]
    pack_cache: int = _OP["pack_cache"]
    center: int = _OP["center"]
    proj_bits: int = _OP["proj_bits"]
    page_size: int = _OP["page_size"]
    # pages with a budget: a per-row budget, pages scored until a batch carries <= mass_eps of the
    # softmax mass seen (docs/ops.md "Mass mode"); 0: the plain budget.
    mass_eps: float = _OP["mass_eps"]
    verify_keys: int = _GQA["verify_keys"]  # GroupQueryAttention form only: key-summary reuse checked by row hash
    # Event-driven attention by heads (docs/ops.md, "Event-driven attention by heads"): decode steps
    # of the budgeted page selector reuse a head's page choice while its query moves little.
    event: int = _OP["event"]
    event_topk: float = _OP["event_topk"]  # of the heads the certificate does not cover, the fraction re-ranked
    event_age_max: int = _OP["event_age_max"]  # a head re-ranks after at most this many reuses in a row
    event_gap_every: int = _OP["event_gap_every"]  # every N steps the uncertified reuses are checked (0: never)
    event_gap_tol: float = _OP["event_gap_tol"]  # a checked gap above this disables reuse for the session
    # Selective prefill (docs/ops.md, "Selective prefill"): prompts skip key tiles by per-tile bounds.
    prefill_select: str = _OP["prefill_select"]  # exact | certified | budget
    prefill_eps: float = _OP["prefill_eps"]  # certified: softmax mass a prompt row may drop
    prefill_budget: int = _OP["prefill_budget"]  # budget: keys (in 64-key tiles) kept besides sink and recent

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode={self.mode!r} must be one of {', '.join(MODES)}")
        if self.select not in SELECTS:
            problems.append(f"select={self.select!r} must be one of {', '.join(SELECTS)}")
        if not (isinstance(self.topk, int) and not isinstance(self.topk, bool) and self.topk >= 0):
            problems.append(f"topk={self.topk!r} must be an integer >= 0")
        if not (isinstance(self.min_keys, int) and not isinstance(self.min_keys, bool) and self.min_keys >= 0):
            problems.append(f"min_keys={self.min_keys!r} must be an integer >= 0")
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0.0 and math.isfinite(self.eps)):
            problems.append(f"eps={self.eps!r} must be a finite number >= 0")
        if not (isinstance(self.density_max, (int, float)) and 0.0 < self.density_max <= 1.0):
            problems.append(f"density_max={self.density_max!r} must be in (0, 1]")
        if not (isinstance(self.candidates, (int, float)) and math.isfinite(self.candidates)
                and (self.candidates >= 1.0 or (self.candidates == 0 and self.select == "pages"))):
            problems.append(f"candidates={self.candidates!r} must be a finite number >= 1 (pages: or 0, no budget)")
        for name in ("keep_first", "keep_recent"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                problems.append(f"{name}={value!r} must be an integer >= 0")
        if not (isinstance(self.page_size, int) and not isinstance(self.page_size, bool) and 1 <= self.page_size <= 4096):
            problems.append(f"page_size={self.page_size!r} must be an integer in [1, 4096]")
        if not (isinstance(self.mass_eps, (int, float)) and 0.0 <= self.mass_eps < 1.0):
            problems.append(f"mass_eps={self.mass_eps!r} must be in [0, 1)")
        elif self.mass_eps > 0 and (self.select != "pages" or self.candidates == 0 or self.event):
            problems.append(f"mass_eps={self.mass_eps!r} needs select='pages' with candidates > 0 and event 0 (got "
                            f"select={self.select!r}, candidates={self.candidates!r}, event={self.event!r})")
        if not (isinstance(self.event_topk, (int, float)) and 0.0 <= self.event_topk <= 1.0):
            problems.append(f"event_topk={self.event_topk!r} must be in [0, 1]")
        if not (isinstance(self.event_age_max, int) and not isinstance(self.event_age_max, bool)
                and self.event_age_max >= 1):
            problems.append(f"event_age_max={self.event_age_max!r} must be an integer >= 1")
        if not (isinstance(self.event_gap_every, int) and not isinstance(self.event_gap_every, bool)
                and self.event_gap_every >= 0):
            problems.append(f"event_gap_every={self.event_gap_every!r} must be an integer >= 0")
        if not (isinstance(self.event_gap_tol, (int, float)) and math.isfinite(self.event_gap_tol)
                and self.event_gap_tol >= 0.0):
            problems.append(f"event_gap_tol={self.event_gap_tol!r} must be a finite number >= 0")
        if self.prefill_select not in PREFILL_SELECTS:
            problems.append(f"prefill_select={self.prefill_select!r} must be one of {', '.join(PREFILL_SELECTS)}")
        if not (isinstance(self.prefill_eps, (int, float)) and 0.0 <= self.prefill_eps < 1.0):
            problems.append(f"prefill_eps={self.prefill_eps!r} must be in [0, 1)")
        if not (isinstance(self.prefill_budget, int) and not isinstance(self.prefill_budget, bool)
                and self.prefill_budget >= 0):
            problems.append(f"prefill_budget={self.prefill_budget!r} must be an integer >= 0")
        for name in ("pack_cache", "center", "verify_keys", "event"):
            value = getattr(self, name)
            if value not in (0, 1) or isinstance(value, (bool, float)):
                problems.append(f"{name}={value!r} must be 0 or 1")
        if not (isinstance(self.proj_bits, int) and not isinstance(self.proj_bits, bool) and self.proj_bits >= 0):
            problems.append(f"proj_bits={self.proj_bits!r} must be an integer >= 0")
        if self.select in ("energy", "pages") and self.topk == 0:
            problems.append(f"select={self.select!r} needs topk > 0 (the number of keys kept)")
        if problems:
            raise ConfigError("invalid attention settings: " + "; ".join(problems))

    @property
    def exact(self) -> bool:
        """True when the op computes exact attention whatever the input (select none)."""
        return self.select == "none"

    def attributes(self) -> dict[str, Any]:
        # Every attribute is written, defaults included, so a file keeps its meaning if op defaults move
        # (event-driven reuse's and selective prefill's only when on: off is the op's meaning without them).
        attrs = {"mode": self.mode, "select": self.select, "topk": int(self.topk), "min_keys": int(self.min_keys),
                 "eps": float(self.eps), "density_max": float(self.density_max),
                 "candidates": float(self.candidates), "keep_first": int(self.keep_first),
                 "keep_recent": int(self.keep_recent), "pack_cache": int(self.pack_cache),
                 "center": int(self.center), "proj_bits": int(self.proj_bits), "page_size": int(self.page_size)}
        if self.event:
            attrs.update(event=1, event_topk=float(self.event_topk), event_age_max=int(self.event_age_max),
                         event_gap_every=int(self.event_gap_every), event_gap_tol=float(self.event_gap_tol))
        if self.mass_eps > 0:  # written only when on, as event-driven reuse: 0 is the op's meaning without it
            attrs["mass_eps"] = float(self.mass_eps)
        if self.prefill_select != "exact":
            attrs.update(prefill_select=self.prefill_select, prefill_eps=float(self.prefill_eps),
                         prefill_budget=int(self.prefill_budget))
        return attrs

    def gqa_attributes(self) -> dict[str, Any]:
        """The attributes of PopcountGroupQueryAttention: the common ones plus verify_keys."""
        return {**self.attributes(), "verify_keys": int(self.verify_keys)}

    def for_form(self, form: str) -> AttentionSettings:
        """The settings a core of ``form`` gets (:data:`FORMS`: ``--attn=popcount`` with every other
        flag at its default is, on GroupQueryAttention cores, :data:`GQA_RECOMMENDED`); else as given.
        The ``--attn-event*`` and ``--attn-prefill*`` settings are kept either way (they choose reuse
        and the prompt path, not the decode selection)."""
        return ATTENTION.build(form, self)[1]

    def short(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.attributes().items())


def check_composition(settings: AttentionSettings | None, event_on_attention: bool) -> None:
    """No popcount-approximate and event-driven on the same score without refine."""
    if settings is None or not event_on_attention:
        return
    if settings.select == "popcount" and settings.topk == 0:
        raise ConfigError("popcount-approximate attention scores (--attn=popcount with --attn-topk=0: no exact "
                          "refine) cannot be combined with event-driven on attention; set "
                          "--attn-topk > 0 or take attention out of --event-target")


_D = AttentionSettings()
EVENT_FIELDS = ("event", "event_topk", "event_age_max", "event_gap_every", "event_gap_tol")
PREFILL_FIELDS = ("prefill_select", "prefill_eps", "prefill_budget")
KEPT_FIELDS = EVENT_FIELDS + PREFILL_FIELDS  # as given on every form: not part of what --attn=popcount means
_PLAIN_POPCOUNT = AttentionSettings(select="popcount")
# The recommended selective setting of the GroupQueryAttention form (measured on SmolLM2: docs/ops.md): the
# op's own defaults.
GQA_RECOMMENDED = AttentionSettings(**{field.name: _GQA[field.name] for field in dataclasses.fields(AttentionSettings)
                                       if field.name in _GQA})

# The ``--attn*`` flags (see the module docstring for the mapping). ``--attn`` not given is None:
# config_from_flags then applies the --kwta-target=attn|both -> --attn=energy rule.
ATTENTION_FLAGS = FlagGroup(
    "attention (PopcountAttention); --kwta-target=attn|both means --attn=energy when --attn is not given",
    (
        Switch("--attn", field="select", choices=ATTN_CHOICES, default=None,
               help="rewrite attention cores: popcount (bitmap + popcount key selector; on GroupQueryAttention cores with no "
                    "other --attn-* flag: the recommended page setting), pages (certified top-k by per-page key "
                    "bounds), energy (keys by norm), none (exact attention in the op, for checking), "
                    "off (default)"),
        Flag("--attn-mode", field="mode", choices=MODES, default=_D.mode, help=f"bitmap mode (default {_D.mode})"),
        Flag("--attn-topk", field="topk", type=flag_types.non_negative_int, default=_D.topk, metavar="N",
             help=f"keys per query refined exactly; 0 = approximate scores only (default {_D.topk})"),
        Flag("--attn-min-keys", field="min_keys", type=flag_types.non_negative_int, default=_D.min_keys, metavar="N",
             help=f"below N keys the op computes exact attention (default {_D.min_keys})"),
        Flag("--attn-eps", field="eps", type=flag_types.non_negative_float, default=_D.eps, metavar="EPS",
             help=f"bit set when |x| > EPS (default {_D.eps:g})"),
        Flag("--attn-density-max", field="density_max", type=flag_types.fraction, default=_D.density_max, metavar="RHO",
             help=f"binary/ternary: a call whose key bitmap density exceeds RHO runs exact (default "
                  f"{_D.density_max:g}; 1 = never)"),
        Flag("--attn-candidates", field="candidates", type=flag_types.non_negative_float,
             default=_D.candidates, metavar="C",
             help="popcount: the selector keeps ceil(C*topk) keys, rescored exactly, best topk attended; pages: at "
                  "most ceil(C*topk) keys scored exactly, 0 = no budget (certified top-k) (default 1)"),
        Flag("--attn-keep-first", field="keep_first", type=flag_types.non_negative_int,
             default=_D.keep_first, metavar="N",
             help="first N keys (attention sinks) always kept (default 0)"),
        Flag("--attn-keep-recent", field="keep_recent", type=flag_types.non_negative_int,
             default=_D.keep_recent, metavar="N",
             help="last N keys of each query's prefix always kept (default 0)"),
        Flag("--attn-pack-cache", field="pack_cache", type=int, choices=(0, 1), default=_D.pack_cache,
             help="reuse the previous call's packed keys when the KV prefix is unchanged (default 1)"),
        Flag("--attn-center", field="center", type=int, choices=(0, 1), default=_D.center,
             help="pack keys minus the mean of the first 256 keys (default 1; exact ranking unchanged)"),
        Flag("--attn-proj-bits", field="proj_bits", type=flag_types.non_negative_int,
             default=_D.proj_bits, metavar="BITS",
             help="> 0: pack BITS random projections of q/k instead of their D signs (default 0; 256 measured best "
                  "on SmolLM2, docs/ops.md)"),
        Flag("--attn-page-size", field="page_size", type=flag_types.int_in(1, 4096), default=_D.page_size, metavar="N",
             help=f"--attn=pages: keys per page (default {_D.page_size})"),
        Flag("--attn-mass-eps", field="mass_eps", type=flag_types.non_negative_float, default=_D.mass_eps,
             metavar="EPS",
             help="--attn=pages with --attn-candidates > 0: a budget per query row: pages scored best bound first, "
                  "topk keys' worth at a time, up to ceil(C*topk) keys, until a batch carries <= EPS of the softmax "
                  "mass seen; every scored key kept (default 0: the plain budget)"),
        Flag("--attn-verify-keys", field="verify_keys", type=int, choices=(0, 1), default=_D.verify_keys,
             help="GroupQueryAttention cores: also check reused key summaries by hashing every reused key row "
                  "(exact whatever writes the KV buffer, but reads all keys each step; default 0: reuse by "
                  "provenance, see docs/ops.md)"),
        Flag("--attn-event", field="event", type=int, choices=(0, 1), default=_D.event,
             help="event-driven attention by heads: a decode step of the budgeted page selector (--attn=pages with "
                  "--attn-candidates > 0, or --attn=popcount alone on GroupQueryAttention cores; refused on cores "
                  "that select otherwise) reuses a head's page choice while its query moves little (exact under its "
                  "certificate; default 0)"),
        Flag("--attn-event-topk", field="event_topk", type=flag_types.unit_interval, default=_D.event_topk,
             metavar="FRAC",
             help="of the heads the certificate does not cover, the fraction (largest query change first) that "
                  "re-ranks; the rest reuse uncertified (default 1: certified reuse only)"),
        Flag("--attn-event-age-max", field="event_age_max", type=flag_types.positive_int, default=_D.event_age_max,
             metavar="N", help=f"a head re-ranks after at most N reuses in a row (default {_D.event_age_max})"),
        Flag("--attn-event-gap-every", field="event_gap_every", type=flag_types.non_negative_int,
             default=_D.event_gap_every, metavar="N",
             help=f"every N decode steps the uncertified reuses are also computed fully and compared (default "
                  f"{_D.event_gap_every}; 0: never)"),
        Flag("--attn-event-gap-tol", field="event_gap_tol", type=flag_types.non_negative_float,
             default=_D.event_gap_tol, metavar="REL",
             help=f"a checked relative L2 gap above REL disables reuse for the session (default {_D.event_gap_tol:g})"),
        Flag("--attn-prefill", field="prefill_select", choices=PREFILL_SELECTS, default=_D.prefill_select,
             help="prompts (calls of >= 16 query rows, tiled): exact (default), certified (skip 64-key tiles while "
                  "each row drops <= --attn-prefill-eps of its softmax mass, provably) or budget (the best "
                  "--attn-prefill-budget keys' tiles by bound); first and recent keys always kept; decode unchanged"),
        Flag("--attn-prefill-eps", field="prefill_eps", type=flag_types.non_negative_float, default=_D.prefill_eps,
             metavar="EPS", help=f"--attn-prefill=certified: softmax mass a prompt row may drop (default "
                                 f"{_D.prefill_eps:g})"),
        Flag("--attn-prefill-budget", field="prefill_budget", type=flag_types.non_negative_int,
             default=_D.prefill_budget, metavar="N",
             help=f"--attn-prefill=budget: keys per query block besides the first and recent ones, in 64-key tiles "
                  f"(default {_D.prefill_budget})"),
    ),
)


def attention_from_flags(values: Mapping[str, Any], select: str | None = None) -> AttentionSettings:
    """The settings the ``--attn-*`` flag values describe (``values``: flag dest -> value; absent
    flags take their defaults), with ``select`` (default: the ``--attn`` value)."""
    switch, *flags = ATTENTION_FLAGS.flags
    fields = {flag.field: values.get(flag.dest, flag.default) for flag in flags}
    return AttentionSettings(select=select or values.get(switch.dest), **fields)


# --------------------------------------------------------------------------- attention as a technique

CORES = "cores"  # the technique's kind: it replaces attention cores, not linear layers


@dataclasses.dataclass(frozen=True)
class AttentionForm:
    """What the technique emits for the cores of one form: the op, and what ``--attn=popcount`` with
    every other ``--attn-*`` flag at its default means there (None: the settings as given)."""

    op_type: str
    plain_popcount: AttentionSettings | None = None
    why: str = ""


# What ``--attn=popcount`` means on each attention form, stated once (the rewrite report prints it).
FORMS: dict[str, AttentionForm] = {
    GQA_FORM: AttentionForm(GQA_OP_TYPE, GQA_RECOMMENDED,
                            "the form's recommended page selector (measured on SmolLM2, docs/ops.md; the op's defaults)"),
}
OTHER_FORMS = AttentionForm(OP_TYPE)  # eager, SDPA, onnx Attention, com.microsoft Attention / MultiHeadAttention


class AttentionTechnique:
    """Attention as a technique, with the members the linear techniques have (techniques/base.py):
    settings, flags as data, the choice the flags describe, and :meth:`build` (per core form: the op
    and its settings). Its unit is an attention core, not a linear layer, so it has no ``--*-target``
    and no override key; its composition rule with event-driven is ``compose.check_attention``."""

    name = "attention"
    kind = CORES
    op_type = OP_TYPE
    settings_type = AttentionSettings
    title = ATTENTION_FLAGS.title
    switch: Switch = ATTENTION_FLAGS.flags[0]
    flags = ATTENTION_FLAGS.flags[1:]
    turns_off_auto = True  # an explicit --attn switches KWTA's auto off

    def flag_group(self) -> FlagGroup:
        return ATTENTION_FLAGS

    def flag_summary(self, settings: AttentionSettings) -> str:
        """How the CLI spells this choice, for reasons in the report (``--attn=pages``)."""
        return f"{self.switch.name}={settings.select}"

    def choice_from_flags(self, values: Mapping[str, Any], kwta: Any = None) -> tuple[AttentionSettings | None, str]:
        """(settings or None = off, why) that flag values describe. ``--attn`` not given: ``kwta``
        (KWTA's resolved global choice) on ``attn`` or ``both`` means ``--attn=energy`` (KWTA's
        attention side: low-energy keys dropped, the same key mask for K and V)."""
        given = values.get(self.switch.dest)
        if given is not None:
            why = f"{self.switch.name}={given}"
            return (attention_from_flags(values) if self.switch.enabled(given) else None), why
        if kwta is not None and kwta.enabled and kwta.target in ("attn", "both"):
            return (attention_from_flags(values, select="energy"),
                    f"--kwta-target={kwta.target} (KWTA on attention: low-energy keys dropped -> select=energy)")
        return None, "--attn not given (default off)"

    def form(self, form: str) -> AttentionForm:
        return FORMS.get(form, OTHER_FORMS)

    def build(self, form: str, settings: AttentionSettings, core: str = "") -> tuple[str, AttentionSettings, str]:
        """(op type, settings, what they mean: "" when as given) for a core of ``form`` (named ``core``
        in errors). Raises ConfigError when the settings ask for event-driven reuse the op would not do."""
        spec = self.form(form)
        event = {f: getattr(settings, f) for f in KEPT_FIELDS}  # reuse and the prompt path: kept as given
        built = (spec.op_type, settings, "")
        if spec.plain_popcount is not None and dataclasses.replace(settings, **{f: getattr(_D, f) for f in KEPT_FIELDS}) == _PLAIN_POPCOUNT:
            chosen = dataclasses.replace(spec.plain_popcount, **event)
            built = (spec.op_type, chosen,
                     f"{self.switch.name}=popcount on {form} cores means {spec.plain_popcount.short()}: {spec.why}")
        _refuse_idle_event(built[1], form, core)
        return built


def _refuse_idle_event(settings: AttentionSettings, form: str, core: str) -> None:
    """event=1 reuses the budgeted page selector's choice (select=pages, candidates > 0) and nothing
    else: on a core that selects otherwise the op would carry the attribute and never act on it, so
    the rewrite refuses it rather than write a setting that silently does nothing."""
    if not settings.event or (settings.select == "pages" and settings.candidates > 0):
        return
    got = "select=pages with candidates=0" if settings.select == "pages" else f"select={settings.select}"
    where = f"attention core '{core}' ({form})" if core else f"a {form} attention core"
    raise ConfigError(f"{where}: --attn-event=1 reuses the budgeted page selector's choice, but this core gets {got}; "
                      "use --attn=pages with --attn-candidates > 0 (or, on GroupQueryAttention cores, --attn=popcount "
                      "alone), or drop --attn-event")


ATTENTION = AttentionTechnique()
