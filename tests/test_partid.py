"""Part ids: one name per part, fields read once, names kept byte for byte."""

import dataclasses
import json
import pickle
import types
from typing import ClassVar

import pytest

from mtjax import expert_groups, parts, partid
from mtjax.errors import NonFiniteStep
from mtjax.layers import registry
from mtjax.layers.spec import MoE
from mtjax.partid import EMBED, HEAD, ROUTER, PartId
from mtjax.stream import step_parts
from conftest import tiny_config, tiny_moe_config

NAMES = {"embed": ("embed", None, None), "head": ("head", None, None), "block.0": ("block", 0, None),
         "block.12": ("block", 12, None), "block.3/router": ("block", 3, ROUTER),
         "block.3/experts.0": ("block", 3, 0), "block.3/experts.11": ("block", 3, 11)}


@pytest.mark.parametrize("name", NAMES)
def test_a_name_reads_to_its_fields_and_back(name):
    p = PartId(name)
    assert (p.kind, p.block, p.sub) == NAMES[name]
    assert str(p) == name and p == name and hash(p) == hash(name) and {name: 1}[p] == 1
    assert json.dumps({p: [p]}) == json.dumps({name: [name]})  # manifests and traces keep their bytes
    again = pickle.loads(pickle.dumps(p))
    assert type(again) is PartId and (again.kind, again.block, again.sub) == NAMES[name]
    assert PartId(p) is p


@pytest.mark.parametrize("name", ["", "block", "block.", "block.03", "block.-1", "block.x", "blocks.1", "Embed",
                                  "embed/router", "block.1/", "block.1/experts", "block.1/experts.01",
                                  "block.1/router.0", "block.1/mlp"])
def test_a_name_of_no_part_is_refused_in_one_line(name):
    with pytest.raises(ValueError, match="no part named") as e:
        PartId(name)
    assert "\n" not in str(e.value)


def test_built_ids_equal_read_ones_and_sort_in_forward_order():
    b = partid.block(3)
    assert b.router() == PartId("block.3/router") and b.experts(2) == PartId("block.3/experts.2")
    assert b.experts(2).owner == b and b.owner is b and EMBED.owner is EMBED
    assert b.experts(2).group == 2 and b.router().group is None and b.group is None
    assert b.experts(2).in_block(7) == "block.7/experts.2" and b.router().is_sub and not b.is_sub
    assert b.is_block and b.router().is_block and not EMBED.is_block and not HEAD.is_block
    ids = [HEAD, partid.block(10), b.experts(0), b, b.router(), EMBED, partid.block(2)]
    assert sorted(ids, key=partid.forward_order) == [EMBED, partid.block(2), b, b.router(), b.experts(0),
                                                     partid.block(10), HEAD]
    with pytest.raises(AttributeError):
        b.block = 4


def test_the_package_hands_out_part_ids_under_the_old_names():
    cfg = tiny_config()
    names = [p.name for p in parts.parts(cfg)]
    assert all(type(n) is PartId for n in names)
    assert names == ["embed", *(f"block.{i}" for i in range(cfg.num_hidden_layers)), "head"]
    assert parts.fn_kind(cfg, "block.1") == cfg.layer_specs[1] and parts.fn_kind(cfg, HEAD) == "head"
    assert expert_groups.names("block.2", ((0, 1), (2, 3))) == ("block.2/router", "block.2/experts.0",
                                                                "block.2/experts.1")
    e = NonFiniteStep(5, float("nan"), [HEAD, partid.block(1), EMBED])
    assert "first block with non-finite gradients: block.1 (of head, block.1, embed)" in str(e)


@dataclasses.dataclass(frozen=True)
class WholeMoE(MoE):
    """A MoE feed-forward whose registry entry has no split point: its blocks stream whole."""

    kind: ClassVar[str] = "test_moe_whole"


def test_the_blocks_that_split_are_those_whose_feed_forward_has_the_split_point():
    """step_parts.split_blocks asks each layer's feed-forward entry (its split_points), not
    which layers a config calls MoE: a stand-in config whose moe_layers say otherwise."""
    moe = tiny_moe_config()
    moe_spec = moe.layer_specs[moe.moe_layers[0]]
    registry.register_feed_forward(WholeMoE.kind, dataclasses.replace(registry.feed_forward(moe_spec), split_points=()))
    whole = dataclasses.replace(moe_spec, feed_forward=WholeMoE())
    dense = tiny_config().layer_specs[0]
    cfg = types.SimpleNamespace(layer_specs=(dense, whole, moe_spec, moe_spec), moe_layers=(0, 1, 2),
                                num_experts=moe.num_experts)
    groups = expert_groups.groups_of(moe.num_experts, 2)
    assert step_parts.split_blocks(cfg, 2, resident=()) == {2: groups, 3: groups}
    assert step_parts.split_blocks(cfg, 2, resident=(partid.block(3),)) == {2: groups}
    assert step_parts.split_blocks(cfg, None, resident=()) == {}
