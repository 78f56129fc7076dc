"""``pretrain`` command line: train (the rank program), prepare-data, train-tokenizer, demo, and the uploader and GC
of a config."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

from pretrain.checkpointing.tiering_config import run_gc, run_upload
from pretrain.commands.plan_command import add_plan_arguments
from pretrain.config import load_config
from pretrain.errors import ConfigError, DataError
from pretrain.platform.import_collector import imports_without_collecting
from pretrain.resilience.fast_exit import leave_now, under_launcher
from pretrain.resilience.standby.client import forward
from tiering.commands.main import configure_logging
from tiering.errors import LeaseError, RunKeyError

# Each verb imports what it needs when it runs: torch and Megatron take seconds to import, and
# `pretrain status`, `plan` or a config error must not wait for them.


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set or [])
    train = _import_megatron_side("pretrain.train", freeze=True).train  # a rank's heap lives long
    try:
        train(cfg)
    except BaseException as exc:
        # The attempt recorded the failure: under a launcher the rank leaves now, as run() would
        # have ended it (the same line or traceback, the same status), without the teardown.
        if under_launcher() and not cfg.fault_tolerance.inprocess.enabled:
            leave_now(exc, _one_line(exc))
        raise
    return 0


def _import_megatron_side(module: str, freeze: bool) -> ModuleType:
    """Import ``module``, which imports Megatron Core, with torch.compile deferred and the garbage
    collector paused. Megatron decorates its fused kernels with torch.compile at import (Dynamo and
    Inductor: ~3 s of CPU at every rank start, every ``prepare-data`` Slurm array task and init
    container), and a collection during the imports finds nothing to free (~1 s on 2 cores).
    ``freeze``: what was imported stays out of later collections (a rank); False where ``main``
    may run inside a longer-lived process whose garbage must stay collectable (prepare-data in tests)."""
    with imports_without_collecting(freeze=freeze):
        # Deferred: lazy_compile imports torch, which the verbs that need no Megatron never import.
        from pretrain.platform.lazy_compile import defer_torch_compile

        defer_torch_compile()  # before Megatron is imported (see pretrain/platform/lazy_compile.py)
        return importlib.import_module(module)


def _prepare(args: argparse.Namespace) -> int:
    _import_megatron_side("pretrain.data.prepare", freeze=False)  # Megatron's indexed-dataset writer
    from pretrain.data.inputs import parse_shard
    from pretrain.data.prepare import prepare_data

    if bool(args.input) == (args.synthetic_mb is not None):
        print("pretrain prepare-data: give --input FILES or --synthetic-mb N (one of them)", file=sys.stderr)
        return 2
    try:
        shard = parse_shard(args.shard) if args.shard else None
    except ValueError as exc:
        print(f"pretrain prepare-data: {exc}", file=sys.stderr)
        return 2
    try:
        report = prepare_data(
            args.output,
            args.input or (),
            args.synthetic_mb,
            args.seed,
            args.tokenizer,
            args.tokenizer_path,
            args.json_key,
            args.skip_bad_lines,
            args.workers,
            progress=not args.no_progress,
            shard=shard,
            skip_bad_files=args.skip_bad_files,
            min_chars=args.min_chars,
            dedup=args.dedup,
            read_chunk_bytes=int(args.read_buffer_mb * (1 << 20)),
        )
    except DataError as exc:
        print(f"pretrain prepare-data: {exc}", file=sys.stderr)
        return 2
    print(_report_line(report, "already done, not redone: " if report["skipped"] else "wrote "))
    return 0


def _report_line(report: dict, verb: str) -> str:
    """One line of a prepare/merge report: where, documents, tokens, what was dropped and why."""
    tok = report["settings"]["tokenizer"]
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(report["dropped"].items()) if n) or "none"
    bad = f", {len(report['bad_files'])} bad file(s) cut short" if report["bad_files"] else ""
    return (
        f"{verb}{report['prefix']}.bin/.idx: {report['documents']} documents, {report['tokens']} tokens "
        f"({tok['kind']}, vocab {tok['vocab_size']}), dropped: {dropped}{bad}, snapshot {report['snapshot']}"
    )


def _merge(args: argparse.Namespace) -> int:
    _import_megatron_side("pretrain.data.prepare", freeze=False)  # Megatron's indexed-dataset writer
    from pretrain.data.prepare import merge_data
    from pretrain.errors import DataError

    try:
        report = merge_data(args.shards, args.output)
    except DataError as exc:
        print(f"pretrain merge-data: {exc}", file=sys.stderr)
        return 2
    print(_report_line({**report, "prefix": args.output}, f"merged {report['shards']} shards: "))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    run_evaluate = _import_megatron_side("pretrain.commands.evaluate", freeze=False).run_evaluate
    return run_evaluate(load_config(args.config, args.set or []), args.checkpoint, args.step)


def _train_tokenizer(args: argparse.Namespace) -> int:
    from pretrain.data.train_tokenizer import train_bpe_tokenizer

    missing = [f for f in args.input if not Path(f).is_file()]
    if missing:
        print(f"pretrain train-tokenizer: {missing[0]}: no such file; fix: pass existing files", file=sys.stderr)
        return 2
    try:
        ident = train_bpe_tokenizer(
            args.input,
            args.vocab_size,
            args.output,
            args.special_tokens or (),
            args.json_key,
            args.min_frequency,
            args.skip_bad_lines,
        )
    except DataError as exc:
        print(f"pretrain train-tokenizer: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: vocab {ident['vocab_size']}, eod id {ident['eod']}, sha256 {ident['sha256']}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pretrain.commands.demo import run_demo

    return run_demo(args.config, args.workdir, args.set or [])


def _plan(args: argparse.Namespace) -> int:
    from pretrain.commands.plan_command import run_plan

    return run_plan(args)


def _drill(args: argparse.Namespace) -> int:
    from pretrain.commands.drill import run_drill

    return run_drill(args.config, args.workdir)


def _soak(args: argparse.Namespace) -> int:
    from pretrain.commands.soak import run_soak
    from pretrain.soak.schedule import SoakRequestError

    try:
        return run_soak(
            args.config, args.faults, args.mtti, args.seed, args.kinds, args.workdir, args.steps, args.mtti_steps,
            args.baseline_alongside, args.data, args.set or [],
        )  # fmt: skip
    except SoakRequestError as exc:
        print(exc, file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace) -> int:
    from pretrain.commands.launch import excluded_nodes, launch, requeue_evidence
    from pretrain.errors import STOP_EXIT_CODE, JobStopped, LaunchError, NodeExcluded, NodeLaunchError

    # Exit codes (docs/runbook.md "Exit codes of pretrain launch"): STOP_EXIT_CODE (2) for what
    # fails the same on every node (a stopped run, a config or deployment error): never restart;
    # NodeLaunchError.EXIT_CODE (3) for what is wrong with this node only: restart elsewhere.
    try:
        if args.excluded_nodes:
            print(excluded_nodes(args.config, args.set or []))
            return 0
        if args.requeue_evidence:
            print(requeue_evidence(args.config, args.set or []))
            return 0
        return launch(args.config, args.nproc_per_node, args.max_restarts, args.ft_config, args.dry_run, args.set or [])
    except NodeExcluded as exc:
        print(f"launch refused: {exc}", file=sys.stderr)
        return NodeExcluded.EXIT_CODE
    except NodeLaunchError as exc:
        print(f"launch error on this node: {exc}", file=sys.stderr)
        return NodeLaunchError.EXIT_CODE
    except LaunchError as exc:
        print(f"launch error: {exc}", file=sys.stderr)
        return STOP_EXIT_CODE
    except JobStopped as exc:
        print(f"launch refused: {exc.message}", file=sys.stderr)
        return int(exc.code)


def _node_domain(args: argparse.Namespace) -> int:
    from pretrain.commands.node_domain import HOSTNAME_LABEL, ApiServer, labels_from, node_domain
    from pretrain.errors import STOP_EXIT_CODE, LaunchError, NodeLaunchError

    labels = labels_from(args.label, os.environ)
    api = ApiServer(args.api_server, Path(args.token_file), None) if args.api_server else None
    try:
        label, domain = node_domain(args.node, labels, Path(args.output), node_json=args.node_json, api=api)
    except NodeLaunchError as exc:  # this node cannot reach the API server: restart elsewhere
        print(f"node-domain error on this node: {exc}", file=sys.stderr)
        return NodeLaunchError.EXIT_CODE
    except LaunchError as exc:
        print(f"node-domain error: {exc}", file=sys.stderr)
        return STOP_EXIT_CODE
    if label == HOSTNAME_LABEL and HOSTNAME_LABEL not in labels:
        print(f"node {args.node}: none of the labels {', '.join(labels)}; failure domain falls back to the node")
    print(f"node {args.node}: failure domain {domain} (label {label}) -> {args.output}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from pretrain.commands.status import format_status, status_json

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"pretrain status: {run_dir}: no such directory; fix: pass <run.dir>/<run.id>", file=sys.stderr)
        return 2
    if args.goodput:
        import json

        from pretrain.observability.goodput import format_goodput, goodput_from_records

        g = goodput_from_records(run_dir)
        print(json.dumps(g.to_dict(), indent=2) if args.json else format_goodput(g))
        return 0
    print(status_json(run_dir) if args.json else format_status(run_dir))
    return 0


def _upload(args: argparse.Namespace) -> int:
    configure_logging()
    cfg = load_config(args.config, args.set or [])
    return run_upload(cfg, watch=args.watch, max_seconds=args.max_seconds, metrics_port=args.metrics_port)


def _gc(args: argparse.Namespace) -> int:
    configure_logging()
    return run_gc(load_config(args.config, args.set or []), apply=args.apply)


def _add_tier3_commands(sub: argparse._SubParsersAction) -> None:
    """``pretrain upload`` and ``pretrain gc``: tiering's uploader and GC with a config's settings."""
    up = sub.add_parser("upload", help="tiering upload with the config's staging dir, checkpoint.s3 and run.id")
    up.add_argument("--config", required=True)
    up.add_argument("--set", action="append", metavar="KEY=VALUE")
    mode = up.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="upload what is pending and exit (default)")
    mode.add_argument("--watch", action="store_true", help="keep polling the staging directory")
    up.add_argument("--max-seconds", type=float, default=None, help="stop watching after this long")
    up.add_argument("--metrics-port", type=int, default=None, help="serve the uploader's Prometheus metrics here")
    up.set_defaults(func=_upload)

    g = sub.add_parser("gc", help="tiering gc with checkpoint.s3.keep/milestone_every (dry run unless --apply)")
    g.add_argument("--config", required=True)
    g.add_argument("--set", action="append", metavar="KEY=VALUE")
    g.add_argument("--apply", action="store_true")
    g.set_defaults(func=_gc)


def _add_node_domain_command(sub: argparse._SubParsersAction) -> None:
    """``pretrain node-domain``: the Kubernetes init container that writes the launcher's topology file."""
    nd = sub.add_parser("node-domain", help="write this node's failure domain (from its labels) into a topology file")
    nd.add_argument("--node", default=os.environ.get("NODE_NAME", ""), help="the node (default: NODE_NAME)")
    nd.add_argument(
        "--label",
        action="append",
        help="node label naming the domain, preferred first; the trainer falls back through them to the node "
        "(repeatable; default: FAILURE_DOMAIN_LABEL, else topology.k8s.aws/network-node-layer-3,-layer-2)",
    )
    nd.add_argument("--output", required=True, help="the topology file pretrain launch reads (TOPOLOGY_FILE)")
    nd.add_argument("--node-json", type=Path, default=None, help="a recorded `kubectl get node -o json` instead")
    nd.add_argument("--api-server", default=None, help="API server URL (default: in-cluster)")
    nd.add_argument("--token-file", default="/var/run/secrets/kubernetes.io/serviceaccount/token")
    nd.set_defaults(func=_node_domain)


