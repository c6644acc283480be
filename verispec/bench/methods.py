"""Method strings of the harness: ``name[:key=value,...]`` parsed into a labelled :class:`SpecConfig`.

Examples: ``none``, ``draft``, ``draft:k=3``, ``draft:policy=cost``, ``layerskip:layers=7``,
``retrieval:datastore=store.vds``, ``ngram:k=8,max=5``, ``draft:vocab=32768`` (a reduced draft head),
``hybrid:window=256`` (the draft reads a long prompt's last 256 tokens), ``hybrid:vocab=0,window=0``
(the full head and the whole prompt), ``suffix:global=0,min_prob=0.2`` (suffix decoding over the request
alone, drafting only paths of probability 0.2 or more), ``hybrid:lookup=suffix`` (hybrid with the suffix
drafter as its context lookup), ``suffix:width=3`` (suffix drafts as token trees of up to 3 ways per node),
``hybrid:off=probes+margin`` (the default with those rules of the cost policy switched off, for an
ablation; the rules are :data:`~verispec.engine.policy.RULES`), ``hybrid:predict=1`` (the default with
each prompt's predicted output, where its dataset has one),
``hybrid:predict=other`` (with another prompt's: an unrelated prediction), ``none:predict=1`` (plain
decoding plus the prediction alone) and ``hybrid:constrain=1`` / ``none:constrain=1`` (answers constrained to
each prompt's JSON schema, where its dataset has one: ``json_extract``).
Options of the run rather than of the speculation apply to plain decoding (``none``) too: ``kernels``
(``none:kernels=q8``: an engine whose int4/int8 layers run the q8 kernels, loaded beside the run's), the
engine's slot settings ``batch_prefill`` (0: every prompt prefills in forwards of its own) and
``prefill_chunk`` (prompt tokens prefilled per step), run by an engine over the same loaded models, and the
sampling options ``temperature``, ``top_p`` and ``top_k`` (``hybrid:temperature=0.8,top_p=0.9``), which
override ``bench``'s --kernels, --temperature, --top-p and --top-k for that method, and ``presence_penalty``,
``frequency_penalty`` and ``logprobs`` (``none:logprobs=5``).
An option a string leaves out takes the run's defaults: :data:`~verispec.config.DEFAULT_SPEC` (what
``verispec generate`` runs), as ``bench``'s -k, --k-policy, --confidence, --draft-vocab and
--draft-window change it; so ``draft`` is the draft model under the default cost policy, and
``draft:policy=fixed,vocab=0,window=0,confidence=0`` the plain fixed-k draft model. 0 turns off
``vocab``, ``window`` and ``confidence``.
The label of a method is the string itself, so tables and plots show exactly what was asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from verispec.config import DEFAULT_SPEC, METHODS, PLAIN, SpecConfig
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

BASELINE = "plain"
"""Label of plain decoding, the baseline every speedup is measured against."""

# Options of the run a method may change, plain decoding included: the engine's (its kernels, and its slots'
# settings: prefill batching and chunk size) and sampling.
ENGINE_OPTIONS = ("kernels", "batch_prefill", "prefill_chunk")
RUN_OPTIONS: dict[str, tuple[str, type]] = {
    "kernels": ("kernels", str),
    "batch_prefill": ("batch_prefill", int),
    "prefill_chunk": ("prefill_chunk", int),
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "logprobs": ("logprobs", int),
}

# Option names accepted after the colon -> (SpecConfig field, parser). Short aliases keep labels readable.
OPTIONS: dict[str, tuple[str, type]] = {
    "k": ("k", int),
    "policy": ("k_policy", str),
    "k_policy": ("k_policy", str),
    "confidence": ("confidence", float),
    "max": ("ngram_max", int),
    "ngram_max": ("ngram_max", int),
    "min": ("ngram_min", int),
    "ngram_min": ("ngram_min", int),
    "datastore": ("datastore", str),
    "layers": ("layers", int),
    "vocab": ("draft_vocab", int),
    "draft_vocab": ("draft_vocab", int),
    "window": ("draft_window", int),
    "draft_window": ("draft_window", int),
    "lookup": ("lookup", str),
    "global": ("suffix_global", int),
    "suffix_global": ("suffix_global", int),
    "min_prob": ("suffix_min_prob", float),
    "suffix_min_prob": ("suffix_min_prob", float),
    "factor": ("suffix_factor", float),
    "suffix_factor": ("suffix_factor", float),
    "width": ("suffix_width", int),
    "suffix_width": ("suffix_width", int),
}


@dataclass(frozen=True)
class Method:
    """One decoding method of a benchmark run: its label, its settings and its k-sweep family."""

    label: str
    spec: SpecConfig
    explicit_k: bool = False  # the string set k itself (a k sweep leaves such methods alone)
    from_sweep: bool = False  # added by --k-sweep rather than asked for by name
    # Send each prompt's predicted output ("own") or another prompt's ("other"); "": none. Datasets with a
    # ``prediction`` field have them.
    predict: str = ""
    kernels: str | None = None  # the engine's kernels for this method (None: the run's --kernels)
    batch_prefill: int | None = None  # the engine's EngineConfig.batch_prefill (0/1; None: the default)
    prefill_chunk: int | None = None  # the engine's EngineConfig.prefill_chunk (None: the default)
    temperature: float | None = None  # sampling for this method (None: the run's)
    top_p: float | None = None
    top_k: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    policy_off: frozenset[str] = frozenset()  # cost-policy rules switched off while this method runs
    constrain: bool = False  # answers follow their prompt's JSON schema (datasets with a ``schema`` field)

    @property
    def is_baseline(self) -> bool:
        return not self.spec.enabled and not self.predict and not self.run_options and not self.constrain

    @property
    def is_plain(self) -> bool:
        """Plain decoding, whatever its kernels and sampling: no speculation and no prediction."""
        return not self.spec.enabled and not self.predict

    @property
    def run_options(self) -> dict[str, Any]:
        """The run's options this method changes (:data:`RUN_OPTIONS`)."""
        return {key: getattr(self, key) for key in RUN_OPTIONS if getattr(self, key) is not None}

    @property
    def slot_options(self) -> dict[str, Any]:
        """The :class:`~verispec.config.EngineConfig` fields beside the kernels this method changes: an engine
        over the same loaded models (``Engine.with_config``) runs it."""
        return {k: v if k != "batch_prefill" else bool(v) for k, v in self.run_options.items()
                if k in ENGINE_OPTIONS and k != "kernels"}

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """The run's sampling ``params`` with this method's own temperature, top-p and top-k."""
        own = {k: v for k, v in self.run_options.items() if k not in ENGINE_OPTIONS}
        return replace(params, **own) if own else params

    def kernels_or(self, default: str) -> str:
        return self.kernels or default

    @property
    def family(self) -> str:
        """The label without its ``k`` option: methods that differ only in k share a family."""
        name, _, opts = self.label.partition(":")
        rest = [o for o in opts.split(",") if o and o.split("=", 1)[0].strip() != "k"]
        return name + (":" + ",".join(rest) if rest else "")


