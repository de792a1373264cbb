"""torch.optim parity for zerojax.train.optimizers.

Run: `.venv/bin/python -m pytest -q tests/train/test_optimizers.py -p no:cacheprovider`.
Why: `optimizer.step()` in a zerojax loop runs `apply_update` instead of torch's kernels; these
tests hold it to torch's numbers (20 steps, fresh random gradients each step, two param
groups) for every supported option, with schedulers, state_dict round trips and ZeRO sharding,
within the float32 rounding bound that `LockstepBound` accumulates step by step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests import tolerances
from zerojax.train.optimizers import (
    apply_update,
    for_hyper,
    hyper_from_torch,
    init_state,
    load_state_dict_into_jax,
    optimizer_spec_from_torch,
    state_dict_from_jax,
)

SHAPES = {"w": (64, 16), "w2": (7, 5), "b": (16,)}  # 7x5: not a multiple of the SIMD width
LockstepBound = tolerances.LockstepBound

update = jax.jit(apply_update, static_argnums=0)


def make_params() -> dict[str, torch.nn.Parameter]:
    return {n: torch.nn.Parameter(torch.randn(s)) for n, s in SHAPES.items()}


def two_groups(params, **no_decay):
    """Weights in group 0 (optimizer defaults), the bias in a no-decay group with its own lr."""
    return [
        {"params": [params["w"], params["w2"]]},
        {"params": [params["b"], *no_decay.pop("extra", [])], "weight_decay": 0.0, **no_decay},
    ]


def to_jax(params: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
    # Copy: jnp.asarray may alias the numpy buffer on CPU, and torch updates params in place.
    return {n: jnp.array(p.detach().numpy(), copy=True) for n, p in params.items()}


def names_of(params) -> dict[int, str]:
    return {id(p): n for n, p in params.items()}


def step_both(opt, params, spec, jparams, jstate, bound: LockstepBound, scheduler=None):
    """One step with the same fresh gradients in torch (p.grad = g) and in JAX."""
    grads = {}
    for n, p in params.items():
        g = torch.randn_like(p)
        p.grad = g.clone()
        grads[n] = jnp.asarray(g.numpy())
    bound.observe(opt)
    opt.step()
    jparams, jstate = update(spec, jparams, grads, jstate, hyper_from_torch(opt, spec))
    if scheduler is not None:
        scheduler.step()
    return jparams, jstate


def assert_within(got, expected, bound, what: str) -> None:
    tolerances.assert_within(torch.tensor(np.asarray(got)), expected.detach(), bound, what)


def assert_params_equal(jparams, params, bound: LockstepBound):
    bounds = bound.params(params)
    for n, p in params.items():
        assert_within(jparams[n], p, bounds.get(n, 0.0), n)


CASES = {
    "adamw": lambda g, **kw: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, **kw),
    "adamw_amsgrad_maximize": lambda g, **kw: torch.optim.AdamW(
        g, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True, maximize=True, **kw
    ),
    "adam_l2": lambda g, **kw: torch.optim.Adam(g, lr=3e-3, weight_decay=0.05, **kw),
    "adam_beta1_zero_amsgrad": lambda g, **kw: torch.optim.Adam(
        g, lr=1e-2, betas=(0.0, 0.9999), eps=1e-6, amsgrad=True, **kw
    ),
    "sgd": lambda g, **kw: torch.optim.SGD(g, lr=0.1, **kw),
    "sgd_weight_decay_maximize": lambda g, **kw: torch.optim.SGD(
        g, lr=0.1, weight_decay=0.01, maximize=True, **kw
    ),
    "sgd_momentum": lambda g, **kw: torch.optim.SGD(g, lr=0.1, momentum=0.9, **kw),
    "sgd_momentum_dampening": lambda g, **kw: torch.optim.SGD(
        g, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01, **kw
    ),
    "sgd_nesterov": lambda g, **kw: torch.optim.SGD(
        g, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01, maximize=True, **kw
    ),
}


@pytest.mark.parametrize("foreach", [False, True], ids=["single_tensor", "foreach"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_twenty_steps_match_torch(case, foreach):
    params = make_params()
    opt = CASES[case](two_groups(params, lr=0.05), foreach=foreach)
    spec = optimizer_spec_from_torch(opt, names_of(params))
    jparams = to_jax(params)
    jstate = init_state(spec, jparams)
    bound = LockstepBound()
    for _ in range(20):
        jparams, jstate = step_both(opt, params, spec, jparams, jstate, bound)
    assert_params_equal(jparams, params, bound)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"):
        state_bounds = bound.states(params, key)
        for n, p in params.items():
            if opt.state[p].get(key) is not None:
                assert_within(jstate[key][n], opt.state[p][key], state_bounds[n], f"{key} {n}")
    assert [np.asarray(s).tolist() for s in jstate["step"]] == [[20, 20], [20]]


@pytest.mark.parametrize(
    "make_optimizer, make_scheduler",
    [
        (
            lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1),
            lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        ),
        (
            lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9),
            lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        ),
        (  # OneCycleLR also cycles beta1 / momentum every step.
            lambda g: torch.optim.Adam(g, lr=1e-2),
            lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.02], total_steps=25),
        ),
        (
            lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True),
            lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=25),
        ),
    ],
    ids=["adamw_lambda", "sgd_step", "adam_onecycle", "sgd_nesterov_onecycle"],
)
def test_scheduler_changes_hyperparameters_without_recompiling(make_optimizer, make_scheduler):
    params = make_params()
    opt = make_optimizer(two_groups(params))
    scheduler = make_scheduler(opt)
    spec = optimizer_spec_from_torch(opt, names_of(params))
    jparams = to_jax(params)
    jstate = init_state(spec, jparams)
    traces = []

    def counted_update(*args):
        traces.append(1)  # runs only while tracing, i.e. once per compilation
        return apply_update(*args)

    jitted = jax.jit(counted_update, static_argnums=0)
    bound = LockstepBound()
    for _ in range(20):
        grads = {}
        for n, p in params.items():
            p.grad = torch.randn_like(p)
            grads[n] = jnp.asarray(p.grad.numpy())
        bound.observe(opt)
        opt.step()
        jparams, jstate = jitted(spec, jparams, grads, jstate, hyper_from_torch(opt, spec))
        scheduler.step()
    assert_params_equal(jparams, params, bound)
    assert len(traces) == 1


def test_spec_is_static_and_hashable_across_lr_changes():
    params = make_params()
    opt = torch.optim.AdamW(two_groups(params), lr=1e-3)
    spec_a = optimizer_spec_from_torch(opt, names_of(params))
    opt.param_groups[0]["lr"] = 0.5
    spec_b = optimizer_spec_from_torch(opt, names_of(params))
    assert spec_a == spec_b and hash(spec_a) == hash(spec_b)
    assert spec_a.groups[1].param_names == ("b",)
    assert spec_a.param_names == ("w", "w2", "b")


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0),
    ],
    ids=["sgd_momentum", "adam", "adamw"],
)
def test_zero_weight_decay_is_skipped_as_torch_skips_it_and_can_be_switched_on(make):
    """torch skips the decay when weight_decay == 0, so a parameter holding inf keeps finite
    gradients (`g + 0 * inf` would be NaN); the update must too. A decay switched on later
    (a schedule starting at 0) selects the decaying update from that step's hyperparameters."""
    params = make_params()
    with torch.no_grad():
        params["w"][3, 5] = float("inf")
    opt = make(list(params.values()))
    spec = optimizer_spec_from_torch(opt, names_of(params))
    jparams, jstate = to_jax(params), init_state(spec, to_jax(params))
    for step in range(4):
        if step == 2:
            opt.param_groups[0]["weight_decay"] = 0.05
        grads = {}
        for n, p in params.items():
            g = torch.randn_like(p)
            p.grad = g.clone()
            grads[n] = jnp.asarray(g.numpy())
        opt.step()
        hyper = hyper_from_torch(opt, spec)
        step_spec = for_hyper(spec, hyper)
        assert step_spec.groups[0].has_weight_decay == (step >= 2)
        jparams, jstate = update(step_spec, jparams, grads, jstate, hyper)
        for n, p in params.items():
            got, expected = np.asarray(jparams[n]), p.detach().numpy()
            # The same non-finite values (inf stays inf without decay, where `0 * inf` would
            # make it NaN; once the decay is on, torch's NaNs too) ...
            finite = np.isfinite(expected)
            np.testing.assert_array_equal(got[~finite], expected[~finite], err_msg=n)
            # ... and the finite values within Adam's documented 1-ulp-per-step differences
            # (SGD is bit-exact: module docstring of zerojax.train.optimizers).
            np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-6, atol=1e-7)