def _add_data_commands(sub: argparse._SubParsersAction) -> None:
    """``pretrain prepare-data`` and ``pretrain train-tokenizer``."""
    kinds = ("byte", "huggingface", "sentencepiece")
    d = sub.add_parser("prepare-data", help="tokenize text/JSONL/Parquet files into a Megatron indexed dataset")
    d.add_argument(
        "--input",
        nargs="+",
        help="files, directories or globs: text (blank lines separate documents), .jsonl, .parquet; .gz/.zst too",
    )
    d.add_argument("--synthetic-mb", type=float, help="generate a deterministic synthetic corpus of N MB instead")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--output", required=True, help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    d.add_argument("--tokenizer", choices=kinds, default="byte", help="as data.tokenizer (default: byte)")
    d.add_argument("--tokenizer-path", help="local tokenizer.json (huggingface) or .model (sentencepiece)")
    d.add_argument("--json-key", default="text", help="the text field of JSONL lines, the text column of Parquet")
    d.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) JSONL lines without text")
    d.add_argument("--skip-bad-files", action="store_true", help="keep what a truncated .gz/.zst held, go on")
    d.add_argument("--min-chars", type=int, default=0, help="drop documents shorter than this (characters)")
    d.add_argument("--dedup", action="store_true", help="drop exact-duplicate documents (the first is kept)")
    d.add_argument("--shard", metavar="I/N", help="prepare shard I (0..N-1) of N; merge with merge-data")
    d.add_argument("--read-buffer-mb", type=float, default=1.0, help="compressed input read at a time")
    d.add_argument("--workers", type=int, default=1, help="tokenizer processes (output identical for any N)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    d.set_defaults(func=_prepare)

    mg = sub.add_parser("merge-data", help="merge the shards of prepare-data --shard into one dataset")
    mg.add_argument("--shards", required=True, help="the --output the shards were prepared with")
    mg.add_argument("--output", required=True, help="output prefix of the merged dataset")
    mg.set_defaults(func=_merge)

    tt = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json on local files (offline)")
    tt.add_argument("--input", nargs="+", required=True, help="text files or .jsonl files")
    tt.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, special tokens included")
    tt.add_argument("--output", required=True, help="the tokenizer.json to write")
    tt.add_argument(
        "--special-tokens", nargs="+", metavar="TOKEN", help="first ids; <|endoftext|> is added if no EOS is given"
    )
    tt.add_argument("--json-key", default="text", help="the text field of .jsonl/.json/.ndjson lines")
    tt.add_argument("--min-frequency", type=int, default=2, help="a merge needs a pair seen this often")
    tt.add_argument("--skip-bad-lines", action="store_true", help="skip JSONL lines without text")
    tt.set_defaults(func=_train_tokenizer)


def _add_experiment_commands(sub: argparse._SubParsersAction) -> None:
    """The recovery experiments: ``drill`` (chosen faults) and ``soak`` (random ones)."""
    dr = sub.add_parser(
        "drill",
        help="recovery drill at CPU scale: a kill restored and compared with an uninterrupted run, a restart, "
        "damaged checkpoints rejected, repeated failures stopping the job; writes drill-report.{md,json} and a plot",
    )
    dr.add_argument("--config", default=None, help="base config (default: the embedded tiny-cpu config)")
    dr.add_argument("--workdir", default="runs/drill")
    dr.set_defaults(func=_drill)

    so = sub.add_parser(
        "soak",
        help="random faults (seeded kinds, ranks, exponential gaps) against a job under ft_launcher, compared with "
        "a fault-free run; writes soak-report.{md,json} and soak-timeline.png",
    )
    so.add_argument("--config", default=None, help="base config (default: the embedded tiny-cpu config)")
    so.add_argument("--faults", type=int, default=10, help="how many faults to inject")
    so.add_argument("--mtti", type=float, default=30.0, help="mean seconds from a recovery to the next fault")
    so.add_argument(
        "--mtti-steps",
        type=float,
        default=None,
        help="pace faults by steps trained instead of seconds: mean steps from a recovery to the next fault "
        "(where faults land then does not depend on the machine's speed; replaces --mtti)",
    )
    so.add_argument(
        "--baseline-alongside",
        action="store_true",
        help="run the fault-free baseline at the same time as the faulted run (sooner done; the time-to-N-steps "
        "ratio then compares two runs sharing the machine)",
    )
    so.add_argument("--seed", type=int, default=0, help="the schedule's random generator is seeded with this")
    so.add_argument("--kinds", default=None, help="comma-separated fault kinds (default: all of them)")
    so.add_argument("--steps", type=int, default=300, help="steps of the faulted run (and of the baseline)")
    so.add_argument(
        "--data", default=None, help="an indexed dataset prefix to train on (default: a 1 MB synthetic corpus)"
    )
    so.add_argument("--workdir", default="runs/soak")
    so.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key of every run (repeatable), e.g. checkpoint.s3.uri and checkpoint.s3.endpoint_url "
        "for the s3-unreachable kind",
    )
    so.set_defaults(func=_soak)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="the rank program (run it under ft_launcher or torchrun)")
    t.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    t.set_defaults(func=_train)

    ev = sub.add_parser("evaluate", help="validation loss and perplexity of one checkpoint (JSON)")
    ev.add_argument("--config", required=True)
    ev.add_argument("--checkpoint", required=True, help="a step directory of any tier, or s3://bucket/prefix")
    ev.add_argument("--step", type=int, default=None, help="with s3://: the step (default: the newest)")
    ev.add_argument("--set", action="append", metavar="KEY=VALUE")
    ev.set_defaults(func=_evaluate)

    _add_data_commands(sub)

    la = sub.add_parser("launch", help="derive the node's place from Slurm/Kubernetes and exec ft_launcher")
    la.add_argument("--config", required=True)
    la.add_argument("--nproc-per-node", type=int, default=8)
    la.add_argument("--max-restarts", type=int, default=3)
    la.add_argument("--ft-config", default="configs/ft-cpu.yaml")
    la.add_argument("--dry-run", action="store_true", help="print the exact command instead of running it")
    la.add_argument(
        "--excluded-nodes", action="store_true", help="print the run's excluded nodes, comma separated, and exit"
    )
    la.add_argument(
        "--requeue-evidence",
        action="store_true",
        help="print '<node the newest attempt blames or -> <progressed 0|1> <evidence>' (the sbatch requeue) and exit",
    )
    la.add_argument("--set", action="append", metavar="KEY=VALUE")
    la.set_defaults(func=_launch)

    _add_node_domain_command(sub)

    st = sub.add_parser("status", help="one line per attempt of a run: restores, lost steps, RTO, failures")
    st.add_argument("run_dir", help="<run.dir>/<run.id>, e.g. runs/tiny-run")
    st.add_argument("--json", action="store_true")
    st.add_argument("--goodput", action="store_true", help="productive time and badput by cause, from the records")
    st.set_defaults(func=_status)

    pl = sub.add_parser("plan", help="Young/Daly checkpoint intervals, projected goodput and storage capacity")
    add_plan_arguments(pl)
    pl.set_defaults(func=_plan)

    _add_experiment_commands(sub)

    _add_tier3_commands(sub)

    m = sub.add_parser("demo", help="2-rank CPU run under ft_launcher with one injected failure")
    m.add_argument("--config", default=None, help="config (default: the embedded tiny-cpu config)")
    m.add_argument("--workdir", default="runs/demo", help="where data, checkpoints and logs go")
    m.add_argument("--set", action="append", metavar="KEY=VALUE")
    m.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``pretrain`` console script: under a launcher with a standby server beside it, the rank
    is forked there (already imported), as ``python -m pretrain`` does; otherwise it runs here.
    ``argv`` given (a caller in this process, not a command line): always here."""
    if argv is None:
        code = forward("pretrain")  # the fork runs ``python -m pretrain`` with this process's argv
        if code is not None:
            return code
    return run(argv)


def run(argv: list[str] | None = None) -> int:
    """The command ``argv`` (default: this process's command line) in this process."""
    # torch warns about a deprecated pynvml on every import: noise for CLI users.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    os.umask(0o077)  # what this command and every process it starts writes is private to the user
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError, LeaseError, RunKeyError) as exc:
        one = _one_line(exc)
        assert one is not None
        print(one[0], file=sys.stderr)
        return one[1]


def _one_line(exc: BaseException) -> tuple[str, int] | None:
    """The line and exit status of an error the user needs one line for (a data error is also
    recorded as a data failure by the attempt); None for any other."""
    if isinstance(exc, ConfigError):
        return f"config error: {exc}", 2
    if isinstance(exc, DataError):
        return f"data error: {exc}", 1
    if isinstance(exc, LeaseError):
        return f"lease error: {exc}", 2
    if isinstance(exc, RunKeyError):
        return f"run key error: {exc}", 2
    return None
