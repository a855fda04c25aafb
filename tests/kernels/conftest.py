"""The kernel tests run the Triton kernels on the CPU under TRITON_INTERPRET=1 (set by ``triton_interpreter``,
where no GPU is present), or compiled on a GPU."""

from triton_interpreter import faster_triton_interpreter  # noqa: F401