class _MyAdam(torch.optim.Adam):
    pass


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda ps: torch.optim.RMSprop(ps),
            r"torch\.optim\.RMSprop is not supported.*torch\.optim\.AdamW, .*SGD",
        ),
        (lambda ps: _MyAdam(ps), r"_MyAdam is not supported.*subclasses a supported optimizer"),
        (
            lambda ps: torch.optim.Adam(ps, differentiable=True),
            r"param group 0: differentiable=True is not supported",
        ),
        (
            lambda ps: torch.optim.AdamW(ps, capturable=True),
            r"param group 0: capturable=True is not supported",
        ),
    ],
    ids=["rmsprop", "subclass", "differentiable", "capturable"],
)
def test_unsupported_optimizer_or_option_is_named(make, match):
    params = make_params()
    with pytest.raises(ValueError, match=match):
        optimizer_spec_from_torch(make(list(params.values())), names_of(params))


def test_unsupported_group_option_names_group_index_and_value():
    params = make_params()
    opt = torch.optim.SGD([params["w"]], lr=0.1, momentum=0.9, nesterov=True)
    # torch checks nesterov only in the constructor, not in add_param_group.
    opt.add_param_group({"params": [params["b"]], "dampening": 0.5})
    with pytest.raises(ValueError, match=r"param group 1: nesterov=True .*dampening=0\.5"):
        optimizer_spec_from_torch(opt, names_of(params))


