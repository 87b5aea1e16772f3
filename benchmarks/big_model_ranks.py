"""One rank of ``big_model_init.py``: a Llama started from a sharded Hugging Face directory by
one system, with this process's resident memory measured over initialize + load.

    python benchmarks/big_model_ranks.py SPEC.json   # RANK, WORLD_SIZE, MASTER_* set

The window opens after the imports and the process group (the baseline, ``VmRSS``, is read
then, and the kernel's high-water mark ``VmHWM`` is reset through ``/proc/self/clear_refs``) and
closes when the system's initialize returns: ``VmHWM`` at the close is the most this process
held resident inside the window. ``ru_maxrss`` (the lifetime peak, imports included) is kept
beside it.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

CHECKED = "model.layers.0.mlp.down_proj.weight"
"""The parameter each system gathers after the window and compares with the file."""
KiB = 1024


def status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process now, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * KiB
    return out


def maxrss() -> int:
    """This process's lifetime peak resident set (``ru_maxrss``), bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


class Window:
    """Resident memory and wall time of the block: the baseline before it, ``VmHWM`` (reset
    at its start) and ``VmRSS`` at its end."""

    def __enter__(self) -> Window:
        gc.collect()
        self.baseline = status()["VmRSS"]
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        now = status()
        self.peak, self.after, self.maxrss = now["VmHWM"], now["VmRSS"], maxrss()

    def result(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "peak": self.peak,
            "after": self.after,
            "maxrss": self.maxrss,
            "wall_s": self.wall_s,
        }


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _file_tensor(model_dir: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    with safe_open(str(Path(model_dir) / index["weight_map"][name]), "pt") as f:
        return f.get_tensor(name)


def _shardwise_formula(engine: Any) -> dict[str, int]:
    """The engine's own figures: final state per rank, the largest local tensor, its
    ``init_peak``."""
    mem = engine.memory()
    state = mem["params"] + mem["grads"] + mem["optimizer"] + mem["buffers"]
    largest = max(p.numel() * p.element_size() for p in engine.module.parameters())
    return {"state": state, "largest": largest, "init_peak": mem["init_peak"]}


def _shardwise_check(engine: Any, model_dir: str, tp: Any = None) -> bool | None:
    """Whether this rank holds ``CHECKED`` as the file has it: gathered over the ZeRO-3 group,
    or (``tp``: the tensor-parallel group) its own slice along the split dimension."""
    named = dict(engine.module.named_parameters())
    key = next((n for n in named if n.endswith(CHECKED)), None)
    if key is None:
        return None
    p = named[key]
    with engine.gathered_parameters(p):
        got = p.detach().clone()
    want = _file_tensor(model_dir, CHECKED)
    split = [d for d in range(want.dim()) if got.shape[d] != want.shape[d]]
    if tp is not None and len(split) == 1:
        want = want.chunk(tp.size, dim=split[0])[tp.rank]
    return got.shape == want.shape and torch.equal(got, want)


def run_shardwise(spec: dict[str, Any]) -> dict[str, Any]:
    """``sw3``: meta build, ZeRO-3, streamed load; ``swtp``: meta build, dp2 x tp2 with the
    Llama plan, ZeRO-1, streamed load; ``full``: today's path, ``from_pretrained`` (the whole
    model on every rank), then ZeRO-3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardwise
    from shardwise.parallel import plans
    from shardwise.parallel.parallelize import ParallelPlan

    shardwise.init("gloo")
    config = LlamaConfig.from_pretrained(spec["model_dir"])
    system, model_dir = spec["system"], spec["model_dir"]
    mesh = shardwise.Mesh(dp=2, tp=2) if system == "swtp" else None
    with Window() as win:
        if system == "full":
            model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            engine = shardwise.initialize(model, _adamw, shardwise.Config(zero_stage=3))
            del model
        else:
            with shardwise.deferred_init():
                model = LlamaForCausalLM(config)
            cfg = shardwise.Config(zero_stage=3 if system == "sw3" else 1)
            if system == "swtp":
                model = shardwise.parallelize(
                    model, mesh, ParallelPlan(tensor=plans.llama.tp_plan())
                )
            engine = shardwise.initialize(model, _adamw, cfg, weights=model_dir)
            del model
    tp = mesh.group(shardwise.Axis.TP) if system == "swtp" else None
    check = _shardwise_check(engine, model_dir, tp)
    return {**win.result(), **_shardwise_formula(engine), "check": check}


def ds_config() -> dict[str, Any]:
    """DeepSpeed ZeRO-3, fp32, the torch AdamW given to ``deepspeed.initialize``."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }


def ds_load(model: torch.nn.Module, model_dir: str) -> None:
    """DeepSpeed's recipe for pretrained weights under ``zero.Init``: each parameter gathered
    (``GatheredParameters``), rank 0 copies the file's value in, ``modifier_rank=0`` hands it
    to every rank's partition on exit. Rank 0 reads the files one tensor at a time."""
    import deepspeed
    import torch.distributed as dist
    from safetensors import safe_open

    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    named = dict(model.named_parameters())
    rank0 = dist.get_rank() == 0
    for shard in sorted(set(index["weight_map"].values())):
        names = sorted(n for n, f in index["weight_map"].items() if f == shard and n in named)
        with safe_open(str(Path(model_dir) / shard), "pt") as f:
            for name in names:
                with deepspeed.zero.GatheredParameters([named[name]], modifier_rank=0):
                    if rank0:
                        named[name].data.copy_(f.get_tensor(name))


def run_deepspeed(spec: dict[str, Any]) -> dict[str, Any]:
    """``ds3``: ``zero.Init`` build, per-parameter ``GatheredParameters`` load; ``dshf``:
    ``transformers`` ``from_pretrained`` under ``HfDeepSpeedConfig`` at ZeRO-3 (what the
    ``Trainer`` does: ``zero.Init`` build, each module's weights gathered and loaded); then
    ``deepspeed.initialize`` at ZeRO-3."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    from zero_step_time import deepspeed_state_bytes

    deepspeed.init_distributed(dist_backend="gloo")
    config = LlamaConfig.from_pretrained(spec["model_dir"])
    cfg = ds_config()
    hf_config = None
    if spec["system"] == "dshf":  # from_pretrained partitions as it loads while this lives
        from transformers.integrations import HfDeepSpeedConfig

        hf_config = HfDeepSpeedConfig(cfg)
    with Window() as win:
        if hf_config is not None:
            model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
        else:
            with deepspeed.zero.Init(config_dict_or_path=cfg):
                model = LlamaForCausalLM(config)
            ds_load(model, spec["model_dir"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    torch.set_num_threads(1)  # DeepSpeed's initialize may raise it
    state = deepspeed_state_bytes(engine, ds_opt)
    largest = max(p.ds_numel * 4 for p in engine.module.parameters())
    named = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([named[CHECKED]]):
        check = torch.equal(named[CHECKED].detach(), _file_tensor(spec["model_dir"], CHECKED))
    return {
        **win.result(),
        "state": sum(state.values()),
        "state_parts": state,
        "largest": largest,
        "check": check,
    }


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    run = run_deepspeed if spec["system"].startswith("ds") else run_shardwise
    try:
        result = run(spec)
    except Exception as exc:  # reported in the table, not hidden
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    result["threads"] = torch.get_num_threads()
    out = Path(spec["out"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
