"""Name every leaf of a pytree by its path, and rebuild the tree from named leaves.

Stores and state tiers see each part of the model (the embedding, a block, the head)
as a flat ``{name: array}`` dict. Parameter trees give names like
``self_attn.q_proj.kernel``; optax states give names like ``0.mu.mlp.up_proj.kernel``.
"""

from __future__ import annotations

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey


def _key_name(key) -> str:
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def flatten(tree) -> dict:
    """{dotted path: leaf} in the tree's canonical leaf order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def unflatten(template, named: dict):
    """A tree shaped like `template` whose leaves are taken from `named` by path."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [".".join(_key_name(k) for k in path) for path, _ in paths]
    missing = [n for n in names if n not in named]
    if missing:
        raise KeyError(f"missing leaves: {', '.join(missing[:5])}")
    return jax.tree_util.tree_unflatten(treedef, [named[n] for n in names])
