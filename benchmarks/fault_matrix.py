"""The fault matrix: every launcher, run-directory and command-line fault case, run for real, as
one table (case, outcome, seconds).

Each case is a test that starts real ``shardwise`` processes and kills, signals or feeds them bad
input, then asserts the outcome (no orphan process, no lost metrics, the exit code and message);
this script runs them through pytest and tabulates the results.

    PYTHONPATH=src python benchmarks/fault_matrix.py [--out benchmarks/results/fault_matrix.txt]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from provenance import source_version

ROOT = Path(__file__).resolve().parents[1]

CASES: dict[str, tuple[str, str]] = {
    # test module::name (or its start, or a whole module) -> (issue item, what is done)
    "test_launcher_faults::test_kill_9_of_the_launcher_takes_its_ranks_along": (
        "1",
        "kill -9 the launcher of `run`, 2 ranks",
    ),
    "test_launcher_faults::test_kill_9_of_one_node_ends_both_nodes": (
        "1",
        "kill -9 node 0's launcher, 2 nodes",
    ),
    "test_train_faults::test_killed_launcher_leaves_no_rank_and_its_lock_refuses_then_yields": (
        "1,2",
        "second train on a live run dir; kill -9; resume",
    ),
    "test_run_lock": ("2", "run-dir lock: holder named, stale taken over"),
    "test_train_faults::test_a_killed_rank_restarts": (
        "3",
        "kill -9 a rank, --max-restarts 1",
    ),
    "test_elastic": ("3", "`run` script: rank SIGKILLed, restart resumes"),
    "test_launcher_faults::test_ctrl_c_on_run_exits_130": ("4", "Ctrl-C on `run`"),
    "test_launcher_faults::test_sigint_to_one_rank_exits_130": ("4", "SIGINT to one rank of `run`"),
    "test_launcher_faults::test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period": (
        "4",
        "SIGHUP, a rank ignoring SIGTERM, grace 2 s",
    ),
    "test_train_faults::test_sigterm_saves_and_says_so": (
        "4,17",
        "SIGTERM to train; damaged final model in generate",
    ),
    "test_train_faults::test_sighup_without_grace_kills_and_says_no_checkpoint": (
        "4",
        "SIGHUP to train, --grace-period-s 0",
    ),
    "test_train_faults::test_sigint_to_one_rank": ("4", "SIGINT to one rank of train"),
    "test_train_e2e::test_ctrl_c_stops_every_rank_then_resume_continues": (
        "4",
        "Ctrl-C on train, then resume",
    ),
    "test_launcher_faults::test_a_missing_node_is_reported_while_waiting_then_times_out": (
        "5",
        "--nnodes 2 with node 1 missing",
    ),
    "test_launcher_faults::test_a_rendezvous_port_held_by_another_program_is_refused": (
        "5",
        "rdzv port held by another program",
    ),
    "test_launcher_faults::test_an_unwaited_async_save_is_finished_at_the_end": (
        "6",
        "async save never waited for",
    ),
    "test_launcher_faults::test_an_unwaited_save_that_outlasts_the_exit_wait_is_abandoned": (
        "6",
        "async save outlasting the exit wait: abandoned",
    ),
    "test_ckpt_rundir::test_moved_and_copied_run_dirs_use_only_their_own_checkpoints": (
        "7",
        "moved and copied run dirs",
    ),
    "test_ckpt_resume::test_damaged_step_is_set_aside_and_training_continues_past_it": (
        "8",
        "damaged newest step set aside, training goes on",
    ),
    "test_ckpt_rundir::test_lost_journal_crashed_resume_metrics_cut_and_summary": (
        "9",
        "lost journal, crashed resume, metrics cut, summary",
    ),
    "test_ckpt_safety": ("10,11", "no unpickling, names inside the checkpoint, retire, journal"),
    "test_engine_access::test_full_parameters_through_gathered_parameters": (
        "12",
        "reading ZeRO-3 parameters; initialize twice",
    ),
    "test_engine_access::test_ranks_with_different_models_are_refused": (
        "13",
        "ranks building different models",
    ),
    "test_engine_access::test_nonfinite_gradients": ("15", "non-finite gradients skip or raise"),
    "test_config_types": ("14", "Config types and ranges, Python and files"),
    "test_cli_errors": ("16,17", "bad corpora, config, run dir, sizes"),
    "test_launcher_faults::test_script_options_reach_the_script": (
        "17",
        "script's own --max / --d, and --",
    ),
}

FILES = [
    "tests/dist/test_launcher_faults.py",
    "tests/dist/test_train_faults.py",
    "tests/dist/test_elastic.py",
    "tests/unit/test_run_lock.py",
    "tests/unit/test_config_types.py",
    "tests/unit/test_cli_errors.py",
    "tests/unit/test_ckpt_safety.py",
    "tests/dist/test_ckpt_rundir.py",
    "tests/dist/test_ckpt_resume.py::test_damaged_step_is_set_aside_and_training_continues_past_it",
    "tests/dist/test_engine_access.py::test_full_parameters_through_gathered_parameters",
    "tests/dist/test_engine_access.py::test_ranks_with_different_models_are_refused_naming_the_difference",
    "tests/dist/test_engine_access.py::test_nonfinite_gradients_skip_the_step_with_a_warning",
    "tests/dist/test_engine_access.py::test_nonfinite_gradients_raise_when_configured",
    "tests/dist/test_train_e2e.py::test_ctrl_c_stops_every_rank_then_resume_continues",
]


def _case_of(classname: str, name: str) -> tuple[str, str, str]:
    module = classname.rsplit(".", 1)[-1]
    base = name.split("[", 1)[0]
    param = name[len(base) :]
    for key, (item, what) in CASES.items():
        if f"{module}::{base}".startswith(key) and "::" in key:
            return item, what + (f" {param}" if param else ""), key
    if module in CASES:
        return CASES[module][0], CASES[module][1], module
    return "?", f"{module}::{name}", module


def _outcome(case: ET.Element) -> str:
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            return f"FAILED: {(found.get('message') or '').splitlines()[0][:80]}"
    skipped = case.find("skipped")
    if skipped is not None:
        return f"skipped: {(skipped.get('message') or '')[:60]}"
    return "ok"


def run(timeout_s: float) -> tuple[list[tuple[str, str, str, float]], float]:
    """Run every case; returns rows (item, case, outcome, seconds) grouped by case, and the
    total wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "faults.xml"
        t0 = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={xml}",
                f"--timeout={int(timeout_s)}",
                *FILES,
            ],
            cwd=ROOT,
            check=False,
        )
        wall = time.monotonic() - t0
        tree = ET.parse(xml)
    grouped: dict[str, list[tuple[str, str, str, float]]] = {}
    for case in tree.iter("testcase"):
        item, what, key = _case_of(case.get("classname", ""), case.get("name", ""))
        if key in ("test_run_lock", "test_config_types", "test_cli_errors", "test_ckpt_safety"):
            what = CASES[key][1]  # unit modules: one row each
        grouped.setdefault(what, []).append(
            (item, what, _outcome(case), float(case.get("time", 0.0)))
        )
    rows = []
    for what, cases in grouped.items():
        bad = [c[2] for c in cases if c[2] != "ok"]
        outcome = bad[0] if bad else "ok" + (f" ({len(cases)} tests)" if len(cases) > 1 else "")
        rows.append((cases[0][0], what, outcome, sum(c[3] for c in cases)))
    return sorted(rows, key=lambda r: [int(x) for x in r[0].split(",") if x.isdigit()]), wall


def table(rows: list[tuple[str, str, str, float]], wall: float) -> str:
    head = ("item", "case", "outcome", "time")
    body = [(r[0], r[1], r[2], f"{r[3]:.1f} s") for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(4)]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [head, *body]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    ok = sum(r[2].startswith("ok") for r in rows)
    lines.append(f"\n{ok} of {len(rows)} cases ok; wall time {wall:.0f} s; code {source_version()}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="also write the table here")
    p.add_argument("--timeout", type=float, default=600, help="per test, seconds (default 600)")
    args = p.parse_args()
    rows, wall = run(args.timeout)
    text = table(rows, wall)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(r[2].startswith(("ok", "skipped")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
