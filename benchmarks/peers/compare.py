"""The side-by-side table and picture of the peer benchmark (issue 32), from the JSON rows of both sides.

Reads the rows that benchmarks/peers/trl_grpo.py and benchmarks/peers/asyncrl_side.py print (any lines that are
not rows are skipped, so whole logs can be given) and writes:
  a markdown table: per row s/step (median, mean), its speed against TRL's row of the same setting (this row's
  trained completion tokens per second over its timed steps / TRL's: the mean, not the median, and tokens rather
  than steps, since long-tail rows sample unlike lengths), the mean split of a step into
  generation, training, weight sync and idle, completion tokens/s, the GPU;
  the completion lengths each row sampled (mean, p50, p90, p99, max), and a warning where two rows of one
  setting differ in mean length by more than LENGTH_TOLERANCE (they did not sample the same workload);
  with --png: one PNG of stacked bars, one bar per row (the mean step split into those four parts), and, when
  rows carry held-out evaluations past the first (a curve), a second panel of accuracy against seconds of the run.
A setting is (model, samples per step, completion tokens, fixed length, GPU): rows compare only within one.

    python benchmarks/peers/compare.py /tmp/out/peers.json --md /tmp/out/peers.md --png docs/peers.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SPLIT, read_rows  # noqa: E402

# Rows of one setting whose mean completion lengths differ by more than this share of the larger did not
# sample the same workload (a long-tail model's mean over 8 x 64 samples varies by a few per cent).
LENGTH_TOLERANCE = 0.15
COLORS = {"generation": "#4c72b0", "training": "#dd8452", "weight_sync": "#55a868", "idle": "#c7c7c7"}


def setting(row: dict[str, Any]) -> tuple:
    return (row.get("model"), row.get("samples_per_step"), row.get("max_new_tokens"), row.get("fixed_length"), row.get("gpu"))


def label(row: dict[str, Any], many_settings: bool = False) -> str:
    name = "TRL" if row["system"] == "trl" else row["system"]
    text = f"{name} {row.get('placement', '')}" + (f" eta={row['eta']}" if row["system"] != "trl" else "")
    return text + (f" ({Path(str(row.get('model'))).name})" if many_settings else "")


def speedups(rows: list[dict[str, Any]]) -> list[float | None]:
    """Per row: its trained tokens/s (over the timed steps' wall: the mean) / TRL's of the same setting (its vLLM
    colocate row first); None without a TRL row."""
    trl: dict[tuple, float] = {}
    for r in sorted((r for r in rows if r["system"] == "trl"), key=lambda r: r.get("placement") != "colocate"):
        trl.setdefault(setting(r), r["tokens_per_s"])
    return [r["tokens_per_s"] / trl[setting(r)] if trl.get(setting(r)) else None for r in rows]


def table(rows: list[dict[str, Any]]) -> str:
    many = len({setting(r) for r in rows}) > 1
    out = ["| system | model (params) | samples/step x tokens | steps timed | s/step median | s/step mean | speed vs TRL "
           "| generation s | training s | weight sync s | idle s | tokens/s | GPU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, up in zip(rows, speedups(rows), strict=True):
        split = r.get("split_s", {})
        params = r.get("params")
        model = f"{Path(str(r.get('model'))).name} ({params / 1e6:.0f}M)" if params else str(r.get("model"))
        tokens = f"{r.get('max_new_tokens')}{' fixed' if r.get('fixed_length') else ''}"
        out.append(f"| {label(r, many)} | {model} | {r.get('samples_per_step')} x {tokens} | {r.get('steps_timed')} | "
                   f"{r['s_per_step_median']:.3f} | {r['s_per_step_mean']:.3f} | {'-' if up is None else f'{up:.2f}x'} | "
                   + " | ".join(f"{split.get(k, 0.0):.3f}" for k in SPLIT)
                   + f" | {r.get('tokens_per_s', 0.0):,.0f} | {r.get('gpu') or '-'} |")
    return "\n".join(out) + "\n"


def length_table(rows: list[dict[str, Any]]) -> str:
    """Per row that reports them, its completion lengths; then a warning for each pair of rows of one setting
    whose means differ by more than LENGTH_TOLERANCE."""
    many = len({setting(r) for r in rows}) > 1
    measured = [r for r in rows if r.get("lengths")]
    if not measured:
        return ""
    lines = ["\nCompletion lengths over the timed steps (tokens: mean, p50, p90, p99, max; samples, cut at the limit):"]
    for r in measured:
        n = r["lengths"]
        cut = "" if n.get("cut") is None else f", {n['cut']} cut"
        lines.append(f"- {label(r, many)}: {n['mean']:.0f}, {n['p50']}, {n['p90']}, {n['p99']}, {n['max']} "
                     f"({n['count']} samples{cut})")
    for i, r in enumerate(measured):
        for other in measured[i + 1:]:
            a, b = r["lengths"]["mean"], other["lengths"]["mean"]
            if setting(r) == setting(other) and abs(a - b) > LENGTH_TOLERANCE * max(a, b):
                lines.append(f"WARNING: {label(r, many)} sampled {a:.0f} tokens on average, {label(other, many)} {b:.0f}: "
                             f"more than {LENGTH_TOLERANCE:.0%} apart, not the same workload")
    return "\n".join(lines) + "\n"


def start_table(rows: list[dict[str, Any]]) -> str:
    """Per row that reports them: launch to the first step's start (`start_s`), the first step, and that step
    against TRL's first step of the same setting."""
    many = len({setting(r) for r in rows}) > 1
    trl = {setting(r): r["first_step_s"] for r in rows if r["system"] == "trl" and r.get("first_step_s")}
    shown = [r for r in rows if r.get("first_step_s") is not None]
    if not shown:
        return ""
    lines = ["\nStart (launch to the first step's start, s) and the first step (s; x TRL's first step):"]
    for r in shown:
        ref = trl.get(setting(r))
        start = "-" if r.get("start_s") is None else f"{r['start_s']:.1f}"
        lines.append(f"- {label(r, many)}: start {start}, first step {r['first_step_s']:.2f}"
                     + ("" if not ref else f" ({r['first_step_s'] / ref:.2f}x TRL's)"))
    return "\n".join(lines) + "\n"


def curve(row: dict[str, Any]) -> bool:
    """Whether a row evaluated during training, not only at its start (a run without --eval-every
    still records its step-0 evaluation)."""
    return len(row.get("eval") or []) > 1


def eval_table(rows: list[dict[str, Any]]) -> str:
    """Held-out accuracy against seconds since training began, for rows that evaluated."""
    lines = []
    for r in rows:
        if curve(r):
            points = ", ".join(f"{e['accuracy']:.3f} @ step {e['step']} / {e['wall_s']:.0f} s" for e in r["eval"])
            lines.append(f"- {label(r)}: {points}")
    return ("\nHeld-out greedy accuracy (step / seconds of the run):\n" + "\n".join(lines) + "\n") if lines else ""


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len({setting(r) for r in rows}) > 1
    with_eval = any(curve(r) for r in rows)
    fig, axes = plt.subplots(1, 2 if with_eval else 1, figsize=(13 if with_eval else 8, 0.6 * len(rows) + 2.6),
                             squeeze=False)
    ax = axes[0][0]
    names = [label(r, many) for r in rows]
    left = [0.0] * len(rows)
    for key in SPLIT:
        widths = [r.get("split_s", {}).get(key, 0.0) for r in rows]
        ax.barh(names, widths, left=left, color=COLORS[key], label=key.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, (r, up) in enumerate(zip(rows, speedups(rows), strict=True)):
        ax.text(left[y], y, f" {r['s_per_step_mean']:.2f} s" + ("" if up is None else f" ({up:.2f}x)"), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per optimizer step (mean of the timed steps; speed vs TRL in trained tokens/s)")
    ax.set_xlim(0, max(left) * 1.3 if max(left) > 0 else 1)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(SPLIT), fontsize=8)  # below: never over a bar
    ax.set_title("One GRPO step, same samples: where the time goes", fontsize=10)
    if with_eval:
        ax2 = axes[0][1]
        for r in rows:
            if curve(r):
                ax2.plot([e["wall_s"] for e in r["eval"]], [e["accuracy"] for e in r["eval"]], marker="o", label=label(r, many))
        ax2.set_xlabel("seconds since training began")
        ax2.set_ylabel("held-out greedy accuracy")
        ax2.legend(fontsize=8)
        ax2.set_title("Held-out accuracy against wall-clock", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", type=Path, nargs="+", help="files holding the JSON rows (peers.json, or the runs' logs)")
    ap.add_argument("--md", type=Path, default=None, help="write the markdown here too (it is always printed)")
    ap.add_argument("--png", type=Path, nargs="?", const=Path("docs/peers.png"), default=None,
                    help="write the stacked-bar PNG (default path: docs/peers.png)")
    a = ap.parse_args(argv)
    missing = [str(p) for p in a.rows if not p.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    rows = read_rows(a.rows)
    if not rows:
        ap.error(f"no rows (JSON lines with 'system' and 's_per_step_median') in {', '.join(map(str, a.rows))}")
    text = table(rows) + length_table(rows) + start_table(rows) + eval_table(rows)
    print(text, end="")
    if a.md:
        a.md.parent.mkdir(parents=True, exist_ok=True)
        a.md.write_text(text)
    if a.png:
        plot(rows, a.png)
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
