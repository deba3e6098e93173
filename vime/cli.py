"""`vime train | eval | serve | data | upcycle | report` — one entry point for everything a user runs.

Run scripts written for slime or vllm-project/vime run as they are: the commands that take a run's
flags read them in slime's dialect (`vime.compat.SLIME`: its flags, plug-in names and router),
which the entry points hand the core; the core itself never imports vime/compat/.

User mistakes and outside failures vime can name (bad flags, missing files, unreachable
engines: every `VimeError`) end with one line on stderr and exit code 2; set VIME_DEBUG=1 to
see the traceback instead. Any other exception is a bug, in vime or below it, and keeps its
traceback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

USAGE = """usage: vime <command> [flags]

commands:
  train     GRPO training, synchronous (same as train.py)
  train-async  one-step-off / fully-async training (same as train_async.py)
  eval      greedy evaluation of a model or checkpoint on held-out prompts
  serve     run the built-in rollout engine as an HTTP server
  data      write a verifiable task's train/test JSONL (built-in, or rg:<name> from reasoning-gym)
  upcycle   make a dense Llama-family model (default: the embedded SmolLM2) a Mixtral mixture of experts
  report    print the speed and accuracy tables of run directories, write plots
  bench ab  one config through several modes (sync, one-step-off, fully-async, decoupled), then report

`vime <command> --help` explains each command's flags."""


def guarded(fn: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run a command: SIGTERM and Ctrl-C unwind it (engines and workers stopped) and exit 143 /
    130; a user's mistake is one line on stderr and exit 2."""
    from vime.errors import VimeError
    from vime.lifetime import Terminated, sigterm_received, stop_on_sigterm

    stop_on_sigterm()
    try:
        return fn(argv)
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except (KeyboardInterrupt, SystemExit) as e:
        if isinstance(e, SystemExit):
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except VimeError as e:
        if os.environ.get("VIME_DEBUG"):
            raise
        if sigterm_received():  # e.g. its engine went down with the same signal first
            print(f"terminated ({e})", file=sys.stderr)
            return 143
        print(f"error: {e}", file=sys.stderr)
        return 2


def _undo_ray_thread_cap() -> None:
    """A Ray job's entrypoint gets OMP_NUM_THREADS=1 from Ray (meant for its many small workers),
    which would run every CPU op of vime's trainer and engines on one thread. Unless the job's
    runtime env set it, drop it before torch is imported."""
    job = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if job is None or os.environ.get("OMP_NUM_THREADS") != "1":
        return
    try:
        env_vars = json.loads(job).get("runtime_env", {}).get("env_vars", {})
    except (ValueError, AttributeError):
        env_vars = {}
    if "OMP_NUM_THREADS" not in env_vars:
        del os.environ["OMP_NUM_THREADS"]
        print(
            "running as a Ray job: dropped Ray's OMP_NUM_THREADS=1 (set it in the job's env_vars to keep it)",
            file=sys.stderr,
        )


def train_main(argv: list[str], entry: str = "sync") -> int:
    """`entry`: sync (train.py) or async (train_async.py); the run's mode follows from it and the
    flags (`Config.validate`)."""
    from vime.compat import parse_args

    prog = "train.py" if entry == "sync" else "train_async.py"
    desc = (
        "GRPO training: generate → train → push weights, in sequence."
        if entry == "sync"
        else "Asynchronous GRPO training: generation overlaps training (one-step-off, or fully-async with its rollout function)."
    )
    args = parse_args(argv, prog=prog, description=desc, entry=entry)
    _undo_ray_thread_cap()
    from vime.lifetime import owned
    from vime.loops import train  # heavy imports (torch, transformers) only once the flags are good
    from vime.preflight import resume_point

    resume_point(args)  # before the lock file goes into --save: a refused --load directory gets nothing
    out, locks = args.output, []
    if out.run_name is not None:  # set by validation for training (a fresh timestamp by default)
        run_dir = Path(out.run_dir)
        locks.append((run_dir.parent / f".{run_dir.name}.lock", f"run directory {run_dir}"))
    if out.save:
        locks.append((Path(out.save) / ".vime.lock", f"--save {out.save}"))
    with owned(locks):
        run_dir = train(args)
    print(f"run written to {run_dir}")
    return 0


def eval_main(argv: list[str]) -> int:
    """Greedy accuracy of a model/checkpoint on the first N eval prompts."""
    import json

    from vime.backends.placement import fresh_path
    from vime.compat import parse_args
    from vime.eval import evaluate
    from vime.launch.assemble import assemble

    args = parse_args(
        argv,
        prog="vime eval",
        description="Greedy evaluation: accuracy on held-out prompts (writes per-sample JSONL).",
        entry="eval",
    )
    ctx = assemble(args, evaluation=True)  # the model and prompts are checked before an engine starts
    try:
        # claimed now, so an earlier eval's results stay, and one running at the same time gets another name:
        # eval.jsonl, eval.1.jsonl, ...; with several sets eval.<name>.jsonl, eval.<name>.1.jsonl, ...
        sets = args.eval.eval_sets
        several = len(sets) > 1
        paths = {
            (s["name"] if several else None): fresh_path(
                ctx.run_dir / (f"eval.{s['name']}.jsonl" if several else "eval.jsonl")
            )
            for s in sets
        }
        try:
            m = evaluate(ctx.args, 0, paths.__getitem__)
        except BaseException:
            for path in paths.values():
                path.unlink(missing_ok=True)  # claimed, perhaps never written
            raise
    finally:
        ctx.close()
    shown = {f"{name} ": f"eval/{name}/" for name in paths if name is not None}
    for label, prefix in shown.items():
        print(
            f"{label}accuracy {m[prefix + 'accuracy']:.4f} ({m[prefix + 'correct']}/{m[prefix + 'total']})  per-sample results: {paths[label.strip()]}"
        )
    where = "" if several else f"  per-sample results: {paths[None]}"
    print(
        f"{'all ' if several else ''}accuracy {m['eval/accuracy']:.4f} ({m['eval/correct']}/{m['eval/total']}){where}"
    )
    keys = [f"{prefix}{k}" for prefix in ("eval/", *shown.values()) for k in ("accuracy", "correct", "total")]
    print(json.dumps({k: m[k] for k in keys}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return guarded(lambda a: train_main(a, "sync"), rest)
    if cmd == "train-async":
        return guarded(lambda a: train_main(a, "async"), rest)
    if cmd == "eval":
        return guarded(eval_main, rest)
    if cmd == "serve":
        from vime.engine.server import main as serve_main

        return guarded(lambda a: serve_main(a) or 0, rest)
    if cmd == "data":
        from vime.datagen import main as data_main

        return guarded(lambda a: data_main(a) or 0, rest)
    if cmd == "upcycle":
        from vime.upcycle import main as upcycle_main

        return guarded(upcycle_main, rest)
    if cmd == "bench":
        if not rest or rest[0] != "ab":
            print(
                "usage: vime bench ab --config run.yaml --arms sync,one-step-off,fully-async[,decoupled]",
                file=sys.stderr,
            )
            return 2
        from vime.ab import main as ab_main

        return guarded(ab_main, rest[1:])
    if cmd == "report":
        from vime.report import main as report_main

        return guarded(lambda a: report_main(a) or 0, rest)
    print(f"vime: unknown command '{cmd}'\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
