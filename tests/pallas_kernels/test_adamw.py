"""Fused AdamW kernel: Pallas (interpret) vs reference vs zerojax.train.optimizers vs torch.

Run: `.venv/bin/python -m pytest -q tests/pallas_kernels/test_adamw.py -p no:cacheprovider`.
Why: the kernel replaces the optimizer step of the training engine, so it must be torch's
AdamW to the bit where it can be: the reference is held bitwise to `apply_update`, both to
`torch.optim.AdamW(foreach=False)` over several scheduled steps, and the kernel to the
reference under every precision policy, plus the GPU lowering (no GPU needed) and the
shard-local wrapper on 8 devices inside jit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests import tolerances
from zerojax.pallas_kernels.adamw import (
    AdamWConfig,
    adamw_hyper,
    adamw_update,
    adamw_update_reference,
    adamw_update_sharded,
)
from zerojax.train.optimizers import (
    apply_update,
    hyper_from_torch,
    init_state,
    optimizer_spec_from_torch,
)

# Kernel (interpret) vs reference: both round the same float32 expression, which XLA may
# compile differently (x / scalar -> x * 1/scalar, FMA contraction): `step_bounds` gives each
# output's first-order rounding bound per element; an output stored in bf16 adds its rounding.
# Against torch.optim.AdamW over several steps: tolerances.LockstepBound.
U = tolerances.unit_roundoff(np.float32)


def step_bounds(
    weight,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr=1e-2,
    weight_decay=0.1,
    betas=(0.9, 0.999),
    eps=1e-8,
    decoupled_weight_decay=True,
    maximize=False,
    max_exp_avg_sq=None,
) -> dict[str, np.ndarray]:
    """Two-sided elementwise bounds on one AdamW step computed in float32 from the same inputs
    (tolerances.LockstepBound's terms at t = 1): the decayed weight 2 u |w|, the moments
    m' = lerp(m, g, 1 - b1) 3 u (b1 |m| + (1 - b1) |g|) and v' (positive terms) 4 u v', the
    denominator sqrt(v') / sqrt(bc2) + eps half v's relative error plus 3 u, the update
    step_size m' / denom the m' and denominator errors plus 2 u, the new weight u |w'|."""
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w, g, m, v = (f64(x) for x in (weight, grad, exp_avg, exp_avg_sq))
    beta1, beta2 = betas
    g = -g if maximize else g
    g_mag = np.abs(g)
    if decoupled_weight_decay:
        w_decayed, w_error = w * (1 - lr * weight_decay), 2 * U * np.abs(w)
    else:
        g = g + weight_decay * w
        g_mag = g_mag + weight_decay * np.abs(w)
        w_decayed, w_error = w, 0.0
    m_new = beta1 * m + (1 - beta1) * g
    m_error = 3 * U * (beta1 * np.abs(m) + (1 - beta1) * g_mag)
    v_new = beta2 * v + (1 - beta2) * g * g
    v_error = 4 * U * (beta2 * np.abs(v) + (1 - beta2) * g_mag**2)
    v_den = v_new if max_exp_avg_sq is None else np.maximum(f64(max_exp_avg_sq), v_new)
    denom = np.sqrt(v_den) / np.sqrt(1 - beta2**step) + eps
    step_size = lr / (1 - beta1**step)
    update = step_size * np.abs(m_new) / denom
    relative = (v_error / np.maximum(v_den, np.finfo(np.float64).tiny)) / 2 + 3 * U
    update_error = step_size * m_error / denom + update * (relative + 2 * U)
    w_new = w_decayed - step_size * m_new / denom
    bounds = {
        "weight": w_error + update_error + U * np.abs(w_new),
        "exp_avg": m_error,
        "exp_avg_sq": v_error,
        "max_exp_avg_sq": v_error,
    }
    bounds["param"] = bounds["weight"]
    return {name: 2 * bound for name, bound in bounds.items()}


# Interpret mode runs the kernel on CPU: small blocks keep grids at 1-8 programs.
SMALL = AdamWConfig(block_size=256)
# (weight, grad, moments, param_dtype): fp32 everything; fp32 master + bf16 param copy;
# bf16 moments; pure bf16 (no master copy).
POLICIES = {
    "fp32": (jnp.float32, jnp.float32, jnp.float32, None),
    "fp32_master_bf16_param": (jnp.float32, jnp.bfloat16, jnp.float32, jnp.bfloat16),
    "bf16_moments": (jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    "pure_bf16": (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, None),
}
ADAM_CASES = {
    "adamw": {"cls": torch.optim.AdamW, "kw": {"lr": 1e-2, "weight_decay": 0.1}},
    "adamw_amsgrad_maximize": {
        "cls": torch.optim.AdamW,
        "kw": {
            "lr": 1e-2,
            "betas": (0.8, 0.99),
            "weight_decay": 0.1,
            "amsgrad": True,
            "maximize": True,
        },
    },
    "adam_l2": {"cls": torch.optim.Adam, "kw": {"lr": 3e-3, "weight_decay": 0.05}},
}


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def random_operands(seed, shape, weight_dtype, grad_dtype, moment_dtype):
    """Unit-scale weights and grads, moments as after a few steps (never zeros).

    One normal draw sliced four ways, with the "rbg" generator: threefry takes seconds to
    compile on CPU.
    """
    w, g, m, v = jax.random.normal(jax.random.key(seed, impl="rbg"), (4, *shape))
    return (
        w.astype(weight_dtype),
        g.astype(grad_dtype),
        (0.1 * m).astype(moment_dtype),
        (0.01 * (v * v + 0.1)).astype(moment_dtype),
    )


def hyper_at(step: int, lr: float = 1e-2) -> dict:
    return adamw_hyper(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=step)


def assert_close(actual, expected, bound, err_msg=""):
    """|actual - expected| <= bound (step_bounds), plus, for an output stored in a narrower
    dtype, each side's rounding to it (u_low |value| twice)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype, err_msg)
    e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    if expected.dtype != jnp.float32:
        bound = bound + 2 * tolerances.unit_roundoff(expected.dtype) * (np.abs(e) + bound)
    tolerances.assert_within(
        torch.tensor(np.asarray(jnp.asarray(actual, jnp.float32))),
        torch.tensor(e),
        torch.tensor(bound),
        err_msg,
    )


def jitted(implementation, **static):
    interpret = implementation == "pallas"
    return jax.jit(
        functools.partial(
            adamw_update,
            implementation=implementation,
            interpret=interpret,
            block_config=SMALL,
            **static,
        )
    )


reference = jax.jit(
    adamw_update_reference,
    static_argnames=("param_dtype", "maximize", "decoupled_weight_decay"),
)


class TestAdamW:
    """Every implementation against the reference, and the reference against torch."""

    @pytest.mark.parametrize("case", sorted(ADAM_CASES))
    def test_reference_is_bitwise_optimizers_apply_update(self, case):
        cls, kw = ADAM_CASES[case]["cls"], ADAM_CASES[case]["kw"]
        param = torch.nn.Parameter(torch.randn(33, 31))
        opt = cls([param], **kw)
        spec = optimizer_spec_from_torch(opt, {id(param): "p"})
        params = {"p": jnp.array(param.detach().numpy())}
        state = init_state(spec, params)
        amsgrad = spec.groups[0].amsgrad
        mine = (params["p"], state["exp_avg"]["p"], state["exp_avg_sq"]["p"])
        mine_max = state["max_exp_avg_sq"]["p"] if amsgrad else None
        update = jax.jit(apply_update, static_argnums=0)
        for step in range(1, 5):
            grads = {"p": jnp.asarray(torch.randn(33, 31).numpy())}
            hyper = hyper_from_torch(opt, spec)
            one_group = {k: v[0] for k, v in hyper.items()} | {"step": np.int32(step)}
            params, state = update(spec, params, grads, state, hyper)
            out = reference(
                mine[0],
                grads["p"],
                *mine[1:],
                one_group,
                max_exp_avg_sq=mine_max,
                maximize=spec.groups[0].maximize,
                decoupled_weight_decay=spec.groups[0].decoupled_weight_decay,
            )
            expected = (params["p"], state["exp_avg"]["p"], state["exp_avg_sq"]["p"])
            for name, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), out, expected):
                np.testing.assert_array_equal(a, b, err_msg=f"step {step} {name}")
            if amsgrad:
                np.testing.assert_array_equal(out[4], state["max_exp_avg_sq"]["p"])
            mine, mine_max = out[:3], out[4] if amsgrad else None
            for group in opt.param_groups:  # a schedule: lr changes every step
                group["lr"] *= 0.7

    @pytest.mark.parametrize("implementation", ["xla", "pallas"])
    def test_matches_torch_adamw_over_scheduled_steps_without_recompiling(self, implementation):
        param = torch.nn.Parameter(torch.randn(1000))
        opt = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1, foreach=False)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        spec = optimizer_spec_from_torch(opt, {id(param): "p"})
        weight = jnp.array(param.detach().numpy())
        exp_avg, exp_avg_sq = jnp.zeros_like(weight), jnp.zeros_like(weight)
        update = jitted(implementation)
        bound = tolerances.LockstepBound()
        for step in range(1, 6):
            grad = torch.randn(1000)
            hyper = {k: v[0] for k, v in hyper_from_torch(opt, spec).items()}
            weight, exp_avg, exp_avg_sq, none = update(
                weight, jnp.asarray(grad.numpy()), exp_avg, exp_avg_sq, hyper | {"step": step}
            )
            param.grad = grad
            bound.observe(opt)
            opt.step()
            scheduler.step()
            assert none is None
            limits = bound.params({"p": param})["p"]
            got = torch.tensor(np.asarray(weight))
            tolerances.assert_within(got, param.detach(), limits, f"step {step}")
            torch_state = opt.state[param]
            for key, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                limit = bound.states({"p": param}, key)["p"]
                got = torch.tensor(np.asarray(value))
                tolerances.assert_within(got, torch_state[key], limit, f"step {step} {key}")
        assert update._cache_size() == 1, "a new lr or step must not recompile"

    @pytest.mark.parametrize(
        "policy, shape",
        [
            ("fp32", (1000,)),
            ("fp32", (7, 13)),
            ("fp32_master_bf16_param", (4, 16, 8)),
            ("bf16_moments", (7, 13)),
            ("pure_bf16", (1000,)),
        ],
        ids=str,
    )
    def test_kernel_matches_reference(self, policy, shape):
        weight_dtype, grad_dtype, moment_dtype, param_dtype = POLICIES[policy]
        seed = sorted(POLICIES).index(policy) * 10 + len(shape)
        operands = random_operands(seed, shape, weight_dtype, grad_dtype, moment_dtype)
        hyper = hyper_at(step=seed % 7 + 1)
        expected = reference(*operands, hyper, param_dtype=param_dtype)
        actual = jitted("pallas", param_dtype=param_dtype)(*operands, hyper)
        bounds = step_bounds(*operands, step=seed % 7 + 1)
        for name, a, b in zip(("weight", "exp_avg", "exp_avg_sq", "param"), actual, expected):
            if b is None:
                assert a is None, name
                continue
            assert a.shape == shape, name
            assert_close(a, b, bounds[name], err_msg=name)
        xla = jitted("xla", param_dtype=param_dtype)(*operands, hyper)
        for a, b in zip(xla, expected):
            assert (a is None and b is None) or np.array_equal(a, b)

    @pytest.mark.parametrize(
        "options",
        [{"maximize": True, "amsgrad": True}, {"decoupled_weight_decay": False}],
        ids=["amsgrad_maximize", "adam_l2"],
    )
    def test_kernel_options_match_reference(self, options):
        options = dict(options)
        amsgrad = options.pop("amsgrad", False)
        weight, grad, exp_avg, exp_avg_sq = random_operands(5, (999,), *(jnp.float32,) * 3)
        max_exp_avg_sq = exp_avg_sq * 1.5 if amsgrad else None
        hyper = hyper_at(step=4)
        expected = reference(
            weight, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq=max_exp_avg_sq, **options
        )
        actual = jax.jit(
            functools.partial(adamw_update, interpret=True, block_config=SMALL, **options)
        )(weight, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq=max_exp_avg_sq)
        assert len(actual) == len(expected) == (5 if amsgrad else 4)
        bounds = step_bounds(
            weight, grad, exp_avg, exp_avg_sq, step=4, max_exp_avg_sq=max_exp_avg_sq, **options
        )
        names = ("weight", "exp_avg", "exp_avg_sq", "param", "max_exp_avg_sq")
        for a, b, name in zip(actual, expected, names):
            if b is not None:
                assert_close(a, b, bounds[name], err_msg=name)

    @pytest.mark.parametrize("amsgrad", [False, True])
    def test_lowers_for_cuda_with_aliasing(self, amsgrad):
        """No GPU needed: catches illegal blocks, unsupported primitives and the inline PTX."""
        weight = jnp.zeros((1000, 3))  # ragged: 3000 is not a multiple of the block
        grad = jnp.zeros((1000, 3), jnp.bfloat16)

        def step(weight, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq):
            return adamw_update(
                weight,
                grad,
                exp_avg,
                exp_avg_sq,
                hyper,
                param_dtype=jnp.bfloat16,
                implementation="pallas",
                max_exp_avg_sq=max_exp_avg_sq,
                decoupled_weight_decay=not amsgrad,
            )

        lowered = (
            jax.jit(step, donate_argnums=(0, 2, 3, 5))
            .trace(weight, grad, weight, weight, hyper_at(1), weight if amsgrad else None)
            .lower(lowering_platforms=("cuda",))
        )
        text = lowered.as_text()
        assert text.count("xla.gpu.triton") == 1
        assert text.count("output_operand_alias<") == (4 if amsgrad else 3)
        assert "grid_x = 3" in text  # cdiv(3000, 1024)

    @pytest.mark.multidevice
    @pytest.mark.parametrize(
        "implementation, amsgrad", [("xla", True), ("pallas", False)], ids=["xla_amsgrad", "pallas"]
    )
    def test_sharded_update_on_8_devices_inside_jit(self, implementation, amsgrad):
        mesh = jax.make_mesh(
            (4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2
        )
        shapes = {"w": (64, 12), "b": (24,), "t": (8, 32)}
        specs = {"w": P("fsdp"), "b": P(), "t": P(None, "tensor")}
        trees = {"weights": {}, "grads": {}, "exp_avgs": {}, "exp_avg_sqs": {}}
        for seed, (name, shape) in enumerate(sorted(shapes.items())):
            operands = random_operands(seed, shape, jnp.float32, jnp.bfloat16, jnp.bfloat16)
            for tree, x in zip(trees.values(), operands):
                tree[name] = jax.device_put(x, NamedSharding(mesh, specs[name]))
        if amsgrad:
            trees["max_exp_avg_sqs"] = {n: 2 * v for n, v in trees["exp_avg_sqs"].items()}
        update = jax.jit(
            functools.partial(
                adamw_update_sharded,
                mesh=mesh,
                specs=specs,
                param_dtype=jnp.bfloat16,
                implementation=implementation,
                interpret=implementation == "pallas",
                block_config=AdamWConfig(block_size=64),
            ),
            donate_argnums=(0, 2, 3),
        )
        inputs = tuple(dict(v) for v in trees.values())  # a tuple: jit sorts dict keys
        expected = jax.jit(
            lambda inputs, hyper: {
                n: reference(
                    *(t[n] for t in inputs[:4]),
                    hyper,
                    param_dtype=jnp.bfloat16,
                    max_exp_avg_sq=inputs[4][n] if amsgrad else None,
                )
                for n in shapes
            }
        )(inputs, hyper_at(3))
        maybe_max = {"max_exp_avg_sqs": inputs[4]} if amsgrad else {}
        all_bounds = {  # before the update donates (deletes) its inputs
            name: step_bounds(
                *(t[name] for t in inputs[:4]),
                step=3,
                max_exp_avg_sq=inputs[4][name] if amsgrad else None,
            )
            for name in shapes
        }
        outs = update(*inputs[:4], hyper_at(3), **maybe_max)
        assert len(outs) == (5 if amsgrad else 4)
        names = ("weight", "exp_avg", "exp_avg_sq", "param", "max_exp_avg_sq")
        for name in shapes:
            bounds = all_bounds[name]
            for i, out in enumerate(outs):
                assert out[name].sharding.spec == specs[name], (name, i)
                assert_close(
                    out[name], expected[name][i], bounds[names[i]], err_msg=f"{name} output {i}"
                )
        # The next step (new lr and step, the donated outputs fed back) reuses the executable.
        maybe_max = {"max_exp_avg_sqs": outs[4]} if amsgrad else {}
        update(outs[0], inputs[1], *outs[1:3], hyper_at(4, lr=5e-3), **maybe_max)
        assert update._cache_size() == 1

    def test_sharded_lowers_for_cuda(self):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        specs = {"w": P("data"), "b": P()}
        w = {"w": jnp.zeros((64, 4)), "b": jnp.zeros((5,))}
        update = jax.jit(
            functools.partial(adamw_update_sharded, mesh=mesh, specs=specs, implementation="pallas")
        )
        text = update.trace(w, w, w, w, hyper_at(1)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 2


class TestAdamWErrors:
    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"block_size": 1000}, r"self.block_size=1000 must be a power of two >= 16"),
            ({"block_size": 8}, r"self.block_size=8 must be a power of two"),
            ({"num_warps": 3}, r"self.num_warps=3 must be a power of two in \[1, 32\]"),
            ({"num_stages": 0}, r"self.num_stages=0 must be >= 1"),
        ],
    )
    def test_bad_config(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            AdamWConfig(**kwargs)

    def test_bad_arguments(self):
        w = jnp.ones((4, 4))
        with pytest.raises(ValueError, match=r"implementation='triton' must be one of"):
            adamw_update(w, w, w, w, hyper_at(1), implementation="triton")
        with pytest.raises(ValueError, match=r"interpret=True .* needs implementation='pallas'"):
            adamw_update(w, w, w, w, hyper_at(1), implementation="xla", interpret=True)
        with pytest.raises(ValueError, match=r"exp_avg.shape=\(16,\) must equal weight.shape"):
            adamw_update(w, w, w.reshape(-1), w, hyper_at(1))
        with pytest.raises(ValueError, match=r"grad must be a real floating array"):
            adamw_update(w, w.astype(jnp.int32), w, w, hyper_at(1))
        hyper = hyper_at(1)
        del hyper["step"]
        with pytest.raises(ValueError, match=r"hyper lacks \['step'\]"):
            adamw_update(w, w, w, w, hyper)
        with pytest.raises(ValueError, match=r"hyper\['lr'\] must be a scalar"):
            adamw_update(w, w, w, w, hyper_at(1) | {"lr": np.ones(2, np.float32)})

    def test_bad_sharding_specs(self):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        w = {"w": jnp.ones((12, 4))}

        def run(specs):
            adamw_update_sharded(w, w, w, w, hyper_at(1), mesh=mesh, specs=specs)

        with pytest.raises(ValueError, match=r"only in specs: \['v'\]"):
            run({"w": P(), "v": P()})
        with pytest.raises(ValueError, match=r"dim 0 of shape=\(12, 4\) must be a multiple of 8"):
            run({"w": P("data")})
        with pytest.raises(ValueError, match=r"names mesh axis 'fsdp'"):
            run({"w": P(None, "fsdp")})
