"""Hand-scheduled TIR kernels, per instruction set."""
