"""One rank of ``finetune_vs_trainer.py``: the same fine-tuning problem trained by shardwise
(its fine-tuning pieces, as ``shardwise finetune`` composes them) or by the Hugging Face
``Trainer`` (over DDP, or over DeepSpeed through accelerate), recording what the benchmark
compares.

    python benchmarks/finetune_ranks.py SPEC.json   # RANK, WORLD_SIZE, MASTER_* set

Every system sees the same examples in the same places: at step ``s`` rank ``r`` trains on
examples ``(s * world + r) * micro ...`` + ``micro - 1`` of the prepared data, which is the order
the ``Trainer`` takes with a sequential sampler (accelerate hands batch ``i`` to rank
``i % world``). A step's time is the wall clock between the ends of consecutive optimizer
steps on this rank (the whole loop: batch, forward, backward, step, the loop's own work).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from zero_step_time import deepspeed_state_bytes, torch_state_bytes

SEED = 0


class Record:
    """Step ends, losses and the model state of one rank."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.marks: list[dict[str, float]] = [{}]
        self.losses: list[float] = []
        self.state: dict[str, int] = {}
        self.load_peak_mib = 0.0
        self.start_s = 0.0

    def mark(self, phase: str) -> None:
        """This step's ``phase`` starts now: ``compute`` (forward), ``opt`` (optimizer step)."""
        self.marks[-1][phase] = time.perf_counter()
        if phase == "compute" and not self.ends:
            self.load_peak_mib = peak_rss_mib()  # loading and set-up, before the first forward

    def end_step(self) -> None:
        if not self.ends:
            self.start_s = process_age_s()
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.marks.append({})
        if self.spec.get("profile") == "steps":
            self._profile_steps()

    def _profile_steps(self) -> None:
        """torch.profiler over the timed steps: the ops by self CPU time."""
        from torch.profiler import ProfilerActivity, profile

        if len(self.ends) == self.spec["warmup"]:
            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.__enter__()
        elif len(self.ends) == self.spec["warmup"] + self.spec["steps"]:
            self.profiler.__exit__(None, None, None)
            self.profile = self.profiler.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50
            )

    def _phases(self, w: int) -> dict[str, list[float]]:
        """Per timed step: ``data`` (from the previous step's end to the forward: the batch and
        the loop's own work), ``fwd_bwd``, ``opt`` (to the step's end)."""
        out: dict[str, list[float]] = {"data": [], "fwd_bwd": [], "opt": []}
        for i in range(w, len(self.ends) - 1):
            m = self.marks[i]
            out["data"].append(m["compute"] - self.ends[i - 1])
            out["fwd_bwd"].append(m["opt"] - m["compute"])
            out["opt"].append(self.ends[i] - m["opt"])
        return out

    @property
    def total_steps(self) -> int:
        """Warm-up, timed, and one more where the model state is counted (untimed)."""
        return self.spec["warmup"] + self.spec["steps"] + 1

    @property
    def last_step(self) -> bool:
        return len(self.ends) == self.total_steps - 1

    def result(self) -> dict[str, Any]:
        w = self.spec["warmup"]
        times = [b - a for a, b in zip(self.ends[w - 1 : -2], self.ends[w:-1])]
        return {
            "times": times,
            "phases": self._phases(w),
            # this process's CPU time over each timed step, all its threads (gloo's too): less
            # sensitive than the wall clock to other tenants of a shared machine
            "cpu_times": [b - a for a, b in zip(self.cpu[w - 1 : -2], self.cpu[w:-1])],
            "losses": self.losses,
            "state": self.state,
            "start_s": self.start_s,
            "threads": torch.get_num_threads(),
            "maxrss_mib": peak_rss_mib(),
            "load_peak_mib": self.load_peak_mib,
            **({"profile": self.profile} if hasattr(self, "profile") else {}),
        }


