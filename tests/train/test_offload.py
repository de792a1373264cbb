"""Optimizer offload (ZeRO-Offload, issue 27): optimizer state and master weights in host memory.

Run: `.venv/bin/python -m pytest -q tests/train/test_offload.py -p no:cacheprovider`
Why: `offload: {optimizer: host, master: host}` (DeepSpeed's `offload_optimizer: {device:
cpu}`) only changes where those arrays live: on their ZeRO shardings in the `pinned_host`
memory kind. With both offloaded, the update's element-wise step computes on the host
(`compute_on("device_host")` on the host shards: the device never holds them); with the state
offloaded but masters on the device it is moved to the device and back. The arithmetic is the
non-offloaded update's, compiled by XLA:CPU either way, so on CPU an offloaded run must equal the
run without offload bit for bit (losses, parameters, optimizer state), under ZeRO-1/2/3 on 8
devices, in fp32 and with bf16 params and fp32 masters; and a checkpoint saved with one setting
resumes under the other.
"""

from __future__ import annotations

import re

import jax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from zerojax.ckpt.checkpointer import Checkpointer

pytestmark = pytest.mark.multidevice

BF16_MASTER = "params=bfloat16,compute=bfloat16,master=float32"
PURE_BF16 = "params=bfloat16,compute=bfloat16"
STEPS = 4
HOST_COMPUTE = '_xla_compute_type = "host"'


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(F.relu(self.fc1(x)))


OFFLOADS = ("optimizer", "grads", "params")
"""What each offload setting in these tests moves to the host: `optimizer` the optimizer state
and master weights; `grads` those and the gradients (DeepSpeed's offload_optimizer: cpu);
`params` everything (with offload_param: cpu, ZeRO-3 only)."""


def config_for(
    stage: int, precision: str | None, offload: str | None, mesh: dict | None = None, **train
) -> dict:
    config: dict = {"mesh": mesh or {"data": 8}, "zero_stage": stage}
    if precision is not None:
        config["precision"] = precision
    if offload is not None:
        hosted = OFFLOADS[: OFFLOADS.index(offload) + 1]
        config["offload"] = {
            "optimizer": "host",
            **({"master": "host"} if precision and "master" in precision else {}),
            **dict.fromkeys(hosted[1:], "host"),
        }
    if train:
        config["train"] = train
    return config


def make(config: dict, optimizer_for=None):
    torch.manual_seed(0)
    net = Net()
    if optimizer_for is None:
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05)
    else:
        optimizer = optimizer_for(net.parameters())
    return zerojax.initialize(net, optimizer, config=config, seed=7)


def train(model, optimizer, generator: torch.Generator, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 16, generator=generator)
        y = torch.randint(0, 8, (16,), generator=generator)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def memory_kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def assert_same_state(model_a, opt_a, model_b, opt_b) -> None:
    weights_a, weights_b = model_a.state_dict(), model_b.state_dict()
    for name, value in weights_a.items():
        assert torch.equal(value, weights_b[name]), name
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for index, entries in state_a.items():
        for key, value in entries.items():
            assert torch.equal(value, state_b[index][key]), (index, key)


SETTINGS = [(stage, offload) for stage in (1, 2, 3) for offload in ("optimizer", "grads")] + [
    (3, "params")
]


