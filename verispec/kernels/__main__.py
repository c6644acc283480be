"""``python -m verispec.kernels``: build the kernels once and say what the int4/int8 layers will use."""

from verispec.kernels import main

main()
