"""Device setup and mesh creation from a config.

`configure_devices` must run before JAX starts its backends (the first jax.devices() or array
operation): `devices.num_cpu_devices` becomes `jax_num_cpu_devices`, which JAX reads only once.
Meshes use `AxisType.Auto` axes: GSPMD propagates the shardings we place on the arrays;
Explicit axes fail for converted torch programs (DESIGN.md).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from zerojax.config import Config, ConfigError, DevicesConfig, MeshConfig, load_config

__all__ = ["configure_devices", "make_mesh"]


def configure_devices(devices: DevicesConfig | Config) -> None:
    """Apply `devices.platform` and `devices.num_cpu_devices` to JAX.

    Call right after `import jax`, before any JAX operation. If JAX has already started with a
    different CPU device count, raises ConfigError saying how to fix it.
    """
    if isinstance(devices, Config):
        devices = devices.devices
    if devices.platform is not None and jax.config.jax_platforms != devices.platform:
        try:
            jax.config.update("jax_platforms", devices.platform)
        except RuntimeError:  # backends already up: only a mismatch is a problem
            pass
    if devices.num_cpu_devices is None:
        return
    try:
        jax.config.update("jax_num_cpu_devices", devices.num_cpu_devices)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != devices.num_cpu_devices:
            raise ConfigError(
                f"devices.num_cpu_devices={devices.num_cpu_devices}: JAX already started with "
                f"{have} CPU devices; call zerojax.sharding.configure_devices(config) right after "
                "`import jax`, or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{devices.num_cpu_devices} before starting Python"
            ) from None


def make_mesh(config: Config | MeshConfig | str | dict, *, devices=None) -> Mesh:
    """The config's device mesh: its axes in order, sizes resolved, all axes `AxisType.Auto`.

    `devices` defaults to all devices of the configured platform; their number must be the
    device count the config was loaded against.
    """
    if not isinstance(config, MeshConfig):
        config = load_config(config)
        platform = config.devices.platform
        config = config.mesh
    else:
        platform = None
    if devices is None:
        devices = jax.devices(platform) if platform else jax.devices()
    if len(devices) != config.num_devices:
        raise ConfigError(
            f"mesh {dict(zip(config.axis_names, config.shape))} was resolved for "
            f"{config.num_devices} devices, but {len(devices)} are available; reload the config "
            "on this machine (load_config(..., num_devices=N))"
        )
    return jax.make_mesh(
        config.shape,
        config.axis_names,
        axis_types=(AxisType.Auto,) * len(config.axis_names),
        devices=devices,
    )