@pytest.mark.parametrize(
    "precision", [None, BF16_MASTER, PURE_BF16], ids=["fp32", "bf16-master", "pure-bf16"]
)
@pytest.mark.parametrize("stage, offload", SETTINGS, ids=[f"zero{s}-{o}" for s, o in SETTINGS])
def test_offloaded_training_is_bitwise_the_device_run(stage, offload, precision):
    model, optimizer = make(config_for(stage, precision, None))
    losses = train(model, optimizer, torch.Generator().manual_seed(5), STEPS)
    hosted_model, hosted_optimizer = make(config_for(stage, precision, offload))
    hosted_losses = train(hosted_model, hosted_optimizer, torch.Generator().manual_seed(5), STEPS)

    assert hosted_losses == losses
    assert_same_state(model, optimizer, hosted_model, hosted_optimizer)
    engine = hosted_model.engine
    assert memory_kinds(engine.opt_state) == {"pinned_host"}  # moments and step counts
    # With parameter offload the new shards stay on the host; else the update brings them back.
    params_kind = "pinned_host" if offload == "params" else "device"
    assert memory_kinds(engine.params) == {params_kind}
    if precision == BF16_MASTER:
        assert memory_kinds(engine.master) == {"pinned_host"}
    # On their ZeRO shardings, only in another memory: the same layout as without offload.
    plan, hosted_plan = model.engine.plan, engine.plan
    for name, sharding in plan.opt_state.items():
        hosted = hosted_plan.opt_state[name]
        assert hosted == sharding.with_memory_kind("pinned_host")
        moment = engine.opt_state["exp_avg"][name]
        assert moment.sharding.is_equivalent_to(hosted, moment.ndim)
        assert hosted_plan.params[name] == plan.params[name].with_memory_kind(params_kind)
    # The backward pass leaves the gradients where the setting puts them.
    x, y = torch.randn(16, 16), torch.randint(0, 8, (16,))
    F.cross_entropy(hosted_model(x), y).backward()
    grads_kind = "device" if offload == "optimizer" else "pinned_host"
    assert memory_kinds(engine.grads) == {grads_kind}
    for name, sharding in plan.grads.items():
        assert engine.grads[name].sharding.is_equivalent_to(
            sharding.with_memory_kind(grads_kind), engine.grads[name].ndim
        )
    # torch ops on a parameter read its (offloaded) master weight on the device, and on its
    # gradient read that on the device too.
    F.cross_entropy(model(x), y).backward()
    weight, hosted_weight = model.fc1.weight, hosted_model.fc1.weight
    assert torch.equal(F.linear(x, hosted_weight), F.linear(x, weight))
    assert torch.equal(hosted_weight.grad * 2, weight.grad * 2)


def host_gradient_loop(model, optimizer, generator, steps, *, clip_in_loop: bool) -> list:
    """Two micro-batches per step (the config's gradient_accumulation_steps=2), the loss
    scaled by fp16 loss scaling inside the step; `clip_in_loop`: torch's clip_grad_norm_
    before each optimizer.step(), as the HF Trainer calls it."""
    losses = []
    for _ in range(steps):
        for _ in range(2):
            x = torch.randn(16, 16, generator=generator)
            y = torch.randint(0, 8, (16,), generator=generator)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
            if clip_in_loop:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                losses.append(norm.item())
            optimizer.step()
            optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("clip_in_loop", [False, True], ids=["config-clipping", "clip_grad_norm_"])
def test_host_gradients_accumulate_clip_and_loss_scale_bitwise(clip_in_loop):
    """Gradient offload under everything that reads the gradients between backward and update:
    accumulation (added on the host), fp16 loss scaling (unscaled and checked for overflow),
    and clipping (config gradient_clipping, or torch's clip_grad_norm_ in the loop): the norm
    from device copies, the scaling on the host. Bitwise the device run, ZeRO-2."""
    fp16 = "params=float16,compute=float16,master=float32"
    train_options = {"gradient_accumulation_steps": 2}
    if not clip_in_loop:
        train_options["gradient_clipping"] = 0.05
    runs = []
    for offload in (None, "grads"):
        model, optimizer = make(config_for(2, fp16, offload, **train_options))
        generator = torch.Generator().manual_seed(5)
        runs.append(
            (
                host_gradient_loop(model, optimizer, generator, 3, clip_in_loop=clip_in_loop),
                model,
                optimizer,
            )
        )
    (losses, model, optimizer), (hosted_losses, hosted_model, hosted_optimizer) = runs
    assert hosted_losses == losses
    assert_same_state(model, optimizer, hosted_model, hosted_optimizer)
    assert hosted_optimizer.loss_scale == optimizer.loss_scale


def lowered_update(model, platform: str | None = None, name: str = "update") -> str:
    """The StableHLO of the program `name` the model last ran (for `platform`, default the
    one it ran on), lowered again from the compiled program's argument types."""
    programs = model.engine.programs._programs.values()
    program = next(p for p in programs if p.name == name and p.last is not None)
    compiled = program.last
    (args, _), (shardings, _) = compiled.args_info, compiled.input_shardings
    types = jax.tree.map(
        lambda arg, sharding: jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=sharding),
        args,
        shardings,
        is_leaf=lambda x: isinstance(x, jax.stages.ArgInfo),
    )
    traced = program._jitted.trace(*types)
    return traced.lower(lowering_platforms=(platform,) if platform else None).as_text()