def test_unnamed_parameter_and_changed_static_option_are_errors():
    params = make_params()
    opt = torch.optim.Adam(list(params.values()))
    with pytest.raises(ValueError, match=r"param group 0, parameter 2 \(shape \(16,\)"):
        optimizer_spec_from_torch(opt, {id(params["w"]): "w", id(params["w2"]): "w2"})
    spec = optimizer_spec_from_torch(opt, names_of(params))
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"param group 0: amsgrad changed from False to True"):
        hyper_from_torch(opt, spec)


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, amsgrad=True),
        lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, dampening=0.1),
    ],
    ids=["adamw_amsgrad", "sgd_momentum"],
)
def test_state_dict_round_trip_through_torch(make):
    """JAX -> torch: a fresh torch optimizer loads ours and both continue in lockstep; then
    torch -> JAX the same way."""
    params = make_params()
    opt = make(two_groups(params, lr=0.05))
    spec = optimizer_spec_from_torch(opt, names_of(params))
    jparams = to_jax(params)
    jstate = init_state(spec, jparams)
    for _ in range(5):
        grads = {n: jnp.asarray(torch.randn(s).numpy()) for n, s in SHAPES.items()}
        jparams, jstate = update(spec, jparams, grads, jstate, hyper_from_torch(opt, spec))

    exported = state_dict_from_jax(spec, jstate, opt.param_groups)
    reference = opt.state_dict()  # the shape torch itself produces (no state yet)
    assert [g["params"] for g in exported["param_groups"]] == [[0, 1], [2]]
    assert exported["param_groups"][1]["lr"] == 0.05
    assert set(exported["param_groups"][0]) == set(reference["param_groups"][0])

    fresh = {n: torch.nn.Parameter(torch.from_numpy(np.asarray(jparams[n]).copy())) for n in SHAPES}
    torch_opt = make(two_groups(fresh, lr=0.05))
    torch_opt.load_state_dict(exported)
    # Both continue from the same (copied) state: the bound starts at zero here.
    bound = LockstepBound()
    for _ in range(5):
        jparams, jstate = step_both(torch_opt, fresh, spec, jparams, jstate, bound)
    assert_params_equal(jparams, fresh, bound)

    # torch -> JAX: load torch's own state_dict and keep going.
    spec2 = optimizer_spec_from_torch(torch_opt, names_of(fresh))
    jstate2 = load_state_dict_into_jax(spec2, torch_opt.state_dict(), jparams)
    # torch's SGD keeps no step count; ours only needs "has stepped" for the buffer's first step.
    expected = [[10, 10], [10]] if spec.family == "adam" else [[1, 1], [1]]
    assert [np.asarray(s).tolist() for s in jstate2["step"]] == expected
    for _ in range(5):
        jparams, jstate2 = step_both(torch_opt, fresh, spec2, jparams, jstate2, bound)
    assert_params_equal(jparams, fresh, bound)
    # The state after 10 lockstep steps: the bound's state terms grow with the step count t
    # from 5 (the handoff) on, so they cover these 10 steps' too.
    again = state_dict_from_jax(spec2, jstate2, torch_opt.param_groups)
    params_by_index = [p for group in torch_opt.param_groups for p in group["params"]]
    for index, entry in torch_opt.state_dict()["state"].items():
        assert again["state"][index].keys() == entry.keys()
        state = bound.state.get(id(params_by_index[index]), {})
        for key, value in entry.items():
            limit = 2 * state[key] if key in state else 0.0
            tolerances.assert_within(again["state"][index][key], value, limit, f"{index} {key}")


def test_load_keeps_per_parameter_steps_and_rejects_mismatched_groups():
    params = make_params()
    opt = torch.optim.Adam(two_groups(params))
    spec = optimizer_spec_from_torch(opt, names_of(params))
    params["w"].grad = torch.randn(SHAPES["w"])
    opt.step()  # only w stepped: group 0 now has steps {1, 0}, as torch keeps them
    state = load_state_dict_into_jax(spec, opt.state_dict(), to_jax(params))
    assert [np.asarray(s).tolist() for s in state["step"]] == [[1, 0], [0]]
    assert sorted(state_dict_from_jax(spec, state)["state"]) == sorted(opt.state_dict()["state"])
    other = torch.optim.Adam(list(params.values()))
    with pytest.raises(ValueError, match=r"do not match the optimizer's \(sizes \[2, 1\]\)"):
        load_state_dict_into_jax(spec, other.state_dict(), to_jax(params))


