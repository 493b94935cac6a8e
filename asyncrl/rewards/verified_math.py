"""Math answers checked for mathematical equality by math-verify (Hugging Face's verifier).

`math_reward` is a rule reward (`reward.function: asyncrl.rewards.verified_math:math_reward`, or
`reward.eval_function`): 1.0 when the completion's final answer equals the reference answer as
mathematics, not as text: `\\boxed{\\frac{1}{2}}` = `0.5` = `1/2`, `\\dfrac34` = `0.75`, `x = 3` = `3`,
`\\{1, 2\\}` = `\\{2, 1\\}`, units and `\\text{...}` dropped, a GSM8K reference's `#### 72` read as `72`.
The completion's answer is its last `\\boxed{}` when it has one (the priority math-verify gives it),
else its last LaTeX or plain expression. Data: a verl-style parquet (`data.kind: parquet`, the answer
at `reward_model.ground_truth`) or JSONL with an `answer` column; see docs/GUIDE.md, "Your data".

Timeouts: math-verify bounds each parse and each comparison (`PARSE_TIMEOUT_S`, `VERIFY_TIMEOUT_S`,
signal alarms in the reward pool's worker process, whose main thread runs the call): one that runs
out scores 0, as a wrong answer. Their sum (4 s) stays under the pool's own default `reward.timeout_s`
(5 s), which kills the worker and marks the sample invalid.

Needs the `math` extra: pip install 'asyncrl[math]' (math-verify with its LaTeX parser). Without it,
importing this module fails with that instruction, and so does a reward pool configured with it, at
start.

Must never: run the comparison in a thread (math-verify's timeouts are signals: main thread only), or
score an unparsable reference as a match.
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