def parse_method(text: str, defaults: SpecConfig = DEFAULT_SPEC) -> Method:
    """Parse ``name[:key=value,...]``; options left out take ``defaults``' values (its method aside)."""
    text = text.strip()
    name, _, opts = text.partition(":")
    name = name.strip()
    predict = _predict_option(text, opts)
    run = _run_options(text, opts)
    off = _policy_off(text, opts)
    constrain = _flag(text, opts, "constrain")
    opts = ",".join(o for o in opts.split(",")
                    if o.partition("=")[0].strip() not in (*PREDICT_KEYS, *RUN_OPTIONS, "off", "constrain"))
    if name in ("none", BASELINE):
        if opts.strip() or off:
            raise VerispecError(f"method '{text}': plain decoding takes no speculation options (only predict, "
                                f"constrain, {', '.join(RUN_OPTIONS)})")
        if predict or run or constrain:
            return Method(text, PLAIN, predict=predict, constrain=constrain, **run)
        return Method(BASELINE, PLAIN)
    if name not in METHODS:
        raise VerispecError(f"unknown method '{name}' in '{text}' (choose from {', '.join(METHODS)})")
    values: dict[str, Any] = {"method": name}
    explicit_k = False
    for opt in filter(None, (o.strip() for o in opts.split(","))):
        key, sep, raw = opt.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not raw:
            raise VerispecError(f"method '{text}': option '{opt}' is not key=value")
        if key not in OPTIONS:
            raise VerispecError(f"method '{text}': unknown option '{key}' (choose from {', '.join(OPTIONS)})")
        field, kind = OPTIONS[key]
        try:
            values[field] = kind(raw)
        except ValueError:
            raise VerispecError(f"method '{text}': {key} must be {kind.__name__} (got '{raw}')") from None
        explicit_k |= field == "k"
    spec = replace(defaults, **values)  # validates ranges and names
    if spec.k == 0:
        raise VerispecError(f"method '{text}': k=0 is plain decoding; use 'none'")
    if off and spec.k_policy != "cost":
        raise VerispecError(f"method '{text}': off= switches rules of the cost policy (policy=cost)")
    return Method(text, spec, explicit_k, predict=predict, policy_off=off, constrain=constrain, **run)


def _policy_off(text: str, opts: str) -> frozenset[str]:
    """The cost-policy rules a method string's ``off`` option switches off (``off=probes+margin``)."""
    from verispec.engine.policy import RULES

    off: set[str] = set()
    for opt in opts.split(","):
        key, _, raw = opt.partition("=")
        if key.strip() == "off":
            off |= {r.strip() for r in raw.split("+") if r.strip()}
    unknown = sorted(off - set(RULES))
    if unknown:
        raise VerispecError(f"method '{text}': unknown policy rule(s) {', '.join(unknown)} "
                            f"(choose from {', '.join(RULES)})")
    return frozenset(off)


