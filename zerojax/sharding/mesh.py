"""Device setup and mesh creation from a config.

`configure_devices` must run before JAX starts its backends (the first jax.devices() or array
operation): `devices.num_cpu_devices` becomes `jax_num_cpu_devices`, which JAX reads only once.
`zerojax.initialize` applies it itself.
Meshes use `AxisType.Auto` axes: GSPMD propagates the shardings we place on the arrays;
Explicit axes fail for converted torch programs (docs/design.md, "Meshes with automatic axes").
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from zerojax.config import Config, ConfigError, DevicesConfig, MeshConfig, apply_devices

__all__ = ["configure_devices", "make_mesh"]


def configure_devices(devices: DevicesConfig | Config) -> None:
    """Apply `devices.platform` and `devices.num_cpu_devices` to JAX.

    `zerojax.initialize` does this itself; call it yourself only to use JAX before that (right
    after `import jax`). If JAX has already started with a different CPU device count, raises
    ConfigError saying how to fix it.
    """
    apply_devices(devices.devices if isinstance(devices, Config) else devices)


def make_mesh(config: Config | MeshConfig, *, devices=None) -> Mesh:
    """The config's device mesh: its axes in order, sizes resolved, all axes `AxisType.Auto`.

    `config` is a loaded `Config` (`zerojax.load_config(path)`) or its `mesh`. `devices`
    defaults to all devices of the configured platform; their number must be the device count
    the config was loaded against.
    """
    if isinstance(config, Config):
        platform, config = config.devices.platform, config.mesh
    elif isinstance(config, MeshConfig):
        platform = None
    else:
        raise TypeError(
            f"make_mesh takes a Config, got {type(config).__name__}; load it once with "
            "zerojax.load_config(path_or_dict) and pass the result"
        )
    if devices is None:
        devices = jax.devices(platform) if platform else jax.devices()
    if len(devices) != config.num_devices:
        raise ConfigError(
            f"mesh {dict(zip(config.axis_names, config.shape))} was resolved for "
            f"{config.num_devices} devices, but {len(devices)} are available; reload the config "
            "on this machine (load_config(..., num_devices=N)), or, for simulated CPU devices, "
            "let zerojax.initialize apply devices.num_cpu_devices before JAX starts"
        )
    return jax.make_mesh(
        config.shape,
        config.axis_names,
        axis_types=(AxisType.Auto,) * len(config.axis_names),
        devices=devices,
    )