def process_age_s() -> float:
    """Seconds since this process started (the kernel's start time: imports included)."""
    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    started = int(stat[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def peak_rss_mib() -> float:
    """This process's peak resident set so far (``ru_maxrss``), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rows_of(step: int, rank: int, world: int, micro: int) -> list[int]:
    """The examples rank ``rank`` trains on at ``step`` (the sequential sampler's, sharded)."""
    first = (step * world + rank) * micro
    return list(range(first, first + micro))


def _data(spec: dict[str, Any]) -> tuple[Any, Any]:
    from shardwise.sft.model import load_tokenizer
    from shardwise.sft.pipeline import load_training_data

    tok = load_tokenizer(Path(spec["model_dir"]))
    return tok, load_training_data(spec["data"], tok, seq_len=spec["seq_len"], packing=False)


def _lora(spec: dict[str, Any]) -> Any:
    from shardwise.sft.lora import LoraSpec

    return LoraSpec.parse(spec["lora"]) if spec["lora"] else None


def run_shardwise(spec: dict[str, Any]) -> dict[str, Any]:
    """The fine-tune command's per-step path: meta build, streamed load, ``micro_losses``."""
    import shardwise
    from shardwise.sft.setup import build_finetune_model
    from shardwise.sft.step import micro_losses

    rec = Record(spec)
    world = shardwise.init("gloo")
    mesh = shardwise.Mesh(dp=-1)
    _, data = _data(spec)
    fm = build_finetune_model(Path(spec["model_dir"]), mesh, lora=_lora(spec), seed=SEED)
    params = [p for p in fm.module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.0)
    cfg = shardwise.Config(
        zero_stage=int(spec["system"][2:]),
        micro_batch_size=spec["micro"],
        wrap_policy=fm.wrap_policy,
    )
    engine = shardwise.initialize(fm.parallelized, opt, cfg, **fm.initialize_kwargs())
    dp = mesh.group(shardwise.Axis.DP)
    for step in range(rec.total_steps):
        rows = rows_of(step, world.rank, world.world_size, spec["micro"])
        batch = data.batch([[i] for i in rows])
        rec.mark("compute")
        rec.losses += micro_losses(engine, [batch], dp, fm.attn_implementation)
        if rec.last_step:
            rec.state = {k: engine.memory()[k] for k in ("params", "grads", "optimizer")}
        rec.mark("opt")
        engine.step()
        rec.end_step()
    return rec.result()


def _trainer_class(rec: Record) -> Any:
    from transformers import Trainer, TrainerCallback

    class Clock(TrainerCallback):
        """Step ends; the model state before the last optimizer step; one thread."""

        def __init__(self) -> None:
            self.trainer: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.set_num_threads(1)  # DeepSpeed's initialize may raise it
            rec.mark("compute")

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if rec.last_step:
                rec.state = model_state(self.trainer)
            rec.mark("opt")

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            rec.end_step()

    class SequentialTrainer(Trainer):
        """The ``Trainer``, in dataset order, keeping each step's loss."""

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

        def training_step(self, *a: Any, **kw: Any) -> torch.Tensor:
            loss = super().training_step(*a, **kw)
            rec.losses.append(float(loss))
            return loss

    return SequentialTrainer, Clock


def model_state(trainer: Any) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state (DeepSpeed: its flat buffers)."""
    engine = getattr(trainer, "deepspeed", None)
    if engine is not None:
        return deepspeed_state_bytes(engine, engine.optimizer)
    opt = trainer.optimizer
    return torch_state_bytes(trainer.model, getattr(opt, "optimizer", opt))


def ds_config(stage: int) -> dict[str, Any]:
    """The DeepSpeed configuration: ZeRO ``stage``, fp32, sizes from the Trainer's arguments."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def run_trainer(spec: dict[str, Any]) -> dict[str, Any]:
    """``Trainer.train`` over DDP (gloo) or DeepSpeed ZeRO (``spec["system"]`` ``ddp`` /
    ``dsN``); the model from ``from_pretrained`` (under DeepSpeed ZeRO-3: partitioned as it
    loads), LoRA through peft with the same adapters' initial values as shardwise."""
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, TrainingArguments

    from shardwise.sft.lora import apply_lora, init_adapters

    rec = Record(spec)
    system = spec["system"]
    ds = ds_config(int(system[2:])) if system.startswith("ds") else None
    tmp = tempfile.mkdtemp(prefix="ft_trainer_")
    args = TrainingArguments(  # before from_pretrained: DeepSpeed ZeRO-3 partitions the load
        output_dir=tmp,
        per_device_train_batch_size=spec["micro"],
        max_steps=rec.total_steps,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        optim="adamw_torch",
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        use_cpu=True,
        deepspeed=ds,
        seed=SEED,
    )
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    lora = _lora(spec)
    if lora is not None:
        model = apply_lora(model, lora)
        init_adapters(model, SEED)
    tok, data = _data(spec)
    dataset = [{"input_ids": e.input_ids, "labels": e.labels} for e in data.examples]
    trainer_cls, clock_cls = _trainer_class(rec)
    clock = clock_cls()
    collate = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    trainer = trainer_cls(
        model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[clock]
    )
    clock.trainer = trainer
    trainer.train()
    return rec.result()


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    run = run_shardwise if spec["system"].startswith("sw") else run_trainer
    if spec.get("profile") != "startup":
        result = run(spec)
    else:  # where the whole run's time goes, start-up included (the profiler slows it)
        prof = cProfile.Profile()
        result = prof.runcall(run, spec)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        result["profile"] = text.getvalue()
    out = Path(spec["out"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
