"""Output consistency of a method against the baseline (plain decoding of the same kernels and sampling).

Greedy runs must reproduce plain decoding token for token (speculation is lossless), so
the headline figure is the exact-match rate and, where outputs differ, the first divergence
position. ROUGE-L and BLEU of the texts show how far apart differing outputs are. Sampled runs
cannot match token for token; for them a histogram comparison of the generated tokens is
reported as a sanity check only: exactness of the sampled distribution is proven by the unit
tests, not by this statistic.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch

_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)


class _UnicodeTokenizer:
    """ROUGE tokenization that keeps non-Latin words and code punctuation.

    rouge-score's default tokenizer drops every non-ASCII-alphanumeric character, which scores
    Chinese or emoji text as empty (ROUGE 0 even for identical strings).
    """

    def tokenize(self, text: str) -> list[str]:
        return _WORD.findall(text.lower())


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def rouge_l(hypothesis: str, reference: str) -> float:
    """ROUGE-L F1 in [0, 1]; identical texts (empty ones included) score 1."""
    if hypothesis == reference:
        return 1.0
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_UnicodeTokenizer())
    return float(scorer.score(reference, hypothesis)["rougeL"].fmeasure)


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (sacrebleu, 0-100) of hypotheses against one reference each; all identical scores 100."""
    if hypotheses == references:
        return 100.0
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


@dataclass(frozen=True)
class DistributionCheck:
    """Token-frequency histograms of baseline vs method outputs (a sanity check, not a proof).

    ``total_variation`` is half the L1 distance of the two normalised histograms; with finite
    samples it is positive even for identical distributions. ``p_value`` is from a chi-square
    test of homogeneity (bins with few counts pooled); a tiny p-value on large samples would
    deserve a look. Tokens within a sequence are not independent, so the test is approximate.
    """

    baseline_tokens: int
    method_tokens: int
    total_variation: float
    chi_square: float
    dof: int
    p_value: float | None


def distribution_check(baseline: list[list[int]], method: list[list[int]], min_expected: float = 5.0
                       ) -> DistributionCheck:
    """Compare the token histograms of two sets of samples (lists of generated token ids)."""
    cb = Counter(t for s in baseline for t in s)
    cm = Counter(t for s in method for t in s)
    nb, nm = sum(cb.values()), sum(cm.values())
    if not nb or not nm:
        return DistributionCheck(nb, nm, 0.0, 0.0, 0, None)
    vocab = sorted(set(cb) | set(cm))
    tv = 0.5 * sum(abs(cb[t] / nb - cm[t] / nm) for t in vocab)
    # Chi-square test of homogeneity on a 2 x bins table; rare tokens pooled so expected counts are >= 5.
    n = nb + nm
    bins: list[tuple[int, int]] = []
    rare_b = rare_m = 0
    for t in vocab:
        if (cb[t] + cm[t]) * min(nb, nm) / n >= min_expected:
            bins.append((cb[t], cm[t]))
        else:
            rare_b, rare_m = rare_b + cb[t], rare_m + cm[t]
    if rare_b + rare_m:
        bins.append((rare_b, rare_m))
    chi2 = 0.0
    for b, m in bins:
        tot = b + m
        for obs, col in ((b, nb), (m, nm)):
            exp = tot * col / n
            chi2 += (obs - exp) ** 2 / exp if exp else 0.0
    dof = len(bins) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(chi2 / 2, dtype=torch.float64))) if dof > 0 else None
    return DistributionCheck(nb, nm, tv, chi2, dof, p if p is None or math.isfinite(p) else None)


@dataclass(frozen=True)
class Consistency:
    """How a method's outputs compare with the baseline's on the same prompts."""

    method: str
    prompts: int
    exact_match: float | None  # share of prompts with the baseline's exact tokens (greedy runs only)
    diverged: int  # prompts whose tokens differ
    first_divergence: list[int | None]  # per prompt; None where equal
    mean_first_divergence: float | None  # over the prompts that diverged
    rouge_l: float | None  # mean ROUGE-L F1 of the texts (None without a tokenizer)
    bleu: float | None  # corpus BLEU of the texts
    distribution: DistributionCheck | None  # sampled runs only
    reference: str = "plain"  # the method compared against: plain decoding of the same kernels and sampling

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["distribution"] = asdict(self.distribution) if self.distribution else None
        return d


def compare(method: str, tokens: list[list[int]], base_tokens: list[list[int]], texts: list[str | None],
            base_texts: list[str | None], greedy: bool, samples: list[list[int]] | None = None,
            base_samples: list[list[int]] | None = None, reference: str = "plain") -> Consistency:
    """Consistency of one method's outputs (one per prompt) with the baseline's (``reference``, by label).

    ``samples``/``base_samples``: every generated sequence (all repeats) for the distribution check.
    """
    div = [first_divergence(t, b) for t, b in zip(tokens, base_tokens, strict=True)]
    diverged = [d for d in div if d is not None]
    has_text = all(t is not None for t in texts + base_texts)
    hyps = [t or "" for t in texts]
    refs = [t or "" for t in base_texts]
    rouge = sum(rouge_l(h, r) for h, r in zip(hyps, refs, strict=True)) / len(hyps) if has_text and hyps else None
    dist = None
    if not greedy:
        dist = distribution_check(base_samples or base_tokens, samples or tokens)
    return Consistency(method, len(tokens), (len(div) - len(diverged)) / len(div) if greedy and div else None,
                       len(diverged), div, sum(diverged) / len(diverged) if diverged else None, rouge,
                       bleu(hyps, refs) if has_text and hyps else None, dist, reference)
