"""The in-memory reference trainer: the whole model in device memory, two jitted programs a step.

It is what users run when a model fits, and the baseline the streaming engine must
equal. One step: value_and_grad over micro-batches (each block under `jax.checkpoint`),
gradient accumulation and per-part squared norms; then, if all are finite, exact
global-norm clipping and one optax update of the fp32 master parameters. The step's loss
is the mean over its counted targets (mtjax.documents: each micro-batch weighted by its
share of them; equal weights for plain batches).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax import documents, model, moe, partid, parts, precision, roles, treepath
from mtjax.documents import Inputs
from mtjax.errors import NonFiniteStep
from mtjax.loss import head_loss
from mtjax.model_config import ConfigError, ModelConfig
from mtjax.optim import OptimConfig, clip_scale, make_optimizer, sum_of_squares, tapped, tapping


def loss_terms(cfg: ModelConfig, params, tokens: jnp.ndarray, remat: bool | str = True, segments=None,
               targets=None):
    """(training loss, load-balancing loss) of fp32 master `params` on tokens [batch, seq]:
    the mean next-token loss plus router_aux_loss_coef times the load-balancing loss of
    the MoE layers over all the batch's tokens (mtjax.moe; 0 for a dense model), as
    transformers computes with output_router_logits=True. remat: model.REMAT_POLICIES;
    `segments` and `targets` as mtjax.documents.Inputs has them (None: a plain batch)."""
    x, stats = model.hidden_stats(cfg, params, tokens, remat=remat, segments=segments)
    aux = moe.aux_loss(stats, tokens.size) if stats else jnp.float32(0)
    return head_loss(cfg, params["head"], params["embed"], x, tokens, targets) + cfg.router_aux_loss_coef * aux, aux


def loss_fn(cfg: ModelConfig, params, tokens: jnp.ndarray, remat: bool | str = True, segments=None,
            targets=None) -> jnp.ndarray:
    """The training loss of `loss_terms`."""
    return loss_terms(cfg, params, tokens, remat, segments, targets)[0]


def _inputs_terms(cfg: ModelConfig, params, inputs: Inputs, remat: bool | str):
    return loss_terms(cfg, params, inputs.tokens, remat, inputs.segments, inputs.targets)


def _accumulated_grads(cfg: ModelConfig, params, inputs: Inputs, weights, remat: str = "full", whole=None):
    """Mean (loss, load-balancing loss) and gradient over micro-batches [accum, batch, seq],
    summed in fp32: each micro-batch's weighted by `weights` [accum], or all alike when the
    batch is plain. `whole(params)`: the model's parameters from the ones differentiated
    (the trained leaves, mtjax.roles), when they are not all of them."""
    if whole is not None:
        def loss_terms_of(p, tokens, remat, segments=None, targets=None):
            return loss_terms(cfg, whole(p), tokens, remat, segments, targets)
    else:
        loss_terms_of = functools.partial(loss_terms, cfg)

    if inputs.targets is None:  # plain: the mean of equal means (`weights` are all 1 / accum)
        grad_fn = jax.value_and_grad(functools.partial(loss_terms_of, remat=remat), has_aux=True)
        micro_batches = inputs.tokens
        if micro_batches.shape[0] == 1:  # no accumulator: saves three passes over every gradient
            return grad_fn(params, micro_batches[0])

        def body(carry, tokens):
            loss_sum, aux_sum, grad_sum = carry
            (loss, aux), grads = grad_fn(params, tokens)
            return (loss_sum + loss, aux_sum + aux, jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss_sum, aux_sum, grad_sum), _ = jax.lax.scan(body, (jnp.float32(0), jnp.float32(0), zeros), micro_batches)
        n = micro_batches.shape[0]
        return (loss_sum / n, aux_sum / n), jax.tree.map(lambda g: g / n, grad_sum)

    # Weighting the loss weights the gradient through the backward's first cotangent: no pass over it.
    def weighted_terms(p, mb, w):
        loss, aux = loss_terms_of(p, mb.tokens, remat, mb.segments, mb.targets)
        return w * loss, w * aux

    grad_fn = jax.value_and_grad(weighted_terms, has_aux=True)
    if inputs.tokens.shape[0] == 1:
        return grad_fn(params, inputs.micro(0), weights[0])

    def weighted(carry, xs):
        loss_sum, aux_sum, grad_sum = carry
        (loss, aux), grads = grad_fn(params, *xs)
        return (loss_sum + loss, aux_sum + aux, jax.tree.map(jnp.add, grad_sum, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss, aux, grads), _ = jax.lax.scan(weighted, (jnp.float32(0), jnp.float32(0), zeros), (inputs, weights))
    return (loss, aux), grads


@functools.partial(jax.jit, static_argnums=0)
def _eval_loss(cfg: ModelConfig, params, inputs: Inputs):
    return jnp.stack(_inputs_terms(cfg, params, inputs, remat=False))


def eval_loss(cfg: ModelConfig, params, batch, on_micro=None) -> dict[str, float]:
    """{"loss": the training objective, "aux_loss": the load-balancing loss (MoE models)}
    of `params` over the counted targets of a batch [n, batch, seq] (its n micro-batches
    weighted as a step's are), one micro-batch at a time; no update. `on_micro(terms)` is
    called with each micro-batch's (device) result as it is dispatched (progress)."""
    inputs, weights = documents.step_inputs(batch, "evaluation")
    terms = []
    for i in range(len(weights)):
        terms.append(_eval_loss(cfg, params, inputs.micro(i)))
        if on_micro is not None:
            on_micro(terms[-1])
    terms = jnp.stack(terms)
    loss, aux = (float(x) for x in jnp.sum(terms * jnp.asarray(weights, jnp.float32)[:, None], axis=0))
    return {"loss": loss, "aux_loss": aux} if cfg.moe_layers else {"loss": loss}


def _rule_inputs(cfg: ModelConfig, params, inputs: Inputs) -> dict:
    """{whole-model name of each buffer whose rule is on: its rule input} from the router
    stats of a forward over micro-batches [accum, batch, seq] (mtjax.roles)."""
    stats = [[] for _ in cfg.moe_layers]  # per MoE layer, one per micro-batch
    for m in range(inputs.tokens.shape[0]):
        segments = None if inputs.segments is None else inputs.segments[m]
        for acc, s in zip(stats, model.hidden_stats(cfg, params, inputs.tokens[m], segments=segments)[1]):
            acc.append(s)
    out = {}
    for i, layer in zip(sorted(cfg.moe_layers), stats):
        for leaf in treepath.flatten(params["blocks"][i]):
            if roles.is_buffer(leaf) and (x := roles.buffer_input(cfg, leaf, layer)) is not None:
                out[f"blocks.{i}.{leaf}"] = x
    return out


class Roles:
    """A model's parameters split by leaf role (mtjax.roles): the trained leaves, which the
    gradient and the optimizer see (`parts.trained_only`), and the others, held fixed.
    Trees keep the model's layout with the other leaves left out (None)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg, self._template = cfg, model.abstract_params(cfg)
        self._keep = set(treepath.flatten(parts.trained_only(cfg, self._template)))
        self.frozen = len(self._keep) < len(treepath.flatten(self._template))

    def trained(self, tree):
        return parts.trained_only(self.cfg, tree) if self.frozen else tree

    def fixed(self, tree):
        if not self.frozen:
            return {}
        return treepath.unflatten(self._template, {n: None if n in self._keep else a
                                                   for n, a in treepath.flatten(tree).items()})

    def merge(self, trained, fixed):
        if not self.frozen:
            return trained
        return treepath.unflatten(self._template, {**treepath.flatten(fixed), **treepath.flatten(trained)})

    def rounded(self, tree):
        """fp32 leaves as the device computes with them, in fp32: converted to their compute
        representation and back (mtjax.precision; a quantized kernel decoded)."""
        policy, by_part = precision.policy(self.cfg), {}
        for p in parts.parts(self.cfg):
            sub = parts.part_params(tree, p.name)
            by_part[p.name] = treepath.unflatten(sub, {n: policy.leaf(n, x, p.name).round_trip(x)
                                                       for n, x in treepath.flatten(sub).items()})
        return parts.whole_params(self.cfg, by_part)


class ReferenceTrainer:
    """Whole-model AdamW training.

    >>> trainer = ReferenceTrainer(cfg, params, OptimConfig(lr=1e-3))
    >>> metrics = trainer.step(tokens)  # a mtjax.batch.Batch, or int tokens [accum, batch, seq] / [batch, seq]
    >>> trainer.params                   # fp32 master parameters

    `optimizer` is an `OptimConfig` or any optax transformation (which must not clip by
    global norm itself: `clip_norm` does that, exactly as the streaming engine does).
    `remat` names what the backward keeps of each block (model.REMAT_POLICIES): "full"
    recomputes whole blocks (least memory), "dots" keeps their projection outputs (faster).
    A step whose loss or gradients are NaN/Inf changes no state and raises NonFiniteStep.
    """

    def __init__(self, cfg: ModelConfig, params, optimizer: OptimConfig | optax.GradientTransformation = OptimConfig(),
                 clip_norm: float | None = None, opt_state=None, remat: str = "full"):
        if remat not in model.REMAT_POLICIES:
            raise ConfigError(f"remat must be one of {', '.join(model.REMAT_POLICIES)}, got {remat!r}")
        self.cfg, self.remat = cfg, remat
        if isinstance(optimizer, OptimConfig):
            clip_norm = optimizer.clip_norm if clip_norm is None else clip_norm
            optimizer = make_optimizer(optimizer)
        self.tx, self.clip_norm = optimizer, clip_norm
        # A copy: the step donates its inputs, which must not delete the caller's arrays.
        self.params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
        self._roles = Roles(cfg)
        if self._roles.frozen:  # a frozen leaf is its compute copy (mtjax.roles), as the streaming engine keeps it
            self.params = self._roles.merge(self._roles.trained(self.params),
                                            self._roles.rounded(self._roles.fixed(self.params)))
        trained = self._roles.trained(self.params)
        self.opt_state = self.tx.init(trained) if opt_state is None else jax.tree.map(jnp.array, opt_state)
        # Two programs with a host check between them: the update runs only on a finite
        # step, so it needs no select over the whole state (which made XLA copy m and v).
        self._grads = jax.jit(self._grad_step, donate_argnums=(3,), keep_unused=True)
        self._update = jax.jit(self._apply, donate_argnums=(0, 1))
        # The last step's gradients, donated to the next gradient program so that XLA writes
        # into pages already mapped: fresh ones cost ~0.2 s per GiB of page faults, 3-5% of a
        # step at 119M params on 2 cores. One gradient set stays allocated between steps.
        self._spent = jax.tree.map(jnp.zeros_like, trained)
        self.steps = self.skipped = 0  # applied and skipped (non-finite) steps
        # Buffer rules (mtjax.roles): their inputs from the router stats of a forward over
        # the step's micro-batches, before the update (a third program, only when a rule is on).
        self._rules_on = any(getattr(cfg, r.rate) for r in roles.BUFFER_RULES.values())
        self._rule_inputs = jax.jit(functools.partial(_rule_inputs, cfg))

    def _grad_step(self, params, inputs, weights, spent):
        del spent  # only its buffers are wanted
        roles, fixed = self._roles, self._roles.fixed(params)
        (loss, aux), grads = _accumulated_grads(self.cfg, roles.trained(params), inputs, weights, self.remat,
                                                lambda t: roles.merge(t, fixed))
        whole = roles.merge(grads, jax.tree.map(jnp.zeros_like, fixed))  # for the per-part norms
        return (loss, aux), grads, self._part_sq(whole)

    def _part_sq(self, grads):
        """Each part's squared gradient norm, in backward order (for NonFiniteStep)."""
        return jnp.stack([sum_of_squares(parts.part_params(grads, p)) for p in self._backward_order()])

    def _backward_order(self):
        n = self.cfg.num_hidden_layers
        return [partid.HEAD, *(partid.block(i) for i in reversed(range(n))), partid.EMBED]

    def _tapped(self, grads):
        """The step's gradients through `mtjax.optim.tap_grads`'s functions, part by part,
        and their new squared norms (outside the program: only while a tap is registered)."""
        by_part = {p.name: parts.part_params(grads, p.name) for p in parts.parts(self.cfg)}
        for p in self._backward_order():
            if flat := treepath.flatten(by_part[p]):  # a part with no trained leaf has no gradient
                by_part[p] = treepath.unflatten(by_part[p], tapped(p, flat))
        grads = parts.whole_params(self.cfg, by_part)
        return grads, self._part_sq(grads)

    def _apply(self, params, opt_state, grads, sq):
        scale = clip_scale(sq, self.clip_norm)
        trained = self._roles.trained(params)
        updates, opt_state = self.tx.update(jax.tree.map(lambda g: g * scale, grads), opt_state, trained)
        return self._roles.merge(optax.apply_updates(trained, updates), self._roles.fixed(params)), opt_state

    def step(self, batch) -> dict[str, float]:
        inputs, weights = documents.step_inputs(batch)
        weights = jnp.asarray(weights, jnp.float32)
        inputs = jax.device_put(inputs)
        rule_inputs = self._rule_inputs(self.params, inputs) if self._rules_on else {}
        (loss, aux), grads, part_sq = self._grads(self.params, inputs, weights, self._spent)
        if tapping():
            grads, part_sq = self._tapped(grads)
        self._spent = grads
        part_sq = np.asarray(part_sq)  # host sync: the update may run only on a finite step
        sq = np.float32(np.sum(part_sq, dtype=np.float32))
        out = {"loss": float(loss), "grad_norm": float(np.sqrt(sq))}
        if self.cfg.moe_layers:
            out["aux_loss"] = float(aux)  # included in "loss", times router_aux_loss_coef
        if not (np.isfinite(out["loss"]) and np.isfinite(out["grad_norm"])):
            self.skipped += 1
            bad = [m for m, s in zip(self._backward_order(), part_sq) if not np.isfinite(s)]
            raise NonFiniteStep(self.skipped + self.steps, out["loss"], bad)
        self.params, self.opt_state = self._update(self.params, self.opt_state, grads, sq)
        if rule_inputs:  # the buffers' rules, on the host (as the streaming engine's update runs them)
            flat = treepath.flatten(self.params)
            flat.update({n: jnp.asarray(roles.apply_rule(self.cfg, n.split(".", 2)[2], flat[n], x))
                         for n, x in rule_inputs.items()})
            self.params = treepath.unflatten(self.params, flat)
        jax.block_until_ready(self.params)  # a returned step is a finished step (as before)
        self.steps += 1
        return out


def train(cfg: ModelConfig, params, batches, optimizer=OptimConfig()):
    """Run one reference step per batch; returns (params, opt_state, list of losses)."""
    trainer = ReferenceTrainer(cfg, params, optimizer)
    losses = [trainer.step(b)["loss"] for b in batches]
    return trainer.params, trainer.opt_state, losses