def _run_options(text: str, opts: str) -> dict[str, Any]:
    """A method string's run options (:data:`RUN_OPTIONS`), parsed and checked."""
    from verispec.kernels import KERNEL_CHOICES

    values: dict[str, Any] = {}
    for opt in opts.split(","):
        key, _, raw = opt.partition("=")
        key, raw = key.strip(), raw.strip()
        if key not in RUN_OPTIONS:
            continue
        field, kind = RUN_OPTIONS[key]
        try:
            values[field] = kind(raw)
        except ValueError:
            raise VerispecError(f"method '{text}': {key} must be {kind.__name__} (got '{raw}')") from None
    if values.get("kernels", KERNEL_CHOICES[0]) not in KERNEL_CHOICES:
        raise VerispecError(f"method '{text}': kernels must be one of {', '.join(KERNEL_CHOICES)}")
    if values.get("batch_prefill", 0) not in (0, 1):
        raise VerispecError(f"method '{text}': batch_prefill must be 0 or 1")
    if values.get("prefill_chunk", 1) < 1:
        raise VerispecError(f"method '{text}': prefill_chunk must be at least 1")
    sampling = {k: v for k, v in values.items() if k not in ENGINE_OPTIONS}
    if sampling:
        replace(SamplingParams(), **sampling)  # validates the ranges
    return values


def reference(method: Method, methods: list[Method], kernels: str, params: SamplingParams) -> Method | None:
    """The plain-decoding method of ``methods`` that ``method`` must reproduce: the first with the same kernels
    and sampling (``kernels`` and ``params`` are the run's); None where there is none but ``method`` itself."""
    for m in methods:
        if (m.is_plain and not m.predict and m is not method and m.kernels_or(kernels) == method.kernels_or(kernels)
                and m.sampling(params) == method.sampling(params) and m.constrain == method.constrain):
            return m
    return None


PREDICT_KEYS = ("predict", "prediction")
PREDICT_VALUES = {"0": "", "1": "own", "own": "own", "other": "other"}


def _flag(text: str, opts: str, key: str) -> bool:
    """A 0/1 option of a method string (absent: 0)."""
    value = False
    for opt in opts.split(","):
        k, _, raw = opt.partition("=")
        if k.strip() == key:
            if raw.strip() not in ("0", "1"):
                raise VerispecError(f"method '{text}': {key} must be 0 or 1 (got '{raw.strip()}')")
            value = raw.strip() == "1"
    return value


def _predict_option(text: str, opts: str) -> str:
    """The ``predict`` option of a method string: "own" (1), "other" or "" (0, or absent)."""
    value = ""
    for opt in opts.split(","):
        key, _, raw = opt.partition("=")
        if key.strip() in PREDICT_KEYS:
            if raw.strip() not in PREDICT_VALUES:
                raise VerispecError(f"method '{text}': predict must be 0, 1, own or other (got '{raw.strip()}')")
            value = PREDICT_VALUES[raw.strip()]
    return value


def split_methods(text: str) -> list[str]:
    """Split a comma-separated method list, keeping a method's own ``key=value`` options attached.

    ``none,draft:k=3,policy=cost,ngram`` -> ``["none", "draft:k=3,policy=cost", "ngram"]``: a piece
    with ``=`` but no ``:`` continues the previous method's options.
    """
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece.split("=", 1)[0]:
            if not out or ":" not in out[-1]:
                raise VerispecError(f"option '{piece}' does not follow a method (write name:{piece})")
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def parse_methods(text: str, defaults: SpecConfig = DEFAULT_SPEC) -> list[Method]:
    """The baseline first, then each distinct method of the comma-separated ``text`` (see :func:`parse_method`)."""
    methods = [Method(BASELINE, PLAIN)]
    for piece in split_methods(text):
        m = parse_method(piece, defaults)
        if m.label not in {x.label for x in methods} and not m.is_baseline:
            methods.append(m)
    return methods


def with_k_sweep(methods: list[Method], ks: list[int]) -> list[Method]:
    """Add a variant per ``k`` in ``ks`` of every speculative method whose string did not fix k."""
    out = list(methods)
    seen = {(m.family, m.spec.k) for m in methods}
    for m in methods:
        if m.is_baseline or m.explicit_k:
            continue
        for k in ks:
            if (m.family, k) in seen:
                continue
            seen.add((m.family, k))
            label = f"{m.label},k={k}" if ":" in m.label else f"{m.label}:k={k}"
            out.append(replace(m, label=label, spec=replace(m.spec, k=k), explicit_k=True, from_sweep=True))
    return out


def parse_ints(text: str | None) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``; empty or None -> ``[]``."""
    if not text:
        return []
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise VerispecError(f"expected comma-separated integers (got '{text}')") from None
    if any(v < 1 for v in values):
        raise VerispecError(f"k values must be >= 1 (got '{text}')")
    return values


def spec_dict(spec: SpecConfig) -> dict[str, Any]:
    """A SpecConfig as a plain dict for the report."""
    return {f.name: getattr(spec, f.name) for f in fields(spec)}