def host_computations(module: str) -> list[tuple[str, list[str]]]:
    """(the call, the called function's operations but its constants, which carry no
    placement) of each host computation in the module: a call marked for the host, which XLA
    runs on the host's CPU whole (`zerojax.compat.jax_api.on_host`)."""
    found = []
    for line in module.splitlines():
        called = re.search(r"call @([\w.]+)\(", line)
        if called and HOST_COMPUTE in line:
            body = module.split(f"func.func private @{called[1]}(", 1)[1].split("\n  }", 1)[0]
            operations = [
                op
                for op in body.splitlines()[1:]
                if "stablehlo." in op and "stablehlo.constant" not in op
            ]
            found.append((line, operations))
    return found


OTHER_OPTIMIZERS = {
    "sgd-nesterov": lambda p: torch.optim.SGD(
        p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-3),
}


@pytest.mark.parametrize("optimizer", list(OTHER_OPTIMIZERS))
def test_other_optimizers_update_on_the_host_bitwise(optimizer):
    """SGD with momentum and Adam (L2 decay, amsgrad) on the host too: ZeRO-2, bf16 params
    with fp32 masters, bitwise the device run."""
    optimizer_for = OTHER_OPTIMIZERS[optimizer]
    model, opt = make(config_for(2, BF16_MASTER, None), optimizer_for)
    losses = train(model, opt, torch.Generator().manual_seed(5), STEPS)
    hosted, hosted_opt = make(config_for(2, BF16_MASTER, "grads"), optimizer_for)
    assert train(hosted, hosted_opt, torch.Generator().manual_seed(5), STEPS) == losses
    assert_same_state(model, opt, hosted, hosted_opt)
    assert HOST_COMPUTE in lowered_update(hosted)


def transfers(part: str) -> list[tuple[str, str]]:
    """(memory kind, operand type) of each in-program transfer in `part` of a module lowered
    for a GPU (on CPU `device_put` inside a program lowers to nothing)."""
    return re.findall(
        r'annotate_device_placement.*_xla_buffer_placement = "(\w+)".*: \((tensor<[^>]*>)\)', part
    )


@pytest.mark.parametrize("precision", [None, BF16_MASTER], ids=["fp32", "bf16-master"])
def test_update_computes_on_the_host(precision):
    """The element-wise step is one host computation on the host shards: one call marked for
    the host, with nothing inside it placed on the device, for this CPU and in the program
    lowered for a GPU; there the only
    arrays moved to the device are scalars and each param group's int32 vector of per-parameter
    step counts (for Adam's bias corrections) before it, and the new params (in the params'
    dtype) after it.

    What XLA:CPU cannot show: `memory_analysis()` here counts host-resident arguments in
    `argument_size_in_bytes` and reports every `host_*` figure as 0, host and device are one
    memory, and transfers inside a program compile to nothing; so the device bytes this saves
    (the whole optimizer state and masters during the update) cannot be measured on CPU. The
    compiled CPU program keeps the host mark only on scalar bitcasts (its fusions drop it), so
    the lowered program is what is checked.
    """
    model, optimizer = make(config_for(2, precision, "optimizer"))
    train(model, optimizer, torch.Generator().manual_seed(5), 1)
    for platform in (None, "cuda"):
        module = lowered_update(model, platform)
        # The optimizer step: the host computation with Adam's denominator.
        (call, operations), *_ = (
            (call, operations)
            for call, operations in host_computations(module)
            if any("stablehlo.sqrt" in op for op in operations)
        )
        # Nothing inside it is placed on the device: the whole step computes on the host.
        assert not any("annotate_device_placement" in op for op in operations), platform
    before, after = module.split(call)
    after = after.split("func.func private")[0]
    step_counts = f"tensor<{len(model.state_dict())}xi32>"  # one param group
    assert all(
        "x" not in kind or kind == step_counts
        for place, kind in transfers(before)
        if place == "device"
    )
    assert any(place == "pinned_host" for place, _ in transfers(before))  # gradients
    param_dtype = "bf16" if precision else "f32"
    back = [kind for place, kind in transfers(after) if place == "device"]
    assert len(back) == len(model.state_dict())
    assert all(kind.endswith(f"{param_dtype}>") for kind in back)


