"""Does a traced program treat each parameter leaf elementwise and on its own?

The optimizer stage runs the update on cache-sized row chunks of each leaf (see
mtjax.stream.update). That gives the whole-leaf result only when every output element
depends on the same element of its own leaf's inputs, plus scalars (step count,
learning rate, clip scale). AdamW, Adam, SGD with momentum, Lion and the like are;
anything with a norm, a factored moment, noise or a reshape is not. This is decided on
the traced program (its jaxpr), not assumed from the transformation's name:

- every value carries the set of leaves it was computed from (scalars carry none);
- an equation that reads leaf data must be elementwise: its array operands have the
  output's shape, or it broadcasts a rank-0 value; calls (jit, custom_jvp) are followed;
- no equation combines data of two leaves, and arrays that carry no leaf may come only
  from broadcasting scalars (no iota, no captured constant arrays: they depend on the
  position in the array).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Primitives computing each output element from the same element of every operand.
ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "convert_element_type", "copy", "copy_p",
    "cos", "div", "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite",
    "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or",
    "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sqrt", "square",
    "stop_gradient", "sub", "tan", "tanh", "xor",
})

NONE: frozenset = frozenset()


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


# Equations that run their body once on their own operands (loops and scans do not).
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                   "custom_vjp_call_jaxpr", "checkpoint", "remat"})


def _call_body(eqn) -> ClosedJaxpr | Jaxpr | None:
    """The body of a call-like equation (jit, custom_jvp_call) whose inputs and outputs
    are the equation's own; None for control flow and plain primitives."""
    if eqn.primitive.name not in CALLS:
        return None
    bodies = [v for v in eqn.params.values() if isinstance(v, (ClosedJaxpr, Jaxpr))]
    if len(bodies) != 1:
        return None
    body = bodies[0].jaxpr if isinstance(bodies[0], ClosedJaxpr) else bodies[0]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    return bodies[0]


def _flow(body: ClosedJaxpr | Jaxpr, labels: Sequence[frozenset]) -> list[frozenset] | None:
    """The leaves each output of `body` is computed from; None when not leafwise."""
    jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr) else (body, ())
    if any(getattr(c, "ndim", 0) for c in consts) or any(_shape(v) for v in jaxpr.constvars):
        return None  # a captured array may depend on the position of an element
    env = dict(zip(jaxpr.invars, labels))
    env.update((v, NONE) for v in jaxpr.constvars)
    read = lambda v: NONE if isinstance(v, Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        carried = NONE.union(*ins)
        if len(carried) > 1:
            return None  # mixes two leaves
        called = _call_body(eqn)
        if called is not None:
            outs = _flow(called, ins)
            if outs is None:
                return None
        else:
            out_shapes = {_shape(v) for v in eqn.outvars}
            name = eqn.primitive.name
            if name in ELEMENTWISE and len(out_shapes) == 1:
                (shape,) = out_shapes
                ok = all(_shape(v) in ((), shape) for v in eqn.invars)
            elif name == "broadcast_in_dim":
                ok = _shape(eqn.invars[0]) == ()
            else:
                ok = not carried and out_shapes <= {()}  # scalar bookkeeping (schedules, counts)
            if not ok:
                return None
            outs = [carried] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def leafwise(fn: Callable, args: tuple, in_labels: tuple, out_labels) -> bool:
    """Whether `fn(*args)` (abstract args) is elementwise per leaf.

    `in_labels` has the structure of `args` and `out_labels` that of the result, with a
    string at each leaf: the parameter leaf it belongs to, or "" for shared scalars.
    Every output must be computed only from inputs of its own leaf (and unlabeled
    scalars).
    """
    closed = jax.make_jaxpr(fn)(*args)
    labels = [frozenset([x]) if x else NONE for x in jax.tree.leaves(in_labels)]
    if len(labels) != len(closed.jaxpr.invars):
        return False
    outs = _flow(closed, labels)
    want = jax.tree.leaves(out_labels)
    if outs is None or len(outs) != len(want):
        return False
    return all(got <= ({w} if w else NONE) for got, w in zip(outs, want))
