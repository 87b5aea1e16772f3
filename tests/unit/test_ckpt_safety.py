"""Loading is as safe as the files: no unpickling, no file outside the checkpoint directory, and
damaged or lost pieces handled (set aside, journal rebuilt). Each attack is re-sealed the way
anyone who can write the files can: manifest sizes and sha256 recomputed, the journal's commit
record rewritten with the new manifest checksum."""

from __future__ import annotations

import ast
import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise import comm
from shardwise.checkpoint import (
    CheckpointError,
    CheckpointReader,
    ShardEntry,
    find_latest_valid,
    inspect,
    rebuild_journal,
    resolve,
    save_checkpoint,
    set_aside,
    verify,
    verify_cli,
)
from shardwise.checkpoint.journal import Journal, encode_record
from shardwise.checkpoint.layout import JOURNAL_NAME, MANIFEST_NAME, step_dir_name
from shardwise.models import GPT, GPTConfig

SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1" / "checkpoints"
CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8, bias=False)
SHARD = "shard-00000-of-00001.safetensors"


class _Plant:
    """Unpickling this creates the file ``path``: proof that code from a checkpoint ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reseal(step_dir: Path, edit: object = None) -> None:
    """Recompute every listed file's size and sha256 (after ``edit(doc)`` changed the
    manifest), write the manifest, and give the journal a commit record with its checksum."""
    doc = json.loads((step_dir / MANIFEST_NAME).read_text())
    if callable(edit):
        edit(doc)
    for name, record in doc["files"].items():
        path = step_dir / name
        if path.is_file() and not path.is_symlink():
            record["size"], record["sha256"] = path.stat().st_size, _sha(path.read_bytes())
    data = (json.dumps(doc, indent=1) + "\n").encode()
    (step_dir / MANIFEST_NAME).write_bytes(data)
    step = int(step_dir.name.removeprefix("step-"))
    journal = step_dir.parent / JOURNAL_NAME
    lines = [ln for ln in journal.read_bytes().splitlines(keepends=True) if b'"commit"' not in ln]
    lines.append(encode_record("commit", step, manifest_sha256=_sha(data)))
    journal.write_bytes(b"".join(lines))


def _save(root: Path, step: int) -> Path:
    t = torch.arange(12.0).reshape(3, 4) + step
    return save_checkpoint(
        root, step, [ShardEntry("model/w", (3, 4), (0, 0), t)], {}, {"s": step}, group=comm.world()
    )


def _engine(**config: object) -> shardwise.Engine:
    torch.manual_seed(0)
    model = GPT(CFG)
    return shardwise.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), shardwise.Config(seed=3, **config)
    )


# ---- nothing on the load path unpickles ----


def test_no_module_on_the_load_path_can_unpickle() -> None:
    modules = [*sorted((SRC / "checkpoint").glob("*.py"))]
    modules += [SRC / "engine" / f for f in ("checkpoint.py", "run_state.py", "weights.py")]
    modules += [SRC / "zero" / "checkpoint_entries.py"]
    for path in modules:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("pickle", "dill") for n in names), path
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "load":
                kwargs = {k.arg: k.value for k in node.keywords}
                if getattr(node.func.value, "id", "") == "torch":
                    weights_only = kwargs.get("weights_only")
                    assert isinstance(weights_only, ast.Constant) and weights_only.value, path


def test_resealed_malicious_pickle_in_a_format_1_checkpoint_never_runs(
    tmp_path: Path, world_of_one: None
) -> None:
    root = tmp_path / "v1"
    shutil.copytree(FIXTURE, root)
    planted = tmp_path / "code-ran"
    step_dir = root / step_dir_name(2)
    (step_dir / "rank-00000.pkl").write_bytes(pickle.dumps(_Plant(planted)))
    _reseal(step_dir)
    assert verify(root).step == 2  # re-sealed: every checksum matches
    engine = _engine()
    engine.load(root)
    assert engine.global_step == 2
    with CheckpointReader(root) as reader, pytest.raises(CheckpointError, match="never loaded"):
        reader.rank_state(0)
    assert not planted.exists()


def test_resealed_pickle_as_a_format_2_rank_state_is_refused(
    tmp_path: Path, world_of_one: None
) -> None:
    engine = _engine()
    good = engine.save(tmp_path / "ck")
    engine.global_step = 3
    bad = engine.save(tmp_path / "ck")
    planted = tmp_path / "code-ran"
    (bad / "rank-00000.safetensors").write_bytes(pickle.dumps(_Plant(planted)))
    _reseal(bad)
    other = _engine()
    with pytest.raises(CheckpointError, match="not a readable rank state"):
        other.load(bad)
    resumed = _engine(checkpoint_dir=str(tmp_path / "ck"), resume="auto")
    with pytest.raises(CheckpointError, match="not a readable rank state"):
        resumed.resume()
    assert not planted.exists()
    assert good.is_dir()


# ---- manifest file names stay inside the checkpoint directory ----


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/x", ".."])
def test_file_names_outside_the_checkpoint_are_refused_everywhere(
    tmp_path: Path, name: str
) -> None:
    root = tmp_path / "ck"
    step_dir = _save(root, 1)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(step_dir / SHARD, outside)

    def rename(doc: dict) -> None:
        doc["files"][name] = doc["files"].pop(SHARD)
        for t in doc["tensors"]:
            for p in t["pieces"]:
                p["file"] = name

    _reseal(step_dir, rename)
    for check in (verify, CheckpointReader, find_latest_valid):
        if check is find_latest_valid:
            assert find_latest_valid(root)[0] is None
            continue
        with pytest.raises(CheckpointError, match="not a plain file name"):
            check(root)
    ok, message = verify_cli(root)
    assert not ok and "not a plain file name" in message
    assert "unreadable" in inspect(root)
    if name != "/etc/passwd":  # the command line once is enough (each start costs seconds)
        return
    for args in (
        ["verify", str(root)],
        ["inspect", str(root)],
        ["export", str(root), str(tmp_path / "m.safetensors")],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "shardwise.cli.main", "checkpoint", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr
    assert not (tmp_path / "m.safetensors").exists()


def test_a_link_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    step_dir = _save(tmp_path / "ck", 1)
    outside = tmp_path / "outside.safetensors"
    shutil.move(step_dir / SHARD, outside)
    (step_dir / SHARD).symlink_to(outside)
    with pytest.raises(CheckpointError, match="link to a file outside"):
        verify(step_dir)
    with pytest.raises(CheckpointError, match="link to a file outside"):
        CheckpointReader(step_dir, verify=False).read_full("model/w")


# ---- damaged steps set aside, lost journals rebuilt, steps retired ----


def test_set_aside_keeps_the_files_and_frees_the_step(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for step in (1, 2):
        _save(root, step)
    kept = set_aside(root, 2, "it does not verify")
    assert kept == root / "damaged-step-00000002" and (kept / SHARD).is_file()
    assert "it does not verify" in (kept / "SET_ASIDE.txt").read_text()
    assert resolve(root) == root / step_dir_name(1)
    with pytest.raises(CheckpointError, match="set aside as damaged"):
        verify(root / step_dir_name(2))
    _save(root, 2)  # the step can be saved again
    assert Journal(root).read().live_steps() == [1, 2]
    assert set_aside(root, 2, "again") == root / "damaged-step-00000002-1"


def test_rebuild_journal_from_manifests_leaves_out_damaged_steps(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(root, step)
    data = bytearray((root / step_dir_name(3) / SHARD).read_bytes())
    data[-1] ^= 0xFF
    (root / step_dir_name(3) / SHARD).write_bytes(bytes(data))
    (root / JOURNAL_NAME).unlink()
    assert rebuild_journal(root) == [1, 2]
    assert Journal(root).read().live_steps() == [1, 2]
    assert verify(root).step == 2
    with pytest.raises(ValueError, match="exists"):
        rebuild_journal(root)


def test_cli_retire_sets_aside_or_deletes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(root, step)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shardwise.cli.main", "checkpoint", "retire", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = cli(str(root), "3")
    assert out.returncode == 0, out.stderr
    assert "damaged-step-00000003" in out.stdout and (root / "damaged-step-00000003").is_dir()
    out = cli(str(root), "1", "--delete")
    assert out.returncode == 0 and not (root / step_dir_name(1)).exists()
    assert Journal(root).read().live_steps() == [2]
    out = cli(str(root), "7")
    assert out.returncode == 1 and "step 7" in out.stderr and "Traceback" not in out.stderr
