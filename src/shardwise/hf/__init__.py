"""Hugging Face weights in and out, one rank's share at a time; no process group needed.

Reading (each rank reads only the bytes it keeps)::

    from shardwise import hf

    spec = hf.model_spec(meta_model)              # the model's own state_dict names/shapes
    with hf.open_weights("path/to/model_dir") as source:   # headers + index checked here
        mapping = hf.map_names(spec, source, strict=True)  # raises naming every bad key
        for name, stored in mapping.source_of.items():
            rows = source.read_box(stored, (lo, 0), (hi - lo, cols), torch.float32)  # tp slice
            flat = source.read_flat(stored, start, stop, torch.float32)  # ZeRO flat shard
    source.bytes_read                             # bytes taken from the files

Writing (one tensor at a time; every rank can walk the same plan and join each gather)::

    tensors = [hf.TensorSpec(n, shape, dtype) for ...]   # tied duplicates left out
    plan = hf.plan_shards(tensors, "5GB")                # same split as save_pretrained
    hf.write_model_dir(out, tensors, produce, "5GB", config=model.config,
                       generation_config=model.generation_config, tokenizer_dir=src_dir)

peft LoRA: :func:`adapter_key` (saved names), :func:`write_adapter_dir`;
merging: :func:`lora_merge_plan` + :func:`merge_lora` inside a ``produce`` for
:func:`write_model_dir`.

Modules: ``errors`` (:class:`WeightsError`), ``header`` (safetensors headers checked against the
file size), ``model_dir`` (file names, index), ``source`` (reads), ``names`` (name mapping),
``shard_plan`` (files of whole tensors), ``stream_file`` (one file, tensor by tensor), ``writer``
(the directory), ``side_files`` (configs, tokenizer), ``peft_adapter`` (LoRA),
``checkpoint_source`` (a shardwise checkpoint behind the same reads: :class:`CheckpointWeights`).
"""

from shardwise.hf.checkpoint_source import CheckpointWeights
from shardwise.hf.errors import WeightsError
from shardwise.hf.header import TensorInfo, read_header
from shardwise.hf.model_dir import WeightFiles, shard_name, weight_files
from shardwise.hf.names import (
    Mismatch,
    ModelSpec,
    NameMapping,
    TensorSpec,
    WeightCatalog,
    map_names,
    model_spec,
)
from shardwise.hf.peft_adapter import (
    LoraDelta,
    adapter_key,
    check_lora_config,
    lora_merge_plan,
    merge_lora,
    merged_name,
    write_adapter_dir,
)
from shardwise.hf.shard_plan import ShardPlan, plan_shards
from shardwise.hf.source import SafetensorsSource, open_weights
from shardwise.hf.writer import index_json, write_model_dir

__all__ = [
    "CheckpointWeights",
    "LoraDelta",
    "Mismatch",
    "ModelSpec",
    "NameMapping",
    "SafetensorsSource",
    "ShardPlan",
    "TensorInfo",
    "TensorSpec",
    "WeightCatalog",
    "WeightFiles",
    "WeightsError",
    "adapter_key",
    "check_lora_config",
    "index_json",
    "lora_merge_plan",
    "map_names",
    "merge_lora",
    "merged_name",
    "model_spec",
    "open_weights",
    "plan_shards",
    "read_header",
    "shard_name",
    "weight_files",
    "write_adapter_dir",
    "write_model_dir",
]