def full_types(model, dtype: str) -> list[str]:
    """The StableHLO tensor type of each parameter, global shape (programs are lowered before
    XLA partitions them), in `dtype`."""
    return sorted(f"tensor<{'x'.join(map(str, p.shape))}x{dtype}>" for p in model.parameters())


@pytest.mark.parametrize("offload", ["grads", "params"])
def test_gradients_leave_and_parameters_arrive_inside_the_programs(offload):
    """Lowered for a GPU, the backward pass ends each gradient with its own transfer to host
    memory (so XLA can start it as soon as that gradient exists, not after the last one):
    fp32 with gradient offload; with parameter offload the pullback of bringing a shard in
    moves its gradient out in the compute dtype (bf16: half the bytes), cast to fp32 on the
    host. With parameter offload the forward pass brings each parameter shard in where an
    op reads it, and the backward pass brings in again the ones it needs (each read is a
    rematerialized region: nothing brought in is kept between them)."""
    model, optimizer = make(config_for(3, BF16_MASTER, offload))
    train(model, optimizer, torch.Generator().manual_seed(5), 1)

    def placed(name, place):
        module = lowered_update(model, "cuda", name)
        return sorted(kind for where, kind in transfers(module) if where == place)

    backward_out = placed("backward", "pinned_host")
    if offload == "grads":
        assert backward_out == full_types(model, "f32")
        assert placed("forward_vjp", "device") == []
        return
    assert [k for k in backward_out if k.endswith("bf16>")] == full_types(model, "bf16")
    assert not [k for k in placed("backward", "device") if k.endswith("f32>")]
    assert placed("forward_vjp", "device") == full_types(model, "bf16")
    # Backward needs head.weight (for the hidden activations' gradient) but not fc1.weight
    # (the input needs no gradient) nor the biases.
    assert placed("backward", "device") == ["tensor<8x32xbf16>"]


def test_state_offloaded_with_masters_on_the_device_updates_on_the_device():
    """`offload: {optimizer: host}` with bf16 params and fp32 masters kept on the device: the
    step reads device masters, so the state moves to the device for it (no host compute) and
    back; still bitwise the device run."""
    config = config_for(2, BF16_MASTER, "optimizer")
    config["offload"] = {"optimizer": "host"}
    model, optimizer = make(config_for(2, BF16_MASTER, None))
    losses = train(model, optimizer, torch.Generator().manual_seed(5), STEPS)
    hosted_model, hosted_optimizer = make(config)
    hosted_losses = train(hosted_model, hosted_optimizer, torch.Generator().manual_seed(5), STEPS)
    assert hosted_losses == losses
    assert_same_state(model, optimizer, hosted_model, hosted_optimizer)
    assert memory_kinds(hosted_model.engine.opt_state) == {"pinned_host"}
    assert memory_kinds(hosted_model.engine.master) == {"device"}
    assert HOST_COMPUTE not in lowered_update(hosted_model)


def save_and_resume(save_config: dict, resume_config: dict, directory) -> list[float]:
    """Train STEPS, save; a fresh model under `resume_config` restores and trains STEPS more."""
    model, optimizer = make(save_config)
    generator = torch.Generator().manual_seed(5)
    train(model, optimizer, generator, STEPS)
    with Checkpointer(directory, model, optimizer) as checkpointer:
        assert checkpointer.save(STEPS, extra={"data_rng": generator.get_state()})
    resumed, resumed_optimizer = make(resume_config)
    with Checkpointer(directory, resumed, resumed_optimizer) as checkpointer:
        state = checkpointer.restore()
    generator.set_state(torch.tensor(state.extra["data_rng"], dtype=torch.uint8))
    engine, hosted = resumed.engine, resume_config.get("offload", {})
    assert memory_kinds(engine.opt_state) == {"pinned_host" if hosted else "device"}
    assert memory_kinds(engine.master) == {"pinned_host" if hosted else "device"}
    assert memory_kinds(engine.params) == {"pinned_host" if "params" in hosted else "device"}
    return train(resumed, resumed_optimizer, generator, STEPS)


