"""Open-domain QA scoring: SQuAD answer normalisation, exact match and token F1 over several gold answers,
and the `<answer>` extractor of the Search-R1 tag convention.

The normalisation and F1 follow the SQuAD v1.1 evaluation script (Rajpurkar et al. 2016), which
Search-R1, FlashRAG and the NQ-open literature all use, so numbers here compare with theirs.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop ASCII punctuation, drop the articles a/an/the, collapse
    whitespace. The order matters and is the script's: "A+" -> "a" -> "" (it is an article by then)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(golds: str | Sequence[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    if not golds:
        raise ValueError("golds is empty; need at least one gold answer")
    return list(golds)


def exact_match(prediction: str | None, golds: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0 (None scores 0)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(golds)))


def _token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    # An empty side only matches an empty side (the SQuAD v2 script's rule; v1.1 divided by zero there).
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Token-level F1 of the normalised prediction against each gold answer; the best over the golds.
    Tokens are whitespace-split and counted with multiplicity, as in the SQuAD script."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction).split()
    return max(_token_f1(pred, normalize_answer(g).split()) for g in _golds(golds))


def extract_answer(text: str) -> str | None:
    """The body of the last `<answer>...</answer>` in `text`, stripped; None without a closed tag.

    Search-R1 scores the whole sequence, prompt included, and so skips the prompt's own example tag
    (it needs two matches); here `text` is the model's completion only, so the last tag is the answer."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None
