"""What a step's bytes are counted from: the token shape of one optimizer step
(`StepShape`) and each part's state (`StateBytes`: compute, master and optimizer bytes
and its gradient's), derived from the parts' abstract schemas (mtjax.parts) with nothing
allocated. mtjax.stream.schedule counts a step's traffic from these, and
mtjax.stream.memory_plan its host-memory and device bytes.
"""

from __future__ import annotations

import dataclasses

from mtjax import expert_groups, partid, parts
from mtjax.model_config import ModelConfig
from mtjax.partid import PartId


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The token shape of one optimizer step (from DataConfig, or a token array's shape)."""

    batch: int  # sequences per micro-batch
    seq: int  # tokens per sequence
    accum: int = 1  # micro-batches per step
    documents: bool = False  # micro-batches carry document ids and counted targets (chat data)

    @classmethod
    def of(cls, data) -> StepShape:
        """The shape a `mtjax.config.DataConfig` asks for (validated there)."""
        return cls(data.batch_size, data.seq_len, data.grad_accum, documents=data.format != "text")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq * self.accum


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of one part's (or all parts') three kinds of state, and of its gradient: a
    view of its leaves by role (mtjax.parts.Leaf): frozen leaves count in `compute` only."""

    compute: int
    master: int
    opt: int
    trained: int | None = None  # the trained leaves' compute bytes (a gradient as computed); None: all of `compute`

    def __post_init__(self):
        if self.trained is None:
            object.__setattr__(self, "trained", self.compute)

    def get(self, kind: str) -> int:
        return getattr(self, kind)


def part_bytes(cfg: ModelConfig, tx) -> dict[PartId, StateBytes]:
    """{part: bytes of its compute, master and opt state and of its trained leaves'
    compute weights}, from `parts.schema`."""
    by_kind: dict = {}
    out = {}
    for p in parts.parts(cfg):
        # Parts of one fn_kind (layer spec) and roles have one layout: derive its schema once.
        key = p.fn_kind, parts.trained(cfg, p.name)
        if key not in by_kind:
            compute = parts.schema(cfg, p.name, "compute")
            by_kind[key] = StateBytes(*(parts.nbytes(parts.schema(cfg, p.name, k, tx)) for k in parts.KINDS),
                                      trained=parts.nbytes({n: compute[n] for n in key[1]}))
        out[p.name] = by_kind[key]
    return out


def sub_part_bytes(cfg: ModelConfig, tx, split: dict) -> dict[PartId, StateBytes]:
    """{sub-part: StateBytes} of the split blocks (leaves of the block's schemas; a frozen
    leaf's (mtjax.roles) in compute only)."""
    out = {}
    for i, grps in split.items():
        block = partid.block(i)
        schemas = {k: parts.schema(cfg, block, k, tx) for k in ("compute", "master")}
        trained = set(parts.trained(cfg, block))
        for name in expert_groups.names(block, grps):
            mine = expert_groups.leaves(schemas["compute"], name, grps)
            c, m = (parts.nbytes({n: schemas[k][n] for n in mine if n in schemas[k]}) for k in ("compute", "master"))
            t = parts.nbytes({n: schemas["compute"][n] for n in mine if n in trained})
            out[name] = StateBytes(c, m, 0, t)  # no optimizer state of its own: the update is the whole part's
    return out


def adapters_view(b: StateBytes) -> StateBytes:
    """What a part whose adapters are resident streams and keeps on the host in a step:
    its frozen leaves' compute copy, nothing else."""
    return StateBytes(b.compute - b.trained, 0, 0, 0)


def committed(b: StateBytes, kind: str) -> int:
    """Bytes of one kind of a resident part's state (of StateBytes `b`) that a commit
    brings to the host: of the compute copy, the trained leaves' (frozen ones never change)."""
    return b.trained if kind == "compute" else b.get(kind)
