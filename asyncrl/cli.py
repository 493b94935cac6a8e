"""The `asyncrl` console script. Subcommands import their component lazily so `--help` is fast."""

from __future__ import annotations

import argparse
import sys


def _demo_model(args: argparse.Namespace) -> int:
    from asyncrl.demo_model import DemoSpec, build_demo_model

    spec = DemoSpec(seed=args.seed, digits=args.digits, sft_steps=args.sft_steps, sft_target_accuracy=args.target_accuracy)
    build_demo_model(args.out, spec)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from asyncrl.learner import convert_cli

    if args.direction == "hf-to-mcore":
        convert_cli.hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep)
    else:
        convert_cli.mcore_to_hf(args.mcore, args.out, args.hf_config, tp=args.tp, pp=args.pp, ep=args.ep)
    print(f"wrote {args.out}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo-model", help="build the embedded demo model (tokenizer, tiny Qwen2, warm start)")
    demo.add_argument("--out", required=True, help="output Hugging Face model directory")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--digits", type=_positive_int, default=2, help="max digits per operand")
    demo.add_argument("--sft-steps", type=_positive_int, default=None, help="most warm-start steps (default: the spec's)")
    demo.add_argument("--target-accuracy", type=_fraction, default=None,
                      help="stop the warm start once greedy accuracy on its dev split reaches this (0 = run every step; default: the spec's)")
    demo.set_defaults(func=_demo_model)

    convert = sub.add_parser("convert", help="convert weights between a Hugging Face dir and a Megatron dist checkpoint")
    csub = convert.add_subparsers(dest="direction", required=True)
    to_mcore = csub.add_parser("hf-to-mcore", help="HF directory -> dist checkpoint for a TP x PP (x EP) layout")
    to_mcore.add_argument("--hf", required=True, help="Hugging Face model directory")
    to_hf = csub.add_parser("mcore-to-hf", help="dist checkpoint (any layout) -> HF directory")
    to_hf.add_argument("--mcore", required=True, help="dist checkpoint directory")
    to_hf.add_argument("--hf-config", required=True, help="HF directory whose config/tokenizer files describe the model")
    for p in (to_mcore, to_hf):
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel ranks to use")
        p.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallel ranks to use")
        p.add_argument("--ep", type=_positive_int, default=1, help="expert parallel ranks to use")
        p.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo-model":  # unset flags take the spec's defaults
        from asyncrl.demo_model import DemoSpec

        spec = DemoSpec()
        args.sft_steps = spec.sft_steps if args.sft_steps is None else args.sft_steps
        args.target_accuracy = spec.sft_target_accuracy if args.target_accuracy is None else args.target_accuracy
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
