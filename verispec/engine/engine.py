"""The engine: loads a target (and optionally a draft model) and generates, plain or speculative."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

import torch

from verispec import hub
from verispec.config import PLAIN, EngineConfig, SpecConfig, resolve_dtype
from verispec.drafters import make_drafter
from verispec.drafters.base import DraftContext, Drafter
from verispec.engine.compiled import cache_slack, compile_model
from verispec.engine.metrics import Metrics, seconds_of
from verispec.engine.policy import (
    PROFILE_K,
    Acceptance,
    AnswerLengths,
    ContextCost,
    CostModel,
    make_policy,
    per_position_s,
)
from verispec.engine.prefix import SlotPrefixes, held_tokens
from verispec.engine.step import speculative_step
from verispec.engine.stopping import StepTokens, append_tokens, final_text, k_cap
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.models.linear import matmul_kernels
from verispec.models.llama import Transformer
from verispec.models.loader import build_model, load_tokenizer, open_source, resolve_weights
from verispec.sampling import SamplingParams

Prompt = str | list[int] | list[dict[str, str]]


@dataclass
class GenerationResult:
    """One request's output: text (when a tokenizer is present), token ids and what it measured."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS or a stop string), "length" or "cancelled"
    metrics: Metrics = field(repr=False)


class TargetTiming(NamedTuple):
    """The target's part of a profile: seconds to score 1..k_max+1 tokens, and per scored token and further position."""

    verify_s: list[float]
    per_position_s: float


