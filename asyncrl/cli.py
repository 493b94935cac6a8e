"""The `asyncrl` console script. Subcommands import their component lazily so `--help` is fast."""

from __future__ import annotations

import argparse
import sys


def _demo_model(args: argparse.Namespace) -> int:
    from asyncrl.demo_model import DemoSpec, build_demo_model

    spec = DemoSpec(seed=args.seed, digits=args.digits, sft_steps=args.sft_steps, sft_target_accuracy=args.target_accuracy)
    build_demo_model(args.out, spec)
    return 0


def _demo_reward_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from asyncrl.demo_reward_model import RewardSpec, build_demo_reward_model

    if not (Path(args.policy) / "config.json").is_file():
        print(f"asyncrl demo-reward-model: --policy {args.policy!r} is not a model directory (no config.json); "
              "build the demo policy first: asyncrl demo-model --out DIR (make demo-model)", file=sys.stderr)
        return 2
    spec = RewardSpec()
    spec = RewardSpec(seed=args.seed, steps=args.steps or spec.steps,
                      target_accuracy=spec.target_accuracy if args.target_accuracy is None else args.target_accuracy)
    build_demo_reward_model(args.policy, args.out, spec)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from asyncrl.learner import convert_cli

    if args.direction == "hf-to-mcore":
        convert_cli.hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep)
    else:
        convert_cli.mcore_to_hf(args.mcore, args.out, args.hf_config, tp=args.tp, pp=args.pp, ep=args.ep)
    print(f"wrote {args.out}")
    return 0


