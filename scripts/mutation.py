"""Mutation testing of gpukit's core modules, one module at a time (see docs/testing.md).

    python scripts/mutation.py                      # every core module
    python scripts/mutation.py gpukit.gpus.select   # one or more modules
    python scripts/mutation.py --list               # the core modules and the tests run on each

Each module is mutated by mutmut in a scratch copy of the project, against the test files that
state its behaviour (running the whole suite for each mutant would take hours on a small
machine). The score is the share of mutants that some test kills; a survivor is either a test
to write or, when the mutant changes nothing a user can observe, an equivalent mutant to record
with its reason in docs/testing.md. Not part of CI: a module takes minutes.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module -> the test files that state its behaviour
CORE: dict[str, list[str]] = {
    "gpukit.sharing.claims": [
        "tests/sharing/test_claims.py",
        "tests/sharing/test_lock_security.py",
    ],
    "gpukit.gpus.select": ["tests/gpus/test_select.py", "tests/sharing/test_pick_boundaries.py"],
    # gk.pick and check_user_limit, measured as part of gpus/select.py until they moved here
    "gpukit.sharing.pick": ["tests/gpus/test_select.py", "tests/sharing/test_pick_boundaries.py"],
    "gpukit.gpus.criteria": [
        "tests/gpus/test_select.py",
        "tests/sharing/test_pick_boundaries.py",
        "tests/sharing/test_tickets.py",
        "tests/test_sizes.py",
    ],
    "gpukit.sharing.waiters": [
        "tests/sharing/test_tickets.py",
        "tests/sharing/test_waiters_what_counts.py",
    ],
    "gpukit.sharing.tickets": [
        "tests/sharing/test_tickets.py",
        "tests/sharing/test_acquire.py",
        "tests/sharing/test_policy.py",
        "tests/sharing/test_tickets_rules.py",
    ],
    "gpukit.sharing.lockfiles": [
        "tests/sharing/test_lockfiles.py",
        "tests/sharing/test_lockfiles_refusals.py",
        "tests/sharing/test_lock_security.py",
    ],
    "gpukit.gpus.visible": [
        "tests/gpus/test_visible.py",
        "tests/gpus/test_visible_boundaries.py",
        "tests/gpus/test_grants.py",
        "tests/gpus/test_visible_rules.py",
    ],
    # the grants, measured as part of gpus/visible.py until they moved here
    "gpukit.gpus.grants": [
        "tests/gpus/test_grants.py",
        "tests/gpus/test_visible_rules.py",
    ],
    "gpukit.transfer": [
        "tests/test_transfer.py",
        "tests/parallel/test_data_parallel.py",
        "tests/test_transfer_options.py",
    ],
    "gpukit.parallel.scatter": ["tests/parallel/test_scatter.py"],
    "gpukit.parallel.gather": [
        "tests/parallel/test_gather.py",
        "tests/parallel/test_gather_devices.py",
    ],
    "gpukit.checkpoint.keys": [
        "tests/checkpoint/test_keys.py",
        "tests/checkpoint/test_load.py",
        "tests/checkpoint/test_which_weights.py",
    ],
    "gpukit.checkpoint.single_file": [
        "tests/checkpoint/test_load.py",
        "tests/checkpoint/test_save.py",
        "tests/checkpoint/test_which_weights.py",
        "tests/checkpoint/test_folders.py",
        "tests/checkpoint/test_reading.py",
        "tests/checkpoint/test_sources.py",
        "tests/checkpoint/test_convert_describe.py",
        "tests/checkpoint/test_hostile.py",
    ],
    "gpukit.checkpoint.atomic": [
        "tests/checkpoint/test_atomic.py",
        "tests/checkpoint/test_durability.py",
        "tests/checkpoint/test_folders.py",
        "tests/checkpoint/test_atomic_writes.py",
    ],
    "gpukit.memory.batch_size": [
        "tests/memory/test_batch_size.py",
        "tests/memory/test_batch_size_across_processes.py",
        "tests/memory/test_batch_size_log.py",
    ],
    "gpukit.distributed.data": [
        "tests/distributed/test_distributed.py",
        "tests/distributed/test_distributed_loader_epochs.py",
        "tests/distributed/test_distributed_loader_rules.py",
        "tests/train/test_loader_position.py",
        "tests/train/test_accumulate.py",
    ],
    # The weights of exact accumulation: in one process, then with this process as rank 0 of two
    # (the token count's all-reduce).
    "gpukit.train.accumulate": [
        "tests/train/test_accumulate.py",
        "tests/train/test_accumulate_two_processes.py",
    ],
    # Exact mode's cut and fixed-order sum: in one process, then as rank 0 of two (the sum
    # over the ranks, FSDP2's reduce-scatter); the whole-run bitwise tests are too slow here.
    "gpukit.train.exact": [
        "tests/train/test_exact_mode.py",
        "tests/train/test_exact_two_processes.py",
    ],
    "gpukit.distributed.streams": [
        "tests/train/test_exact_mode.py",
        "tests/train/test_loader_position.py",
    ],
    # The training stage, each module against its fast test files (the multi-process
    # end-to-end runs, minutes each, are left to CI).
    "gpukit.train.precision": [
        "tests/train/test_precision_words.py",
        "tests/train/test_precision.py",
        "tests/train/test_step_edges.py",
    ],
    "gpukit.train.scaler": [
        "tests/train/test_scaler.py",
        "tests/train/test_precision.py",
        "tests/train/test_step_edges.py",
        "tests/train/test_accumulate.py",
    ],
    "gpukit.train.context": [
        "tests/train/test_step_context_fields.py",
        "tests/train/test_step_context.py",
        "tests/train/test_accumulate.py",
    ],
    # The step in one process, then as rank 0 of two (counts summed over a group, exact mode's
    # sum over the ranks). DDP's no_sync is reached in one process; the two-process runs of
    # the loaders and the training state's tests would add a minute or more to each mutant.
    "gpukit.train.step": [
        "tests/train/test_step_arguments.py",
        "tests/train/test_step_context.py",
        "tests/train/test_accumulate.py",
        "tests/train/test_precision.py",
        "tests/train/test_step_edges.py",
        "tests/train/test_scaler.py",
        "tests/train/test_stand_in.py",
        "tests/train/test_exact_mode.py",
        "tests/train/test_step_rules.py",
        "tests/train/test_step_two_processes.py",
        "tests/train/test_exact_two_processes.py",
    ],
    "gpukit.train.rng": [
        "tests/train/test_state.py",
        "tests/train/test_step_edges.py",
        "tests/train/test_rng_streams.py",
    ],
    "gpukit.train.saves": [
        "tests/train/test_state.py",
        "tests/train/test_save_trust.py",
        "tests/train/test_saves_edges.py",
        "tests/train/test_saves_markers.py",
        "tests/train/test_saves_folder.py",
    ],
    "gpukit.train.state": [
        "tests/train/test_state.py",
        "tests/train/test_saves_edges.py",
        "tests/train/test_staging.py",
        "tests/train/test_save_trust.py",
        "tests/train/test_contents_rules.py",
        "tests/train/test_staging_rules.py",
        "tests/train/test_preempt.py",
        "tests/train/test_preempt_rules.py",
        "tests/train/test_step_edges.py",
        "tests/train/test_state_rules.py",
        "tests/train/test_state_two_processes.py",
    ],
    "gpukit.train.contents": [
        "tests/train/test_state.py",
        "tests/train/test_save_trust.py",
        "tests/train/test_contents_rules.py",
    ],
    "gpukit.train._writing": [
        "tests/train/test_state.py",
        "tests/train/test_saves_edges.py",
        "tests/train/test_save_meeting.py",
        "tests/train/test_writing_rules.py",
    ],
    "gpukit.train._staging": [
        "tests/train/test_staging.py",
        "tests/train/test_state.py",
        "tests/train/test_staging_rules.py",
    ],
    # A training state's sharded part is written by sharded processes alone: this process is
    # rank 0 of two there.
    "gpukit.train._sharded_part": [
        "tests/train/test_shard_two_processes.py",
        "tests/train/test_shard_checkpoint.py",
        "tests/train/test_shard_checkpoint_rules.py",
    ],
    # Preemption in one process, then as rank 0 of two (the agreement, the told requeue).
    "gpukit.train.preempt": [
        "tests/train/test_preempt.py",
        "tests/train/test_preempt_and_loader_edges.py",
        "tests/train/test_preempt_rules.py",
        "tests/train/test_preempt_two_processes.py",
    ],
    "gpukit.train.shard": [
        "tests/train/test_shard_two_processes.py",
        "tests/train/test_shard_policy.py",
        "tests/train/test_shard_checkpoint_rules.py",
        "tests/train/test_step_edges.py",
    ],
    "gpukit.distributed.position": [
        "tests/distributed/test_loader_position_checks.py",
        "tests/train/test_loader_position.py",
        "tests/distributed/test_loader_seed_and_epoch.py",
        "tests/train/test_preempt_and_loader_edges.py",
    ],
    "gpukit.distributed.batch_sizes": [
        "tests/distributed/test_distributed.py",
        "tests/distributed/test_distributed_loader_rules.py",
        "tests/train/test_accumulate.py",
    ],
    "gpukit.untrusted": [
        "tests/untrusted/test_bounded_reads.py",
        "tests/untrusted/test_every_failure_is_invalid_input.py",
        "tests/untrusted/test_opened_one_way.py",
        "tests/untrusted/test_checked_by_type.py",
        "tests/untrusted/test_printable.py",
        "tests/untrusted/test_streams_capped.py",
        "tests/untrusted/test_boundaries.py",
        "tests/untrusted/test_layer_rules.py",
    ],
    # What gpukit writes for others: measured as part of untrusted.py until it moved here.
    "gpukit.output": [
        "tests/untrusted/test_finite_out.py",
        "tests/untrusted/test_written_in_one_step.py",
        "tests/untrusted/test_write_output_durable.py",
        "tests/untrusted/test_boundaries.py",
        "tests/untrusted/test_layer_rules.py",
    ],
    "gpukit._tree": [
        "tests/test_tree.py",
        "tests/test_transfer.py",
        "tests/test_tree_contract.py",
        "tests/test_transfer_options.py",
    ],
}


def _config(module: str, tests: list[str]) -> str:
    source = "src/" + module.replace(".", "/") + ".py"
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["src/gpukit"]\n'
        f"only_mutate = [{json.dumps(source)}]\n"
        'also_copy = ["src", "tests"]\n'
        'pytest_add_cli_args = ["-p", "no:randomly", "-p", "no:cacheprovider", "-q"]\n'
        f"pytest_add_cli_args_test_selection = {json.dumps([*tests, '-m', 'not slow'])}\n"
        'process_isolation = "forkserver"\n'
    )


def run_module(
    module: str,
    tests: list[str],
    keep: Path | None,
    children: int | None = None,
    keep_scratch: bool = False,
    only: list[str] | None = None,
) -> dict[str, int | float | str]:
    """Mutate ``module`` in a scratch copy, run its tests against each mutant, return the counts.

    With ``only``, just those mutants are tested (the survivors of an earlier run, after new
    tests were added): the counts then cover those mutants alone.
    """
    present = [t for t in tests if (ROOT / t).exists()]
    if not present:
        raise SystemExit(f"{module}: none of its test files exist: {tests}")
    scratch = Path(tempfile.mkdtemp(prefix=f"gpukit-mutation-{module}-"))
    try:
        for name in ("src", "tests"):
            shutil.copytree(
                ROOT / name, scratch / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        pyproject = (ROOT / "pyproject.toml").read_text()
        pyproject = re.sub(r"\n\[tool\.mutmut\]\n(?:[^\[].*\n|\n)*", "\n", pyproject)
        (scratch / "pyproject.toml").write_text(pyproject + _config(module, present))
        limit = [] if children is None else ["--max-children", str(children)]
        subprocess.run(
            [sys.executable, "-m", "mutmut", "run", *limit, *(only or [])],
            cwd=scratch,
            check=False,
        )
        subprocess.run(
            [sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=scratch, check=True
        )
        stats = json.loads((scratch / "mutants" / "mutmut-cicd-stats.json").read_text())
        survivors = subprocess.run(
            [sys.executable, "-m", "mutmut", "results"],
            cwd=scratch,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{module}.survivors.txt").write_text(survivors)
    finally:
        if keep_scratch:
            print(f"{module}: scratch copy kept in {scratch} (`mutmut show NAME` there)")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    # Counted from the outcomes, so that mutants an `only` run left out are not counted.
    outcomes = ("killed", "timeout", "survived", "no_tests", "suspicious", "segfault")
    tested = sum(int(stats.get(outcome, 0)) for outcome in outcomes)
    killed = int(stats.get("killed", 0)) + int(stats.get("timeout", 0))
    return {
        "module": module,
        "mutants": tested,
        "killed": killed,
        "survived": int(stats.get("survived", 0)),
        "no_tests": int(stats.get("no_tests", 0)),
        "score": round(100 * killed / tested, 1) if tested else 0.0,
        "tests": " ".join(present),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="dotted module names (default: every core one)")
    parser.add_argument("--list", action="store_true", help="list the core modules and tests")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--survivors", type=Path, help="write each module's survivors here")
    parser.add_argument("--max-children", type=int, help="mutants tested at once (default: cores)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch copy to read survivors' diffs"
    )
    parser.add_argument(
        "--tests", nargs="+", metavar="FILE", help="run these test files instead of --list's"
    )
    parser.add_argument(
        "--only",
        type=Path,
        metavar="SURVIVORS",
        help="test only the mutants named in this file (one module's --survivors output)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for module, tests in CORE.items():
            print(f"{module}: {' '.join(tests)}")
        return 0
    unknown = [m for m in args.modules if m not in CORE]
    if unknown:
        parser.error(f"not a core module: {', '.join(unknown)} (see --list)")
    modules = args.modules or list(CORE)
    if (args.tests or args.only) and len(modules) != 1:
        parser.error("--tests and --only take exactly one module")
    only = None
    if args.only:
        only = re.findall(r"^\s*(\S+): (?:survived|no tests)", args.only.read_text(), re.M)
        if not only:
            parser.error(f"{args.only}: no survivors listed")
    results = [
        run_module(m, args.tests or CORE[m], args.survivors, args.max_children, args.keep, only)
        for m in modules
    ]
    print(f"\n{'module':32} {'mutants':>8} {'killed':>7} {'survived':>9} {'score':>6}")
    for r in results:
        print(
            f"{r['module']:32} {r['mutants']:>8} {r['killed']:>7} {r['survived']:>9} "
            f"{r['score']:>5}%"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
