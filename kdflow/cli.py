"""The `kdflow` command line. Subcommands import their code lazily so `kdflow --help` is instant."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kdflow.schemas.errors import KDFlowError


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"kdflow: warning: {warning}", file=sys.stderr, flush=True)


def _cmd_run(args: argparse.Namespace) -> int:
    from kdflow.schemas.config_io import load_config
    from kdflow.tasks.path_spellings import with_stored_spellings
    from kdflow.tasks.preflight import run_preflight
    from kdflow.tasks.preflight_stores import check_stage_inputs

    # The config and every check of it before Prefect is imported (a second or two): bad input fails at once.
    config, notes = with_stored_spellings(load_config(args.config, dict(args.set or [])))
    for note in notes:
        print(f"kdflow: {note}", file=sys.stderr, flush=True)
    stages = [s.strip() for s in args.stages.split(",")] if args.stages is not None else None  # "": refused
    _warn(run_preflight(config, stages))
    if stages:
        check_stage_inputs(config, stages)
    from kdflow.commands.serverless import serverless_settings

    with serverless_settings():
        from kdflow.flows.pipeline import pipeline_flow

        pipeline_flow(config, stages=stages)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kdflow.commands.demo import run_demo

    return run_demo(run_root=args.run_root, quick=args.quick)


def _cmd_configs(args: argparse.Namespace) -> int:
    from kdflow.configs import SHIPPED, shipped, write_examples

    if args.write is None:
        for name in SHIPPED:
            print(shipped(name))
        return 0
    try:
        written = write_examples(args.write)
    except FileExistsError as exists:
        raise KDFlowError(str(exists)) from None
    for path in written:
        print(f"wrote {path}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from kdflow.commands.status import print_status
    from kdflow.schemas.config_io import run_root_of

    return print_status(run_root_of(args.run_root), args.run_root)


def _cmd_validate(args: argparse.Namespace) -> int:
    from kdflow.commands.validate import validate_run_root
    from kdflow.schemas.config_io import run_root_of

    return validate_run_root(run_root_of(args.run_root), fix=args.fix, given=args.run_root)


def _cmd_store(args: argparse.Namespace) -> int:
    if args.action in ("import", "export"):
        from kdflow.commands.store_io import export_main, import_main

        return (import_main if args.action == "import" else export_main)(args.rest)
    # The report is Markdown (or JSON lines): the bars of loading the teacher (weights, a GGUF's dequantisation)
    # would interleave with it. tqdm reads this once, when it is first imported: here, before anything imports it.
    os.environ.setdefault("TQDM_DISABLE", "1")
    from kdflow.commands.store_report import main

    return main(args.rest)


def _cmd_chat(args: argparse.Namespace) -> int:
    from kdflow.schemas.config_io import config_named
    from kdflow.schemas.layout import FINAL_DIR
    from kdflow.tasks.common.model_files import model_folder_problem

    folder = args.student_dir
    if (config := config_named(folder)) is not None:  # a run's config: its student
        from kdflow.schemas.layout import STUDENTS_DIR

        args.student_dir = folder = f"{config.run_root.rstrip('/')}/{STUDENTS_DIR}/{config.student.name}"
    if folder.startswith("file://"):  # a local run root written as a URL: its folder
        from kdflow.schemas.storage import RunRoot

        args.student_dir = folder = RunRoot(folder).root
    if "://" in folder:  # a student on an object store: chat with a copy
        from kdflow.tasks.common.scratch import downloaded_model

        with downloaded_model(folder, FINAL_DIR) as local:
            args.student_dir = local
            return _cmd_chat(args)
    # Before torch is imported (a minute on a busy machine): a folder that is no model is one line at once.
    if (not os.path.isfile(os.path.join(folder, "config.json"))
            and os.path.isfile(os.path.join(folder, FINAL_DIR, "config.json"))):
        folder = os.path.join(folder, FINAL_DIR)
    problem = model_folder_problem(folder)
    latest = _latest_checkpoint(args.student_dir) if problem is not None else None
    if latest is not None:
        raise KDFlowError(f"student {args.student_dir!r} has no final model yet (its training has not finished); "
                          f"its latest checkpoint is a model folder that kdflow chat takes: {latest}")
    if problem is not None:
        raise KDFlowError(f"student {folder!r} is not a model: {problem}")
    from kdflow.commands.chat import chat_main

    return chat_main(args)


def _latest_checkpoint(student_dir: str) -> str | None:
    """The newest complete checkpoint-STEP folder of students/NAME (one a resumed run would start from), or None."""
    from kdflow.schemas.layout import checkpoint_name
    from kdflow.schemas.storage import RunRoot, complete_checkpoint_steps

    if "://" not in student_dir and not os.path.isdir(student_dir):
        return None  # a file, or nothing: the caller says what is wrong with it
    run_root = RunRoot(student_dir)
    steps = complete_checkpoint_steps(run_root, run_root.root)
    return os.path.join(student_dir, checkpoint_name(steps[-1])) if steps else None


def _interrupted_inside(error: BaseException) -> bool:
    """A Ctrl-C that a library caught and wrapped: pydantic's serializer reports it as a PydanticSerializationError
    whose message names it (seen when Ctrl-C lands while Prefect serialises a flow run's parameters)."""
    from kdflow.tasks.common.failures import exception_chain

    return any(isinstance(item, KeyboardInterrupt) or (type(item).__name__ == "PydanticSerializationError"
                                                       and "KeyboardInterrupt" in str(item))
               for item in exception_chain(error))


def _cmd_bench(args: argparse.Namespace) -> int:
    from kdflow.bench import run_bench

    return run_bench(args.what, args.rest)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kdflow")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _cmd_tune(args: argparse.Namespace) -> int:
    from kdflow.commands.tune import main

    return main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    from kdflow.bench import BENCHES, SUMMARIES
    from kdflow.schemas.config_io import parse_override

    parser = argparse.ArgumentParser(prog="kdflow", description="Offline knowledge distillation: cached teacher top-K, "
                                     "fused chunked KL student training, orchestrated by Prefect.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    parser.add_argument("--version", action="version", version=f"kdflow {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="the whole pipeline on the embedded default (real small teacher, no server)")
    demo.add_argument("--run-root", default="runs/demo", help="where it writes, and resumes from (default: runs/demo)")
    demo.add_argument("--quick", action="store_true", help="a reduced budget (used by the tests)")
    demo.set_defaults(func=_cmd_demo)

    configs = sub.add_parser("configs", help="the example configs shipped with kdflow: list them, or copy them out")
    configs.add_argument("--write", metavar="DIR", help="copy demo.yaml, example.yaml, llmjp.yaml and data/ into DIR "
                         "(configs/: example.yaml then runs from the folder above it)")
    configs.set_defaults(func=_cmd_configs)

    run = sub.add_parser("run", help="run the pipeline flow on a config file")
    run.add_argument("config", help="YAML config (see configs/, or `kdflow configs --write configs`)")
    run.add_argument("--set", action="append", type=parse_override, metavar="KEY=VALUE",
                     help="override a config key, e.g. --set student.steps=50 (repeatable)")
    run.add_argument("--stages", help="comma list of stages: materialise,tokenise,precompute,train (default: all)")
    run.set_defaults(func=_cmd_run)

    status = sub.add_parser("status", help="committed/expected shards, tokens and fingerprints per stage")
    status.add_argument("run_root", help="the run root, or the config file that names it")
    status.set_defaults(func=_cmd_status)

    validate = sub.add_parser("validate", help="check manifests, re-hash every committed file, check shard contents")
    validate.add_argument("run_root", help="the run root, or the config file that names it")
    validate.add_argument("--fix", action="store_true",
                          help="remove the commit records of shards that fail a check, so the next run recomputes them")
    validate.set_defaults(func=_cmd_validate)

    store = sub.add_parser("store", help="top-K stores: `kdflow store report RUN_ROOT` (bytes, KL to the teacher, "
                                         "histograms); `import SOURCE` / `export RUN_ROOT OUT_DIR` (logit datasets)")
    store.add_argument("action", choices=["report", "import", "export"])
    store.add_argument("rest", nargs=argparse.REMAINDER, help="arguments (see kdflow store ACTION --help)")
    store.set_defaults(func=_cmd_store)

    chat = sub.add_parser("chat", help="a conversation with a saved student (one reply with --prompt)")
    chat.add_argument("student_dir", help="a saved model folder, students/NAME, or the config file of the run")
    chat.add_argument("--prompt", help="one prompt, answered alone; without it, a conversation read line by line")
    chat.add_argument("--system", help="system text: the system message (chat template) or the start of the text")
    chat.add_argument("--max-new-tokens", type=int, default=64)
    chat.add_argument("--max-positions", type=int,
                      help="positions the history is cut to fit (default: the model's max_position_embeddings)")
    chat.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling)")
    chat.add_argument("--temperature", type=float, default=0.8)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--top-k", type=int, default=50)
    chat.add_argument("--repetition-penalty", type=float, default=1.0,
                      help="divide the scores of tokens already in the text (1: off; 1.3 helps small students)")
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--device", default="auto")
    chat.set_defaults(func=_cmd_chat)

    listing = "\n".join(f"  {name:<17} {SUMMARIES.get(name, '')}" for name in BENCHES)
    bench = sub.add_parser("bench", help="benchmarks that print one JSON object per line",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Benchmarks that print one JSON object per line; each exits 1 when it "
                           f"measured nothing.\n\n{listing}")
    bench.add_argument("what", choices=list(BENCHES), metavar="NAME", help="one of the benchmarks above")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (see kdflow bench X --help)")
    bench.set_defaults(func=_cmd_bench)

    tune = sub.add_parser("tune", help="find the teacher's fastest micro-batch that fits "
                                       "(each candidate in a fresh process)")
    tune.add_argument("what", choices=["precompute"])
    tune.add_argument("rest", nargs=argparse.REMAINDER,
                      help="CONFIG.yaml and options (see kdflow tune precompute --help)")
    tune.set_defaults(func=_cmd_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    existing = list(logging.getLogger().handlers)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    from kdflow.commands.serverless import Terminated, install_terminal_logging
    from kdflow.tasks.common.worker import quiet_store_loggers

    for handler in logging.getLogger().handlers:  # ours: kdflow's own errors in one line each, tracebacks with -v
        if handler not in existing:
            install_terminal_logging(handler, args.verbose)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else every Prefect API request is an INFO line
    if not args.verbose:  # torch's own INFO lines (FakeTensor cache stats at exit, when torch's import was cut)
        logging.getLogger("torch").setLevel(logging.WARNING)
    logging.getLogger("kdflow").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    quiet_store_loggers()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The commands whose rerun goes on from where a stopped one was (the others start over).
    resumes = "; rerun the same command to resume" if args.command in ("run", "demo") or (
        args.command == "store" and args.action in ("import", "export")) else ""
    try:
        return int(args.func(args) or 0)
    except KDFlowError as error:
        if args.verbose:
            raise
        print(f"kdflow: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kdflow: interrupted{resumes}", file=sys.stderr)
        return 130
    except Terminated as stop:  # SIGTERM (`kill PID`) during `kdflow run` or `kdflow demo`
        print(f"kdflow: terminated{resumes}", file=sys.stderr)
        return int(stop.code or 143)
    except BrokenPipeError:  # `kdflow status ... | head`: the reader has what it wanted; stop as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes it
        return 128 + 13  # SIGPIPE's status
    # A failed stage after its retries, or a bug: one line here, the traceback in the run log.
    except Exception as error:
        if _interrupted_inside(error) and not args.verbose:
            print(f"kdflow: interrupted{resumes}", file=sys.stderr)
            return 130
        if args.verbose:
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        # Only failures a rerun gets past (a killed or crashed worker, a CUDA error) say "rerun to resume".
        hint = "rerun to resume; " if getattr(error, "rerun_resumes", False) else ""
        print(f"kdflow: error: {type(error).__name__}: {first_line} ({hint}-v for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
