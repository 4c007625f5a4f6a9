"""The fleet's devices: what each device runs."""
