"""Math answers checked for mathematical equality by math-verify (Hugging Face's verifier).

Owns: `math_reward`, a rule reward: 1.0 when the completion's final answer (its last boxed answer, else its last
expression) equals the reference answer as mathematics, not as text (a GSM8K reference's `#### 72` reads as 72).
Each parse and comparison is bounded (`PARSE_TIMEOUT_S`, `VERIFY_TIMEOUT_S`, signal alarms; one that runs out
scores 0), their sum under the pool's default `reward.timeout_s`. Needs the `math` extra (pip install
'asyncrl[math]'); without it, importing this module, and a reward pool configured with it, fail at start with that.
Must never: run the comparison in a thread (math-verify's timeouts are signals: main thread only), or score an
unparsable reference as a match.
Details: docs/design/rewards.md, "Verified math rewards".
"""

from __future__ import annotations

import re

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as err:  # the reward pool reports this at start, naming the function
    raise ImportError("asyncrl.rewards.verified_math needs the math-verify package (with its LaTeX parser): "
                      "pip install 'asyncrl[math]'") from err

# Seconds (math-verify takes whole ones): two parses and one comparison stay under the reward pool's default
# reward.timeout_s (5 s), so a slow case scores 0 here rather than costing the pool its worker.
PARSE_TIMEOUT_S = 1
VERIFY_TIMEOUT_S = 2
_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)
_WORD = re.compile(r"[A-Za-z]{2,}")

__all__ = ["math_reward", "parse_reference"]


def parse_reference(answer: str) -> list:
    """The reference answer as math-verify's parsed forms ([] when nothing parses): a GSM8K `#### x`
    tail is read as x, and a bare LaTeX reference without delimiters is read as math (plain words are
    not: they would parse as a product of symbols)."""
    text = str(answer).strip()
    found = _GSM8K_ANSWER.search(text)
    if found:
        text = found.group(1).replace(",", "")
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(text, extraction_config=configs, parsing_timeout=PARSE_TIMEOUT_S)
    if not gold and "$" not in text and ("\\" in text or not _WORD.search(text)):  # bare LaTeX or symbols: math
        gold = parse(f"${text}$", extraction_config=configs, parsing_timeout=PARSE_TIMEOUT_S)
    return gold


def math_reward(completion: str, answer: str, metadata: dict[str, str] | None = None) -> float:
    """1.0 when `completion`'s final answer is mathematically equal to `answer`, else 0.0 (also when
    either does not parse, or a parse or comparison runs out of time)."""
    gold = parse_reference(answer)
    if not gold:
        return 0.0
    predicted = parse(completion, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                      parsing_timeout=PARSE_TIMEOUT_S)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=VERIFY_TIMEOUT_S) else 0.0
