"""A split of k equal blocks (a fused q|k|v): a rank's pieces, the boxes it streams from a
safetensors file, its checkpoint boxes, and the plan checks around it (no process group: the
placements are built by hand; the gathers run in tests/dist/test_blocked_gather.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardwise.deferred.peak import InitPeak
from shardwise.engine.pretrained import read_local
from shardwise.hf import open_weights
from shardwise.mesh import Axis
from shardwise.parallel.placement import AxisPlace, Placement, Shard
from shardwise.parallel.tensor.plan import resolve
from shardwise.parallel.tensor.validate import validate
from shardwise.zero.param_layout import ParamLayout, range_entries

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models

D, WIDTH = 4, 12  # a fused [in, 3 * out] Conv1D weight, out = 4: 2 columns per tp rank


def _qkv(rank: int, blocks: int = 3, shape=(D, WIDTH), dim: int = 1) -> Placement:
    style = Shard(dim, blocks=blocks)
    return Placement("attn.c_attn.weight", shape, (AxisPlace(Axis.TP, style, 2, rank),))


def _whole() -> torch.Tensor:
    return torch.arange(D * WIDTH, dtype=torch.float32).view(D, WIDTH)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_its_piece_of_each_block_in_block_order(rank):
    where = _qkv(rank)
    assert where.local_shape() == (D, 6)
    # q, k, v blocks of 4 columns: rank 0 holds columns 0-1 of each, rank 1 columns 2-3
    assert where.real_pieces() == [
        ((0, 0), (0, 2 * rank), (D, 2)),
        ((0, 2), (0, 4 + 2 * rank), (D, 2)),
        ((0, 4), (0, 8 + 2 * rank), (D, 2)),
    ]
    cols = [b * 4 + 2 * rank + c for b in range(3) for c in range(2)]
    torch.testing.assert_close(where.shard_of(_whole()), _whole()[:, cols], rtol=0, atol=0)
    assert where.blocked and not where.padded


def test_a_blocked_bias_and_nested_axes():
    bias = Placement("b", (12,), (AxisPlace(Axis.TP, Shard(0, blocks=3), 2, 1),))
    assert [p[1] for p in bias.real_pieces()] == [(2,), (6,), (10,)]
    # dp_shard outer, tp inner: four pieces per block of 8
    nested = Placement(
        "w",
        (24,),
        (
            AxisPlace(Axis.DP_SHARD, Shard(0, blocks=3), 2, 1),
            AxisPlace(Axis.TP, Shard(0, blocks=3), 2, 0),
        ),
    )
    assert nested.real_pieces() == [((0,), (4,), (2,)), ((2,), (12,), (2,)), ((4,), (20,), (2,))]


def test_blocks_that_do_not_split_evenly_are_refused_naming_the_parameter():
    with pytest.raises(ValueError, match=r"attn.c_attn.weight: dim 1 .* 3 blocks of 2"):
        _qkv(0, shape=(D, 9)).check()
    padded = Placement("w", (10,), (AxisPlace(Axis.TP, Shard(0, 10, blocks=3), 2, 0),))
    with pytest.raises(ValueError, match=r"^w: .*never padded"):
        padded.check()
    with pytest.raises(ValueError, match=r"^attn.c_attn.weight: .*real_pieces"):
        _qkv(0).real_box()


class _Recording:
    """A weights source that notes every box it is asked for."""

    def __init__(self, source) -> None:  # type: ignore[no-untyped-def]
        self.source, self.boxes = source, []

    def read_box(self, key, offsets, shape, dtype):  # type: ignore[no-untyped-def]
        self.boxes.append((offsets, shape))
        return self.source.read_box(key, offsets, shape, dtype)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_streams_only_its_three_pieces(tmp_path, rank):
    save_file({"w": _whole()}, str(tmp_path / "model.safetensors"))
    where = _qkv(rank)
    with open_weights(tmp_path) as source:
        rec = _Recording(source)
        got = read_local(rec, "w", where, 0, D * 6, torch.float32, InitPeak())  # type: ignore[arg-type]
        # a range starting mid-row: the boxes of that range only
        part = read_local(rec, "w", where, 3, 9, torch.float32, InitPeak())  # type: ignore[arg-type]
    torch.testing.assert_close(got.view(D, 6), where.shard_of(_whole()), rtol=0, atol=0)
    torch.testing.assert_close(part, got[3:9], rtol=0, atol=0)
    # the whole local tensor: one box per block, each D rows x 2 columns
    assert rec.boxes[:3] == [((0, b * 4 + 2 * rank), (D, 2)) for b in range(3)]
    assert sum(s[0] * s[1] for _, s in rec.boxes[:3]) == D * 6


def test_checkpoint_boxes_put_each_block_at_its_place():
    where = _qkv(1)
    layout = ParamLayout((D, 6), tuple(where.real_pieces()), (D, WIDTH))
    local = where.shard_of(_whole())
    rebuilt = torch.zeros(D, WIDTH)
    for e in range_entries("w", layout, 0, local.reshape(-1)):
        (r, c), (h, w) = e.offsets, tuple(e.tensor.shape)
        rebuilt[r : r + h, c : c + w] = e.tensor
    cols = [b * 4 + 2 + c for b in range(3) for c in range(2)]
    torch.testing.assert_close(rebuilt[:, cols], _whole()[:, cols], rtol=0, atol=0)
    assert int((rebuilt != 0).sum()) == int((_whole()[:, cols] != 0).sum())


def test_gpt2_heads_that_do_not_divide_by_tp_are_refused_naming_the_attention():
    from shardwise.parallel import plans

    model = hf_models.tiny_gpt2()  # 4 heads
    styles = resolve(model, plans.gpt2.tp_plan())
    with pytest.raises(ValueError, match=r"^module 'transformer.h.0.attn': num_heads=4 .* tp=3"):
        validate(model, styles, 3, False, {})
    validate(model, styles, 2, False, {})
    with pytest.raises(ValueError, match=r"^parameter 'transformer.wpe.weight' is replicated"):
        validate(model, styles, 2, True, {})


def test_lora_on_gpt2s_fused_c_attn_under_tp_is_refused_naming_the_layer():
    """Adapters on the fused q|k|v projection cannot follow its blocked split: one line naming
    the layer and what to do; LoRA on the MLP's Conv1D layers is carried."""
    import peft

    from shardwise.parallel import plans
    from shardwise.parallel.tensor.adapters import split_off_adapters

    def lora(targets: list[str]) -> torch.nn.Module:
        cfg = peft.LoraConfig(r=2, target_modules=targets, fan_in_fan_out=True)
        return peft.get_peft_model(hf_models.tiny_gpt2(), cfg).base_model.model  # the plan's names

    model = lora(["c_attn", "c_fc"])
    styles = resolve(model, plans.gpt2.tp_plan())
    refusal = (
        r"^module 'transformer\.h\.0\.attn\.c_attn' carries LoRA adapters, but its "
        r"tensor-parallel style 'colwise_qkv' cannot split them.*"
        r"leave 'c_attn' out of the LoRA targets, or use tp 1$"
    )
    with pytest.raises(ValueError, match=refusal):
        split_off_adapters(dict(model.named_modules()), styles)
    model = lora(["c_fc"])
    styles = resolve(model, plans.gpt2.tp_plan())
    _, carried = split_off_adapters(dict(model.named_modules()), styles)
    assert sorted(carried) == [f"transformer.h.{i}.mlp.c_fc" for i in range(2)]  # 2 layers
