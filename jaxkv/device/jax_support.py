"""The jax releases jaxkv is tested with, checked once when the device side is imported.

The device side leans on recent and partly private JAX APIs (Mosaic GPU's interpret
mode, ``pltpu.InterpretParams``, ``jax.typeof``/``jax.sharding.reshard``, explicit mesh
axis types), so a jax outside the tested range is refused here with one clear error
instead of failing later, deep inside a kernel. ``pyproject.toml``'s extras state the
same range. Set ``JAXKV_ALLOW_UNTESTED_JAX=1`` to try another release anyway. The device
package imports this module first, so a missing jax is an
:class:`~jaxkv.errors.ExtraNotInstalledError` naming the extra to install, not a bare
``ModuleNotFoundError`` from deep inside.
"""

from __future__ import annotations

import os
import re

from jaxkv.errors import JaxkvError, raise_missing_extra

JAX_MISSING = "jaxkv's device side needs jax: pip install 'jaxkv[device]' (or 'jaxkv[cuda]', 'jaxkv[tpu]')"

try:
    import jax
except ModuleNotFoundError as err:
    raise_missing_extra(err, ("jax", "jaxlib"), JAX_MISSING)

OLDEST_JAX = (0, 10, 2)
"""The oldest jax the suite ran on (CPU machines)."""

FIRST_UNTESTED_JAX = (0, 12)
"""The first jax release not tested (GPU machines run 0.11.x)."""

ALLOW_UNTESTED_ENV = "JAXKV_ALLOW_UNTESTED_JAX"


class UnsupportedJaxError(JaxkvError, ImportError):
    """The installed jax is outside the range jaxkv's device side is tested with."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.10.2" -> (0, 10, 2), "0.11.0rc1" -> (0, 11, 0)."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", version)
    if match is None:
        raise UnsupportedJaxError(f"cannot read jax version {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def check_jax_version(version: str) -> None:
    """Raise :class:`UnsupportedJaxError` naming ``version`` unless it lies in the tested range."""
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    if not OLDEST_JAX <= release(version) < FIRST_UNTESTED_JAX:
        oldest = ".".join(map(str, OLDEST_JAX))
        first_untested = ".".join(map(str, FIRST_UNTESTED_JAX))
        raise UnsupportedJaxError(
            f"jax {version} is outside the range jaxkv is tested with (>={oldest},<{first_untested}): "
            f"pip install 'jaxkv[device]' (or [cuda], [tpu]), or set {ALLOW_UNTESTED_ENV}=1 to try it anyway"
        )


check_jax_version(jax.__version__)