OTHER_MESH = {"data": 2, "fsdp": 4}
RESUMES = [
    (2, None, "grads", None),
    (2, "grads", None, None),
    (3, None, "params", None),
    (3, "params", "grads", None),
    (3, "params", "params", OTHER_MESH),
]


@pytest.mark.parametrize(
    "stage, saved, resumed, mesh",
    RESUMES,
    ids=[f"zero{s}-{a}-to-{b}{'-other-mesh' if m else ''}" for s, a, b, m in RESUMES],
)
@pytest.mark.long
def test_resume_across_offload_settings(stage, saved, resumed, mesh, tmp_path):
    """bf16 params with fp32 masters: a checkpoint is the same whichever memory the state lived
    in, and restores into any other offload setting, on another mesh too (data 8 to data 2 x
    fsdp 4: other shards)."""
    model, optimizer = make(config_for(stage, BF16_MASTER, None))
    straight = train(model, optimizer, torch.Generator().manual_seed(5), 2 * STEPS)
    save = config_for(stage, BF16_MASTER, saved)
    resume = config_for(stage, BF16_MASTER, resumed, mesh=mesh)
    resumed_losses = save_and_resume(save, resume, tmp_path)
    if mesh is None:
        assert resumed_losses == straight[STEPS:]
    else:
        # Other shards reduce the gradients in another order: the resumed run differs from the
        # straight one by the fp32 rounding of those sums, carried into bf16 params (one bf16
        # ulp is 2^-8 relative) over STEPS steps.
        torch.testing.assert_close(resumed_losses, straight[STEPS:], rtol=2**-8, atol=0)


def test_optimizer_running_its_own_step_is_refused_with_gradient_offload():
    """Optimizers other than Adam/AdamW/SGD run torch's step on live tensors: their state can
    live on the host between steps (tests/train/test_live_optimizer_state.py), but gradients
    on the host are the compiled update's way of computing there."""
    torch.manual_seed(0)
    net = Net()
    with pytest.raises(ValueError, match=r"^zerojax: offload.grads=host moves state"):
        zerojax.initialize(
            net, torch.optim.RMSprop(net.parameters()), config=config_for(2, None, "grads")
        )


def test_memory_report_splits_device_and_host_bytes():
    """The planner puts offloaded state in host memory, and each program's host-placed
    arguments and outputs with it (XLA:CPU's memory_analysis() has one memory: the split is
    read off the program's shardings); the device keeps what crosses it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    args = (torch.randn(16, 64),)
    settings = [(2, None), (2, "optimizer"), (2, "grads"), (3, None), (3, "params")]
    reports = {
        (stage, offload): zerojax.memory_report(net, args, config_for(stage, BF16_MASTER, offload))
        for stage, offload in settings
    }
    hosted = {
        None: [False] * 4,
        "optimizer": [False, False, True, True],
        "grads": [False, True, True, True],
        "params": [True] * 4,
    }
    for (stage, offload), report in reports.items():
        device = reports[stage, None]
        assert [c.host for c in report.components] == hosted[offload]
        # The same arrays, only in another memory.
        assert [c.measured for c in report.components] == [c.measured for c in device.components]
        assert report.host_total == sum(c.measured for c in report.components if c.host)
        assert report.device_total == report.measured_total - report.host_total
        assert report.host_step_peak >= report.host_total

    # ZeRO-Offload's state: not held beside the backward pass, which then sets the peak.
    device, optimizer, grads = (reports[2, o] for o in (None, "optimizer", "grads"))
    backward = device.programs["backward"].peak_estimate
    assert optimizer.step_peak == backward + optimizer["params"].measured
    assert device.step_peak == backward + device.measured_total - device["grads"].measured
    # Gradients leave as produced: the device holds the largest gradient shard (fp32 256 x 64
    # over 8 devices), not all of them.
    largest_grad = 256 * 64 * 4 // 8
    hosted_backward = grads.programs["backward"]
    assert hosted_backward.host_output == grads["grads"].measured
    assert hosted_backward.in_flight == largest_grad
    assert hosted_backward.peak_estimate == backward - grads["grads"].measured + largest_grad
    assert grads.programs["update"].host_temp  # the update computes on the host
    # ZeRO-Infinity's CPU tier: no state in device memory, a lower device peak.
    params = reports[3, "params"]
    assert params.device_total == 0
    assert params.step_peak < reports[3, None].step_peak
