"""What the tests of tx_jax's MKL path share: the skip where MKL's GEMM can't load (the
cpu-mkl extra is not installed, or no C++ compiler), a mesh by axis sizes, and the
handler's calls in a compiled program."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from tx_jax.cpu import gemm as cpu_gemm

requires_mkl = pytest.mark.skipif(
    cpu_gemm._load() is not None, reason=f"MKL's GEMM unavailable here: {cpu_gemm._load()}"
)

MESH_AXES = ("data", "fsdp", "sequence", "tensor")


def mesh(**sizes) -> Mesh:
  shape = tuple(sizes.get(name, 1) for name in MESH_AXES)
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def hlo_calls(compiled_text: str, target: str = cpu_gemm.TARGET) -> list[str]:
  """The lines of a compiled program that call `target`."""
  return [line for line in compiled_text.splitlines() if f'"{target}"' in line]