def check_tokenizers_match(target_tok: Any, draft_tok: Any, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft whose tokens mean something else than the target's.

    Embedding tables may differ in padding (e.g. 151936 rows for 151665 real tokens), so
    the tokenizers themselves are compared: same vocabulary and same special tokens.
    """
    if target_tok is None or draft_tok is None:
        if target_vocab != draft_vocab:
            raise VerispecError(f"draft and target vocabularies differ in size ({draft_vocab} vs {target_vocab})"
                                " and there is no tokenizer to compare")
        return
    vt, vd = target_tok.get_vocab(), draft_tok.get_vocab()
    if vt != vd:
        diff = sorted(set(vt.items()) ^ set(vd.items()), key=lambda kv: kv[1])
        raise VerispecError(f"draft and target tokenizers differ ({len(diff)} mismatched entries, e.g. "
                            f"{diff[0]!r}); pick a draft model from the target's family")
    if set(target_tok.all_special_tokens) != set(draft_tok.all_special_tokens) or \
            target_tok.eos_token != draft_tok.eos_token:
        raise VerispecError("draft and target tokenizers have different special tokens")
    if len(vt) > min(target_vocab, draft_vocab):
        raise VerispecError(f"tokenizer has {len(vt)} tokens but a model embeds only {min(target_vocab, draft_vocab)}")


class Engine:
    """Generates from a target model, optionally speculating with a drafter.

    Build with :meth:`from_pretrained`; call :meth:`generate`. Requests run one at a time on a
    one-row target cache; with ``prefix_reuse`` (default True) the row keeps a finished request's
    K/V, and the next request prefills only what its prompt does not share with it
    (:mod:`verispec.engine.prefix`; drafters begin afresh either way).
    """

    def __init__(self, config: EngineConfig, target: Transformer, tokenizer: Any | None, eos_ids: set[int],
                 draft: Transformer | None = None, draft_tokenizer: Any | None = None) -> None:
        self.config = config
        for model in (target, draft):
            if model is not None and config.max_len > model.args.max_position_embeddings:
                raise VerispecError(f"max_len {config.max_len} exceeds the model's context length "
                                    f"{model.args.max_position_embeddings}")
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.eos_ids = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        if draft is not None:
            check_tokenizers_match(tokenizer, draft_tokenizer, target.args.vocab_size, draft.args.vocab_size)
        # A compiled forward pads m up to a bucket; slack positions keep padding off real entries.
        self.cache_len = config.max_len + (cache_slack() if config.compile else 0)
        self.cache = target.new_cache(1, self.cache_len)
        self.prefix_reuse = True
        self._prefixes = SlotPrefixes(1)  # the tokens row 0 holds after the last request
        if config.compile:
            compile_model(target, self.cache_len, warmup=tuple(range(1, config.compile_k + 2)))
            if draft is not None:
                compile_model(draft, self.cache_len, warmup=(1, 2))
        self._drafters: dict[str, Drafter] = {}
        self._costs: dict[str, CostModel] = {}
        self._target_timings: dict[int, TargetTiming] = {}  # per profiled k_max: shared by every drafter's costs
        # Per drafter, over all requests: where a new request's acceptance estimate starts.
        self._seen_acceptance: dict[str, Acceptance] = {}
        self.answer_lengths = AnswerLengths()  # how long answers run: the cost policy's horizon

    @classmethod
    def from_pretrained(cls, model: str, draft: str | None = None, **kwargs: Any) -> Engine:
        """Load ``model`` (registry name, GGUF file or Hugging Face folder) and optionally a ``draft``.

        ``draft="auto"`` is the registry's draft partner of ``model`` when it is installed; without
        one the engine loads no draft model and says so in one logged line. Keyword arguments are
        :class:`EngineConfig` fields (dtype, max_len, weights, ...); the engine's ``config`` holds the
        resolved draft and weight formats (``"auto"`` resolved by :func:`resolve_weights`).
        """
        config = EngineConfig(model=model, draft=draft, **kwargs)
        draft, why = hub.resolve_draft(model, draft)
        if why:
            logger.warning(why)
        src = open_source(model)
        tokenizer = load_tokenizer(src)
        dsrc = open_source(draft) if draft is not None else None
        config = replace(config, draft=draft, weights=resolve_weights(src, config.weights, tp=config.tp),
                         draft_weights=config.draft_weights if dsrc is None else
                         resolve_weights(dsrc, config.draft_weights, draft=True))
        draft_tok = load_tokenizer(dsrc) if dsrc is not None else None
        if dsrc is not None:  # refuse a mismatched pair before spending time on weights
            check_tokenizers_match(tokenizer, draft_tok, src.args.vocab_size, dsrc.args.vocab_size)
        dtype = resolve_dtype(config.dtype, config.target_device)
        target = build_model(src, dtype, config.weights, config.progress, kernels=config.kernels)
        target = target.to(config.target_device)
        if config.tp > 1:  # rank 0 of a torchrun launch: shard, and mirror every target forward on the other ranks
            from verispec.parallel.tp import lead

            target = lead(target, config.tp)
        draft_model = None
        if dsrc is not None:
            ddtype = resolve_dtype(config.draft_dtype or config.dtype, config.draft_device)
            draft_model = build_model(dsrc, ddtype, config.draft_weights, config.progress,
                                      kernels=config.kernels).to(config.draft_device)
        logger.info("loaded %s (%s, %s)%s", src.path.name, dtype, config.weights,
                    f" with draft {draft} ({config.draft_weights})" if draft else "")
        return cls(config, target, tokenizer, src.eos_token_ids, draft_model, draft_tok)

    def describe(self, spec: SpecConfig | None = None) -> dict[str, Any]:
        """The configuration a request with ``spec`` (None: plain decoding) runs, every value resolved.

        Models and their weight formats as loaded (``draft`` and ``draft_weights`` None without a
        draft model), the target's compute dtype, the speculation settings (``confidence`` is the
        threshold in force, 0 when off; ``draft_vocab`` / ``draft_window`` None when off) and
        ``kernels``: which matmuls the projections run, ``"verispec"`` (:mod:`verispec.kernels`),
        ``"stock"`` (PyTorch's) or ``"mixed"``.
        """
        spec = spec or PLAIN
        has_draft = self.draft is not None
        return {"model": self.config.model, "draft": self.config.draft if has_draft else None,
                "weights": self.config.weights, "draft_weights": self.config.draft_weights if has_draft else None,
                "dtype": str(self.target.dtype).removeprefix("torch."), "method": spec.method,
                "k_policy": spec.k_policy, "k": spec.k, "confidence": spec.min_confidence,
                "draft_vocab": spec.draft_vocab, "draft_window": spec.draft_window,
                "kernels": matmul_kernels(self.target, self.draft)}

    # -- drafters -------------------------------------------------------------------------

    @property
    def draft_context(self) -> DraftContext:
        """What drafters for this engine are built from (its models, cache and tokenizer)."""
        return DraftContext(self.target, self.cache, self.draft, self.tokenizer, frozenset(self.eos_ids),
                            self.cache_len, self.config.compile)

    def drafter(self, spec: SpecConfig) -> Drafter | None:
        """The drafter for ``spec`` (created once and reused across requests)."""
        if not spec.enabled:
            return None
        key = spec.drafter_key
        if key not in self._drafters:
            self._drafters[key] = make_drafter(spec, self.draft_context)
        return self._drafters[key]

    def cost_model(self, spec: SpecConfig, drafter: Drafter, k_max: int | None = None) -> CostModel:
        """Measured draft and verification costs for ``spec``'s drafter: profiled once, then refreshed online.

        The first use profiles k up to ``k_max`` (default: the larger of ``spec.k`` and
        :data:`~verispec.engine.policy.PROFILE_K`); the target's part of it is measured once per
        ``k_max`` and shared by every drafter's model. A request asking for a larger k later is
        priced by extending the verification curve (:meth:`CostModel.score_s`), never profiled
        again: a server profiles up front, for its largest k, before it serves.
        """
        key = spec.drafter_key
        costs = self._costs.get(key)
        if costs is None:
            k_max = max(spec.k, PROFILE_K) if k_max is None else k_max
            costs = self._costs[key] = self.profile(drafter, k_max, target=self._target_timings.get(k_max))
            self._target_timings.setdefault(k_max, TargetTiming(list(costs.verify_s), costs.per_position.target_s))
        return costs

    @torch.inference_mode()
    def profile(self, drafter: Drafter | None, k_max: int, context: int = 64, reps: int = 5,
                long_context: int | None = None, target: TargetTiming | None = None) -> CostModel:
        """Time target forwards of 1..k_max+1 tokens and one draft token on a dummy context.

        What each further position of context costs is timed at ``long_context`` (default 8 x
        ``context``, within ``max_len``; not at all if that is not longer): a request spends most
        of its steps far past a 64-token context. ``target`` reuses the target's timings from an
        earlier profile at the same ``k_max`` and contexts (only the drafter is timed then).
        """
        vocab = self.target.args.vocab_size
        context = max(2, min(context, self.config.max_len - k_max - 2))
        long_context = max(context, min(8 * context if long_context is None else long_context,
                                        self.config.max_len - k_max - 2))
        seq = [(7 * i + 3) % vocab for i in range(long_context)]
        self._prefixes.forget(0)
        self.cache.reset(0)
        dev = self.target.device
        self.target(torch.tensor([seq[:context - 1]], device=dev), torch.arange(context - 1, device=dev).unsqueeze(0),
                    self.cache, last_only=True)
        self.cache.lengths[0] = context - 1  # it holds seq[:context - 1], as a drafter sharing it (layerskip) needs

        def score_s(at: int, m: int) -> float:  # keys past what was written are stale: same time
            tokens = torch.tensor([[(7 * i + 3) % vocab for i in range(m)]], device=dev)  # m even past seq's end
            pos = torch.arange(at - 1, at - 1 + m, device=dev).unsqueeze(0)
            times = seconds_of(lambda: self.target(tokens, pos, self.cache, kv_len=at - 1 + m), dev, reps, warmup=0)
            return min(times)  # noise only ever adds time

        widths = (1, k_max + 1) if long_context > context else ()
        if target is not None and len(target.verify_s) == k_max + 1:
            verify_s, target_per_position = list(target.verify_s), target.per_position_s
        else:
            verify_s = [score_s(context, m) for m in range(1, k_max + 2)]
            target_per_position = per_position_s({(1, m): verify_s[m - 1] for m in widths},
                                                 {(1, m): score_s(long_context, m) for m in widths}, context,
                                                 long_context)
        draft_s = catch_up_s = draft_per_position = 0.0
        if drafter is not None:
            greedy = SamplingParams(max_tokens=k_max + 1)
            short = seq[:context]
            drafter.begin(short)
            reads = drafter.catch_up_tokens(short)
            drafter.propose(short, 1, greedy, None)  # warm-up, and catch up on the context
            catch_up = []
            for _ in range(2 if reads else 0):
                drafter.begin(short)
                t0 = time.perf_counter()
                drafter.propose(short, 1, greedy, None)
                catch_up.append(time.perf_counter() - t0)
            draft_s = self._draft_token_s(drafter, short, greedy, reps)
            if reads:
                catch_up_s = max(0.0, min(catch_up) - draft_s) / reads
            if widths:
                # Timing only: a drafter reading the target's cache sees the long context's length (what
                # lies past the prefilled part is dummies; the cache is reset below).
                self.cache.lengths[0] = long_context - 1
                drafter.begin(seq)
                drafter.propose(seq, 1, greedy, None)  # catch up on the long context
                draft_per_position = per_position_s({(1, 1): draft_s},
                                                    {(1, 1): self._draft_token_s(drafter, seq, greedy, reps)},
                                                    context, long_context)
        self.cache.reset(0)
        logger.info("profiled costs at %d-token context: draft %.1f ms/token, catch-up %.2f ms/token, verify %s ms; "
                    "per token and further position: target %.2g s, draft %.2g s", context, draft_s * 1e3,
                    catch_up_s * 1e3, [round(t * 1e3, 1) for t in verify_s], target_per_position, draft_per_position)
        return CostModel(draft_s, verify_s, catch_up_s,
                         per_position=ContextCost(context, target_per_position, draft_per_position))

    @staticmethod
    def _draft_token_s(drafter: Drafter, seq: list[int], greedy: SamplingParams, reps: int) -> float:
        """The fastest of ``reps`` proposals after ``seq`` (already read), per drafted token."""
        per_token = []
        for _ in range(reps):
            drafter.commit(len(seq) - 1)
            t0 = time.perf_counter()
            n = len(drafter.propose(seq, 4, greedy, None).tokens)
            per_token.append((time.perf_counter() - t0) / max(n, 1))
        return min(per_token)

    # -- tokenization ---------------------------------------------------------------------

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or chat messages (``chat=True`` for a string)."""
        vocab = self.target.args.vocab_size
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < vocab for t in ids):
                raise VerispecError(f"token ids must be in [0, {vocab})")
        else:
            if self.tokenizer is None:
                raise VerispecError("this model has no tokenizer; pass token ids")
            if isinstance(prompt, list) or chat:
                messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                if not self.tokenizer.chat_template:
                    raise VerispecError("this model's tokenizer has no chat template")
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                ids = list(ids)
            elif isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            else:
                raise VerispecError("a prompt is a string, a list of token ids or a list of chat messages")
        if not ids:
            bos = self.tokenizer.bos_token_id if self.tokenizer is not None else None
            if bos is None:
                raise VerispecError("the prompt is empty and this model has no BOS token to start from")
            ids = [bos]
        if len(ids) >= self.config.max_len:
            raise VerispecError(f"the prompt has {len(ids)} tokens but the context holds {self.config.max_len} "
                                "(one position must be left to generate)")
        return ids

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- generation -----------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None,
                 spec: SpecConfig | None = None, chat: bool = False,
                 drafter: Drafter | None = None,
                 on_tokens: Callable[[int, list[int]], bool | None] | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts; returns one result per prompt.

        ``spec=None`` decodes plainly. ``drafter`` plugs in a custom :class:`Drafter` instead of
        the one ``spec.method`` names (``spec.k`` still applies). Every prompt is encoded and
        checked before any work starts, so one bad prompt costs nothing.

        ``on_tokens(i, tokens)`` is called after every step with the tokens prompt ``i`` just
        gained (streaming); returning False cancels that request (finish reason "cancelled").
        ``tokens`` is a :class:`~verispec.engine.stopping.StepTokens`: a list whose ``drafted``
        attribute counts its leading tokens that were accepted drafts.
        """
        params = params or SamplingParams()
        spec = spec or PLAIN
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int | dict)):
            prompts = [prompts]
        if params.stop and self.tokenizer is None:
            raise VerispecError("stop strings need a tokenizer")
        encoded = [self.encode(p, chat) for p in prompts]
        if drafter is None:
            drafter = self.drafter(spec)
        return [self._generate_one(ids, params, spec, drafter, on_tokens and partial(on_tokens, i))
                for i, ids in enumerate(encoded)]

    @torch.inference_mode()
    def _generate_one(self, prompt: list[int], params: SamplingParams, spec: SpecConfig, drafter: Drafter | None,
                      on_tokens: Callable[[list[int]], bool | None] | None) -> GenerationResult:
        # Before the prefill and the clock: a first use of the cost policy profiles on this cache.
        costs = self.cost_model(spec, drafter) if spec.k_policy == "cost" and drafter else None
        # The cost policy starts from what this drafter achieved on earlier requests.
        seen = None if costs is None else \
            self._seen_acceptance.setdefault(spec.drafter_key, Acceptance(decay=0.98))
        policy = make_policy(spec, costs, None if seen is None else seen.rate)
        m = Metrics(requests=1, prompt_tokens=len(prompt))
        t0 = time.perf_counter()
        # On the target's device: verification samples there (the draft keeps its own if elsewhere).
        generator = None if params.greedy else params.generator(self.target.device)
        seq = list(prompt)
        # Prefill all but the last prompt token (the first step scores it with the first draft), from
        # what the last request left in the row that this prompt starts with. The record counts only
        # if the row still has the length it left with (nothing else rolled it back or reset it).
        if not self.prefix_reuse or len(self._prefixes.held(0)) != self.cache.lengths[0]:
            self._prefixes.forget(0)
        done = self.cache.lengths[0] = m.prefix_reused_tokens = self._prefixes.claim(0, prompt)
        if len(prompt) - 1 > done:
            with m.timed("prefill"):
                dev = self.target.device
                pos = torch.arange(done, len(prompt) - 1, device=dev).unsqueeze(0)
                self.target(torch.tensor([prompt[done:-1]], device=dev), pos, self.cache, last_only=True)
                self.cache.lengths[0] = len(prompt) - 1
        if drafter is not None:
            drafter.begin(prompt)
        out: list[int] = []
        finish = None
        while finish is None:
            room = self.config.max_len - len(seq)  # positions left; a step uses k + 1 of them
            if room < 1:
                finish = "length"
                break
            cap = k_cap(spec.k, params, len(out), room)
            horizon = self.answer_lengths.expected_remaining(len(out), min(params.max_tokens - len(out), room))
            # A trusted lookup costs no draft time: it is drafted whatever the policy would say, and
            # the policy learns nothing from it (its acceptance and costs are the model drafter's).
            free = drafter.free_tokens(seq, cap, params, generator) if drafter is not None and cap else 0
            k = free or (policy.choose(cap, horizon, drafter.catch_up_tokens(seq), len(seq))
                         if drafter is not None else 0)
            drafted, accepted, propose_s, score_s = m.drafted, m.accepted, m.stage_s["propose"], m.stage_s["score"]
            new = speculative_step(self.target, self.cache, seq, drafter, k, params, generator, m)
            if not free:
                policy.update(k, m.drafted - drafted, m.accepted - accepted, m.stage_s["propose"] - propose_s,
                              m.stage_s["score"] - score_s)
                if seen is not None:
                    seen.update(m.drafted - drafted, m.accepted - accepted)
            if not out:
                m.ttft_s = time.perf_counter() - t0
            n_before = len(out)
            finish = append_tokens(new, seq, out, params, self.eos_ids, self.decode)
            if on_tokens is not None and on_tokens(StepTokens.of(new, out, n_before)) is False and finish is None:
                finish = "cancelled"
        if self.prefix_reuse:
            held = held_tokens(seq, self.cache.lengths[0])
            self._prefixes.record(0, held)
            self.cache.lengths[0] = len(held)
        m.generated_tokens = len(out)
        m.total_s = time.perf_counter() - t0
        if finish != "cancelled":
            self.answer_lengths.add(len(out), cut=finish == "length")
        return GenerationResult(prompt, out, final_text(self.decode(out), params.stop), finish, m)