def test_frozen_parameter_is_neither_updated_nor_given_state():
    params = make_params()
    params["w2"].requires_grad_(False)
    opt = torch.optim.AdamW(two_groups(params), lr=1e-2)
    spec = optimizer_spec_from_torch(opt, names_of(params))
    assert spec.groups[0].frozen_names == ("w2",)
    jparams = to_jax(params)
    jstate = init_state(spec, jparams)
    assert "w2" not in jstate["exp_avg"]
    trainable = {n: p for n, p in params.items() if n != "w2"}
    bound = LockstepBound()
    for _ in range(3):
        grads = {}
        for n, p in trainable.items():
            p.grad = torch.randn_like(p)
            grads[n] = jnp.asarray(p.grad.numpy())
        bound.observe(opt)
        opt.step()
        jparams, jstate = update(spec, jparams, grads, jstate, hyper_from_torch(opt, spec))
    assert_params_equal(jparams, params, bound)  # w2: no bound, so exactly unchanged
    assert 1 not in state_dict_from_jax(spec, jstate)["state"]  # w2 is index 1


def test_bfloat16_moments_with_float32_master_weights():
    params = make_params()
    opt = torch.optim.AdamW(two_groups(params), lr=1e-2)
    spec = optimizer_spec_from_torch(opt, names_of(params))
    jparams = to_jax(params)
    state = init_state(spec, jparams, state_dtype=jnp.bfloat16)
    state_fp32 = init_state(spec, jparams)
    params_fp32 = jparams
    # torch's optimizer is only the bound's bookkeeper here (same gradients, its own steps).
    bound = LockstepBound(state_dtype=torch.bfloat16)
    for _ in range(10):
        grads = {n: jnp.asarray(torch.randn(s).numpy()) for n, s in SHAPES.items()}
        hyper = hyper_from_torch(opt, spec)
        for n, p in params.items():
            p.grad = torch.from_numpy(np.asarray(grads[n]).copy())
        bound.observe(opt)
        opt.step()
        jparams, state = update(spec, jparams, grads, state, hyper)
        params_fp32, state_fp32 = update(spec, params_fp32, grads, state_fp32, hyper)
    assert state["exp_avg"]["w"].dtype == jnp.bfloat16 and jparams["w"].dtype == jnp.float32
    # bf16 moments: one bf16 rounding of m and v per step (LockstepBound's state_dtype terms).
    assert_within(
        jparams["w"], torch.tensor(np.asarray(params_fp32["w"])), bound.params(params)["w"], "w"
    )
    exported = state_dict_from_jax(spec, state)
    assert exported["state"][0]["exp_avg"].dtype == torch.bfloat16
    reloaded = load_state_dict_into_jax(spec, exported, jparams, state_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(reloaded["exp_avg"]["w"], state["exp_avg"]["w"])


@pytest.mark.multidevice
@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, amsgrad=True),
        lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "sgd"],
)
def test_zero_sharded_update_stays_sharded_and_matches_unsharded(make):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    params = make_params()
    opt = make(two_groups(params))
    spec = optimizer_spec_from_torch(opt, names_of(params))

    def place(tree):
        # ZeRO: the (64, 16) weight and everything shaped like it split over "data" on dim 0.
        return {n: jax.device_put(x, sharded if n == "w" else replicated) for n, x in tree.items()}

    plain_params = to_jax(params)
    plain_state = init_state(spec, plain_params)
    zero_params = place(plain_params)
    zero_state = init_state(spec, zero_params)
    for key in zero_state:
        if key != "step":
            assert zero_state[key]["w"].sharding == sharded
    for _ in range(5):
        grads = {n: jnp.asarray(torch.randn(s).numpy()) for n, s in SHAPES.items()}
        hyper = hyper_from_torch(opt, spec)
        zero_params, zero_state = update(spec, zero_params, place(grads), zero_state, hyper)
        plain_params, plain_state = update(spec, plain_params, grads, plain_state, hyper)
    assert zero_params["w"].sharding == sharded
    assert zero_params["w"].addressable_shards[0].data.shape == (8, 16)
    for key in zero_state:
        if key != "step":
            assert zero_state[key]["w"].sharding == sharded
    for n in SHAPES:
        np.testing.assert_array_equal(np.asarray(zero_params[n]), np.asarray(plain_params[n]))