def _demo_judge_model(args: argparse.Namespace) -> int:
    """The judge of deploy/rlhf-judge.yaml: `asyncrl serve CONFIG` (the demo trained by RL on the
    exact-answer rule) until its trainer finishes, then its last checkpoint exported to --out."""
    import signal
    import subprocess
    import time
    from pathlib import Path

    import yaml

    from asyncrl.config import ConfigError, load_config
    from asyncrl.trainer.export import ExportError, export_run
    from asyncrl.trainer.status_view import StatusUnavailable, fetch_status

    try:
        serve_cfg = yaml.safe_load(Path(args.config).read_text())
    except (OSError, yaml.YAMLError) as err:
        print(f"asyncrl demo-judge-model: --config {args.config}: {err}", file=sys.stderr)
        return 2
    apps = [a for a in (serve_cfg or {}).get("applications", []) if str(a.get("import_path", "")).endswith(":app_builder")] \
        if isinstance(serve_cfg, dict) else []
    if len(apps) != 1:
        print(f"asyncrl demo-judge-model: {args.config} must hold one training application (asyncrl.app:app_builder)",
              file=sys.stderr)
        return 2
    try:
        train = load_config(apps[0].get("args") or {}, source=args.config)
    except ConfigError as err:
        print(f"asyncrl demo-judge-model: {err}", file=sys.stderr)
        return 2
    run_dir, steps = Path(train.logging.dir), train.trainer.total_steps
    if run_dir.exists():
        print(f"asyncrl demo-judge-model: {run_dir} exists (an earlier run); remove it first", file=sys.stderr)
        return 2
    http = serve_cfg.get("http_options", {})
    url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
    serving = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve", args.config])
    deadline, state = time.monotonic() + args.timeout_s, None
    try:
        while time.monotonic() < deadline and serving.poll() is None:
            try:
                status = fetch_status(url, timeout_s=10.0)
            except StatusUnavailable:  # not up yet
                time.sleep(5.0)
                continue
            state = status.get("state")
            if state in ("finished", "failed", "stopped"):
                break
            time.sleep(10.0)
    finally:
        if serving.poll() is None:
            serving.send_signal(signal.SIGTERM)  # drains the app, then stops Ray
            serving.wait(300)
    if state != "finished":
        print(f"asyncrl demo-judge-model: training ended {state or 'without a status'} (see {run_dir}); nothing exported",
              file=sys.stderr)
        return 1
    try:
        ckpt, out = export_run(str(run_dir), args.out, step=steps)
    except ExportError as err:
        print(f"asyncrl demo-judge-model: {err}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} (the judge) to {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from asyncrl.trainer.export import ExportError, export_run

    try:
        ckpt, out = export_run(args.run_dir, args.out, step=args.step, hf_config=args.hf_config, tp=args.tp, pp=args.pp,
                               ep=args.ep, peft_out=args.peft_out)
    except ExportError as err:
        print(f"asyncrl export: {err}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} (actor) to {out}")
    return 0


def _layout(args: argparse.Namespace) -> int:
    from asyncrl.config import ConfigError, load_config_file
    from asyncrl.trainer.layout_advice import advise_file

    try:
        cfg = load_config_file(args.config)
        if args.model:
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": args.model})})
        advice = advise_file(cfg, args.gpus, args.gpu_gib)
    except (ConfigError, ValueError) as err:
        print(f"asyncrl layout: {err}", file=sys.stderr)
        return 2
    print(advice.message)
    if advice.best is not None:
        print(f"fastest that fits: {advice.best.layout.describe()}, ~{advice.best.bytes / 2**30:.1f} GiB a rank, "
              f"{advice.best.speed:.2f}x one GPU's training throughput (estimates: asyncrl/trainer/layout_advice.py)")
    return 0


def _status(args: argparse.Namespace) -> int:
    import json
    import time

    from asyncrl.trainer.status_view import StatusUnavailable, fetch_status, format_status

    while True:
        try:
            status = fetch_status(args.url, timeout_s=args.timeout)
        except StatusUnavailable as err:
            print(f"asyncrl status: {err}", file=sys.stderr)
            return 2
        print(json.dumps(status, indent=2) if args.json else format_status(status), flush=True)
        if not args.watch or status.get("state") in ("finished", "failed", "stopped"):
            return 1 if status.get("state") == "failed" else 0
        time.sleep(args.watch)
        print()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _serve(args: argparse.Namespace) -> int:
    """`serve run CONFIG` in this process, where SIGINT and SIGTERM drain the app first.

    Ray's `serve run` reacts to Ctrl-C with `serve.shutdown()`, and to SIGTERM (`kill`, `timeout`,
    a job scheduler, a container stop) with `ray.init`'s `sys.exit`: no drain, and when the exit
    takes longer than 3 s the driver's C++ failure-signal handler aborts it (seen: exit -6). Here
    Ray is started first and then either signal is taken over: it deletes every Serve application
    and waits for it (each replica's drain: the trainer ends its step, logs the accounting, closes
    learner ranks and reward workers; engines stop vLLM), then takes Ray's Ctrl-C path, stops Ray
    and exits with `serve run`'s code (1 if it raised). A second signal ends the process at once."""
    import contextlib
    import os
    import signal

    import click
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.scripts import cli

    def drain(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print(f"asyncrl serve: signal {signum}: draining the applications (a second signal ends at once)", flush=True)
        try:
            from ray import serve

            for name in list(serve.status().applications):
                serve.delete(name)  # blocks until its replicas have stopped
        except Exception as err:  # noqa: BLE001 - not started yet, or already gone: Ray's shutdown follows
            print(f"asyncrl serve: drain: {err!r}", flush=True)
        raise KeyboardInterrupt(f"signal {signum}")

    # A Ray that this starts keeps the events of at most 10k tasks in its GCS: with Ray's default (100k) the GCS
    # grows for most of a long run, every request and control call being a task; and it tracks at most 10k of the
    # task attempts whose events it dropped past that cap (Ray's default, a million a job, kept the GCS growing
    # through an hour's soak). A value set outside wins.
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "10000")
    os.environ.setdefault("RAY_task_events_max_dropped_task_attempts_tracked_per_job_in_gcs", "10000")
    ray.init(address=args.address, namespace=SERVE_NAMESPACE)  # as `serve run` would; it then reuses it
    signal.signal(signal.SIGTERM, drain)  # after ray.init, which installs its own
    signal.signal(signal.SIGINT, drain)
    rc = 0
    try:
        cli.main(["run", args.config], prog_name="asyncrl serve", standalone_mode=False)
    except SystemExit as done:  # serve run's exit after its shutdown
        rc = done.code if isinstance(done.code, int) else 0
    except (KeyboardInterrupt, click.exceptions.Abort):  # before serve run's own handler was in place
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        rc = 130
    except Exception:  # noqa: BLE001 - reported, and the exit code says it
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


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

    rm = sub.add_parser("demo-reward-model", help="train the demo reward model (the demo policy's backbone + a score head) "
                        "for reward.kind: model")
    rm.add_argument("--policy", default="artifacts/demo-model", help="the demo policy's directory (default: %(default)s)")
    rm.add_argument("--out", required=True, help="output Hugging Face directory (a Qwen2ForSequenceClassification)")
    rm.add_argument("--seed", type=int, default=0)
    rm.add_argument("--steps", type=_positive_int, default=None, help="most training steps (default: the spec's)")
    rm.add_argument("--target-accuracy", type=_fraction, default=None,
                    help="stop once held-out accuracy on the policy's completions reaches this (0 = every step)")
    rm.set_defaults(func=_demo_reward_model)

    judge = sub.add_parser("demo-judge-model", help="the demo judge for reward.kind: http (deploy/rlhf-judge.yaml): "
                           "the demo trained by RL on the exact-answer rule, its last checkpoint exported")
    judge.add_argument("--config", default="deploy/rlhf-judge-teacher.yaml", help="its training run (default: %(default)s)")
    judge.add_argument("--out", required=True, help="output Hugging Face model directory")
    judge.add_argument("--timeout-s", type=_positive_float, default=3600.0, help="give up on the training after this long")
    judge.set_defaults(func=_demo_judge_model)

    run = sub.add_parser("serve", help="`serve run CONFIG` where SIGTERM drains the app as Ctrl-C does (make serve)")
    run.add_argument("config", help="Serve config, e.g. deploy/rlhf.yaml")
    run.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else a local one); "
                     "for other `serve run` options use `serve run` itself")
    run.set_defaults(func=_serve)

    export = sub.add_parser("export", help="a run's newest (or --step N) actor checkpoint -> Hugging Face directory with the tokenizer")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (logging.dir), its checkpoint.dir, or one step_N checkpoint")
    export.add_argument("--out", required=True, help="output Hugging Face model directory (transformers and vLLM load it)")
    export.add_argument("--step", type=int, default=None, help="export the checkpoint of this step (default: the newest complete one)")
    export.add_argument("--hf-config", default=None, help="model directory for config and tokenizer files (default: the one the run trained)")
    export.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel ranks for the conversion")
    export.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallel ranks for the conversion")
    export.add_argument("--ep", type=_positive_int, default=1, help="expert parallel ranks for the conversion")
    export.add_argument("--peft-out", default=None, help="a LoRA run (learner.lora): also write its adapters as a PEFT "
                        "adapter directory here (--out always holds the merged model)")
    export.set_defaults(func=_export)

    status = sub.add_parser("status", help="the trainer's status (step, version, reward, accuracy, buffer accounting)")
    status.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the app's HTTP address (default %(default)s)")
    status.add_argument("--json", action="store_true", help="print the raw /train/status JSON")
    status.add_argument("--watch", type=_positive_float, default=None, metavar="SECONDS", help="print again every SECONDS until training ends")
    status.add_argument("--timeout", type=_positive_float, default=10.0, help="HTTP timeout in seconds")
    status.set_defaults(func=_status)

    layout = sub.add_parser("layout", help="the learner layout (DP / TP / CP / PP, recompute) estimated fastest of those "
                            "that fit its GPUs, against the config's")
    layout.add_argument("config", help="a config YAML (or a Serve config: its first app's args)")
    layout.add_argument("--gpus", type=_positive_int, default=None, help="learner ranks (default: learner.world_size)")
    layout.add_argument("--gpu-gib", type=_positive_float, required=True, help="one GPU's memory in GiB (e.g. 80, 141)")
    layout.add_argument("--model", default=None, help="a Hugging Face model directory in place of model.path")
    layout.set_defaults(func=_layout)

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
