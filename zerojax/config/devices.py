"""Applying the `devices` section to JAX, which reads it only while its backends are not up.

JAX has no public "have the backends started?" query; the probe is the setting itself:
`jax.config.update("jax_num_cpu_devices", n)` raises RuntimeError once they have (JAX's own
guard), so nothing is changed behind a running backend. A refused update is an error only
when the running backend differs from what the config asks for.
"""

from __future__ import annotations

from zerojax.config.checks import ConfigError
from zerojax.config.schema import DevicesConfig

__all__ = ["apply_devices"]


def apply_devices(devices: DevicesConfig) -> None:
    """Set `jax_platforms` and `jax_num_cpu_devices` from `devices` if JAX has not started.

    Raises ConfigError, saying how to fix it, if JAX already runs with another CPU device
    count: the first JAX operation of the process fixed it.
    """
    import jax

    if devices.platform is not None and jax.config.jax_platforms != devices.platform:
        try:
            jax.config.update("jax_platforms", devices.platform)
        except RuntimeError:  # backends already up: only a device-count mismatch matters
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
                f"{have} CPU devices, and the count is fixed when it starts (the first jax "
                "operation, jax.devices() or array creation, in this process). Either call "
                "zerojax.initialize (or zerojax.sharding.configure_devices(config)) before "
                "anything else uses JAX, or start Python with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={devices.num_cpu_devices}"
            ) from None
